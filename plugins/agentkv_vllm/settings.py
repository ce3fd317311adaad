"""Connector settings: ``kv_connector_extra_config`` of ``--kv-transfer-config``.

Validated with pydantic at this edge; a bad value fails engine start with a message naming the
field (an operator error, caught before any request is served).

``rl`` (``agentkv serve --rl``) is the RL rollout engine's switch: it turns on ``RL_SETTINGS``
(what an RL trainer needs by default, docs/rl.md); a setting given explicitly keeps its value.
"""

from __future__ import annotations

import enum
import os
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from agentkv.manager import ManagerConfig
from agentkv.policy import DEFAULT_POLICY, HIGH_WATER, Action, Writeback

if TYPE_CHECKING:
    from agentkv.tiers.remote import RemoteConfig


class LoadMode(enum.StrEnum):
    AUTO = "auto"  # layerwise on CPU, async elsewhere
    ASYNC = "async"  # the request waits until every block is loaded
    LAYERWISE = "layerwise"  # host blocks copied layer by layer inside the prefill step


# The environment variable of the operator view's key (``ConnectorSettings.operator_key``).
OPERATOR_KEY_ENV = "AGENTKV_OPERATOR_KEY"


# What the ``rl`` switch turns on, each for an RL trainer's rollout engine (docs/rl.md):
#   reset_invalidates_tiers  OpenRLHF, ROLL and SkyRL follow a sync with a plain reset
#   implicit_pause           rollout loops never call the pause route (every finished turn pauses)
#   salt_generations         SkyRL's per-weight-version cache_salt is a generation, not a tenant
RL_SETTINGS = MappingProxyType(
    {"reset_invalidates_tiers": True, "implicit_pause": True, "salt_generations": True}
)


def _default_run_dir() -> str:
    return os.environ.get("AGENTKV_RUN_DIR") or str(
        Path(tempfile.gettempdir()) / f"agentkv-{os.getuid()}"
    )


class ConnectorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host_capacity_gib: float = Field(
        default=4.0, gt=0, description="Host RAM tier size per worker."
    )
    disk_dir: str | None = Field(
        default=None, description="Disk tier directory; None disables the disk tier."
    )
    disk_capacity_gib: float = Field(default=32.0, gt=0)
    # Defaults of the manager's knobs are ManagerConfig's and PolicyParams' (written once there).
    grace_s: float = Field(
        default=ManagerConfig.grace_s,
        ge=0,
        description="How long finished blocks stay pinned waiting for a pause decision.",
    )
    default_action: Action = Field(
        default=Action.OFFLOAD_HOST,
        description="What a finished turn's blocks get when no pause decision came in grace_s "
        "(one of agentkv.policy.Action).",
    )
    policy_override: Action | None = Field(
        default=None,
        description="Benchmark knob: every pause takes this action whatever the policy decides "
        "(retain holds for max_lease_s, unless the resume or pool pressure ends it). The fixed "
        "policies `agentkv bench agents --configs retain-always,offload-always` run against. "
        "Unset (the default) in production.",
    )
    high_water: float = Field(
        default=HIGH_WATER,
        gt=0,
        le=1,
        description="Pool use above which retained trajectories are demoted.",
    )
    lease_margin_s: float = Field(default=DEFAULT_POLICY.lease_margin_s, ge=0)
    max_lease_s: float = Field(default=DEFAULT_POLICY.max_lease_s, gt=0)
    writeback: Writeback = Field(
        default=Writeback.FORECAST,
        description="forecast: an offload_host decision unpins into vLLM's prefix cache and "
        "copies to host only once the pool's free-block trend forecasts eviction before the "
        "resume (a copy nobody reads costs bandwidth and, on CPU, decode compute); eager: copy "
        "at once.",
    )
    admission_wait: bool = Field(
        default=False, description="Above high water, new trajectories wait instead of evicting."
    )
    device_prefetch: bool = Field(
        default=ManagerConfig.device_prefetch,
        description="At a paused trajectory's predicted return, load its KV back into device "
        "blocks with an internal prefill-only request (one token, lowest priority, never "
        "returned) and pin it under a short lease, so the resume is a prefix-cache hit "
        "(docs/prefetch.md). Skipped when the queue waits on blocks, the pool is near high "
        "water or the wait prediction is too uncertain.",
    )
    device_prefetch_max_spread: float = Field(
        default=DEFAULT_POLICY.device_prefetch_max_spread,
        gt=1,
        description="A device prefetch is issued only when the wait prediction's p90/p10 is at "
        "most this.",
    )
    profile_path: str | None = None
    run_dir: str = Field(default_factory=_default_run_dir)
    control_socket: str | None = Field(
        default=None, description="ZMQ endpoint of the control channel (default: ipc in run_dir)."
    )
    io_threads: int = Field(default=2, ge=1, le=64)
    load_mode: LoadMode = Field(
        default=LoadMode.AUTO,
        description="How blocks come back from a tier. layerwise: host blocks are copied layer by "
        "layer during the step that prefills the new tokens (each attention layer waits only for "
        "its own layer); async: the request waits until every block is loaded, then is scheduled. "
        "auto: layerwise on CPU, async elsewhere (the CUDA layerwise path is not yet validated). "
        "Disk blocks always load async (a block's checksum covers all its layers).",
    )

    disk_after_s: float = Field(
        default=DEFAULT_POLICY.disk_after_s,
        ge=0,
        description="Predicted median waits at least this long go to the disk tier (policy).",
    )
    job_timeout_s: float = Field(
        default=ManagerConfig.job_timeout_s,
        gt=0,
        description="A store, load or tier move not reported by every TP rank in this time fails: "
        "its device blocks are unpinned and recomputed, its keys dropped.",
    )
    idle_ttl_s: float = Field(
        default=ManagerConfig.idle_ttl_s,
        gt=0,
        description="A trajectory with no request for this long is deleted (its KV released).",
    )
    max_trajectories: int = Field(
        default=ManagerConfig.max_trajectories,
        ge=1,
        description="Cap on the trajectory table; the least recently active idle one goes first.",
    )
    auto_pause: bool = Field(
        default=True,
        description="A trajectory's reply that ends in tool calls pauses it by itself (tool = the "
        "called function, wait = its learned wait); an explicit pause or resume overrides.",
    )
    implicit_pause: bool = Field(
        default=False,
        description="Every finished turn of a trajectory is a pause (for in-process RL rollouts "
        "that never call the pause route and parse tool calls from tokens): decided with no "
        "declared wait, so the wait learned for the request's `env` (default `env`) decides "
        "retain or offload, and the next turn resumes it. Skipped when the branch's next request "
        "is already queued, the request carries `pause_after`, or a pause came meanwhile; an "
        "explicit pause or resume overrides. A request's `implicit_pause` field wins over this.",
    )
    remote_url: str | None = Field(
        default=None,
        description="Shared remote tier (Valkey/Redis), e.g. valkey://host:6379/0, valkeys:// for "
        "TLS. Every block offloaded to host is written there too, and a trajectory this replica "
        "never saw is looked up there before its first turn here (failover, rebalancing). See "
        "docs/remote-tier.md for the URL options (password, TLS files).",
    )
    remote_key_prefix: str = Field(
        default="agentkv",
        min_length=1,
        max_length=64,
        description="Key prefix of this deployment on the remote server.",
    )
    remote_key: SecretStr | None = Field(
        default=None,
        description="Deployment secret that names and authenticates remote blocks (HMAC-SHA256); "
        "default: the AGENTKV_REMOTE_KEY environment variable. Every replica of a deployment "
        "uses the same one; without one, remote blocks are checksummed but not authenticated.",
    )
    remote_ttl_s: float = Field(
        default=3600.0, gt=0, description="Remote blocks expire this long after their last use."
    )
    readonly_rpcs: list[str] = Field(
        default_factory=list,
        description="Worker RPC method names (collective_rpc) that never change the weights, "
        "beyond vLLM's own (agentkv_vllm.weight_sync.READ_ONLY_RPCS). Every other RPC is taken "
        "as a weight change: each tier copy written before it becomes unloadable.",
    )
    reset_invalidates_tiers: bool = Field(
        default=False,
        description="A plain reset_prefix_cache() (without reset_external / reset_connector) "
        "invalidates the tiers too, as RL trainers that reset after a weight sync need (OpenRLHF, "
        "ROLL, SkyRL). Off: a plain reset keeps tier copies (vLLM's own cache is reset).",
    )
    salt_generations: bool = Field(
        default=ManagerConfig.salt_generations,
        description="A cache_salt is a weight version, not a tenant (SkyRL sends a salt per weight "
        "version by default, `use_cache_salt`): the first request of a trajectory id under a new "
        "salt releases that id's trajectory under every other salt (the unsalted one included) "
        "as a DELETE would, before it is served (pins released, tier copies dropped; counted "
        "`salt_generation_releases`, logged once per old salt). Only the id that comes back: "
        "the old salt's other trajectories go when theirs do, or by lease and idle expiry. Off "
        "by default because on a multi-tenant server the same id under two salts is two "
        "tenants, and releasing one from the other would be a cross-tenant action.",
    )
    rl: bool = Field(
        default=False,
        description="An RL trainer's rollout engine (`agentkv serve --rl`): turns on "
        "reset_invalidates_tiers, implicit_pause and salt_generations (RL_SETTINGS; docs/rl.md). "
        "Any of them given explicitly keeps its value. Not for a multi-tenant server "
        "(salt_generations).",
    )
    operator_api_key: SecretStr | None = Field(
        default=None,
        description="Key of the cross-tenant operator view of GET /agentkv/v1/status (every "
        "tenant's trajectory ids, the learned tool waits): sent in the X-AgentKV-Operator-Key "
        "header, with the API key. Default: the AGENTKV_OPERATOR_KEY environment variable; "
        "without either, every caller gets its own tenant's view only.",
    )
    debug_load_delay_s: float = Field(
        default=0.0,
        ge=0,
        le=60,
        description="Test knob: every async tier load waits this long before copying (to test "
        "aborts during a load). Never set in production.",
    )
    debug_silent_rank_trajectory_prefix: str | None = Field(
        default=None,
        description="Test knob: TP rank 1 never reports store jobs of trajectories whose id starts "
        "with this prefix (to test job timeouts). Never set in production.",
    )

    @model_validator(mode="after")
    def _rl_turns_on_its_settings(self) -> Self:
        """``rl``: every setting of RL_SETTINGS not given explicitly takes its RL value."""
        if self.rl:
            for name, value in RL_SETTINGS.items():
                if name not in self.model_fields_set:
                    setattr(self, name, value)
        return self

    @field_validator("remote_url")
    @classmethod
    def _remote_url_parses(cls, value: str | None) -> str | None:
        if value:
            from agentkv.tiers.remote import RemoteConfig

            RemoteConfig.parse(value)  # ConfigError (a ValueError) names the bad part
        return value or None

    def remote_config(self) -> RemoteConfig | None:
        """The remote tier's RemoteConfig, or None without one."""
        if not self.remote_url:
            return None
        from agentkv.tiers.remote import RemoteConfig

        return RemoteConfig.parse(
            self.remote_url,
            key_prefix=self.remote_key_prefix,
            ttl_s=self.remote_ttl_s,
            auth_key=self.remote_key.get_secret_value() if self.remote_key else None,
        )

    def operator_key(self) -> str | None:
        """The operator view's key: ``operator_api_key``, else ``AGENTKV_OPERATOR_KEY``."""
        if self.operator_api_key is not None:
            return self.operator_api_key.get_secret_value() or None
        return os.environ.get(OPERATOR_KEY_ENV) or None

    def control_endpoint(self, engine_id: str | None = None, dp_rank: int = 0) -> str:
        """One channel per server and per DP rank: the API server and its engine cores share
        vLLM's ``kv_transfer_config.engine_id`` (a uuid per server), so two servers on one host
        never reach each other's engine. An explicit ``control_socket`` gets ``-dp<r>`` appended
        for ranks above 0."""
        if self.control_socket:
            if dp_rank and self.control_socket.startswith("ipc://"):
                return f"{self.control_socket}-dp{dp_rank}"
            return self.control_socket
        name = "control" if engine_id is None else f"control-{_safe_name(engine_id)}"
        return f"ipc://{Path(self.run_dir) / f'{name}-dp{dp_rank}.sock'}"


def base_engine_id(engine_id: str | None, dp_rank: int) -> str | None:
    """vLLM appends ``_dp<rank>`` to the engine id in each DP engine core; the API server only
    knows the base id."""
    if engine_id is None:
        return None
    suffix = f"_dp{dp_rank}"
    return engine_id.removesuffix(suffix) if engine_id.endswith(suffix) else engine_id


def _safe_name(engine_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in engine_id)[:64]
