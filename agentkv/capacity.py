"""Capacity arithmetic: how many agent trajectories a KV pool holds, and what it takes to hold N.

Primitives:
    weights_bytes_per_device   equation 4: N_params * b_weight / (TP * PP)
    kv_pool_bytes              equation 5: device memory - weights - runtime reserve
    usable_pool_bytes          the pool less the allocator's safety headroom (a fraction)
    trajectory_bytes           one trajectory's KV: context + output tokens, plus SSM state
    max_trajectories           floor(usable / per-trajectory bytes)
    max_trajectories_shared    equation 7 with sigma = 1 on a prefix held once
    StaticReservation          worst-case contiguous reservation: requests admitted, efficiency
    PagedPool                  paged allocation: blocks, token capacity, (B-1)/2 tail waste
    littles_law_concurrency    N = lambda * (T_gen + T_tool), resident with or without offload
    NodeSizing / size_node     a whole `agentkv size` answer for one deployment and context list

All byte figures are ints and every count is a floor: a trajectory that does not fit whole is not
counted. The sharing model (equation 7) charges a shared prefix once and each trajectory only its
private tokens; on sliding-window models the private part is the marginal KV of the longer
sequence, which is exact for full-attention layers and an upper bound for windowed ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentkv.errors import ConfigError
from agentkv.geometry import ModelGeometry


def weights_bytes_per_device(
    num_parameters: int, weight_dtype_bytes: float, tp: int = 1, pp: int = 1
) -> int:
    """Equation 4: bytes of weights on each device when sharded over ``tp * pp`` devices.

    Contract: positive inputs only (ConfigError otherwise); rounded up to whole bytes.
    """
    if num_parameters <= 0 or weight_dtype_bytes <= 0:
        raise ConfigError("parameter count and weight dtype width must be positive")
    _positive("tp", tp)
    _positive("pp", pp)
    return math.ceil(num_parameters * weight_dtype_bytes / (tp * pp))


def kv_pool_bytes(device_bytes: int, weights_bytes: int, runtime_bytes: int) -> int:
    """Equation 5: memory left for KV blocks once weights and the runtime reserve are placed.

    Contract: all figures describe the same set of devices. Raises ConfigError when the device
    memory is not positive or nothing is left for KV (the message shows the figures).
    """
    if device_bytes <= 0:
        raise ConfigError(f"device memory must be positive, got {device_bytes} bytes")
    if weights_bytes < 0 or runtime_bytes < 0:
        raise ConfigError("weights and runtime reserve must not be negative")
    pool = device_bytes - weights_bytes - runtime_bytes
    if pool <= 0:
        raise ConfigError(
            f"no memory left for KV: {device_bytes} B of device memory - {weights_bytes} B of "
            f"weights - {runtime_bytes} B runtime reserve = {pool} B; add devices or raise TP"
        )
    return pool


def usable_pool_bytes(pool_bytes: int, headroom: float = 0.0) -> int:
    """The pool less a safety headroom fraction in [0, 1) kept free for burst decode steps."""
    if not 0.0 <= headroom < 1.0:
        raise ConfigError(f"headroom must be a fraction in [0, 1), got {headroom}")
    if pool_bytes <= 0:
        raise ConfigError(f"KV pool must be positive, got {pool_bytes} bytes")
    return math.floor(pool_bytes * (1.0 - headroom))


def trajectory_bytes(
    geom: ModelGeometry, context_tokens: int, output_tokens: int = 0, tp: int = 1
) -> int:
    """KV bytes of one trajectory holding ``context_tokens + output_tokens`` (per rank if tp > 1).

    Contract: includes the fixed per-sequence SSM / linear-attention state of hybrid models.
    Raises ConfigError when the total token count is not positive.
    """
    tokens = context_tokens + output_tokens
    if context_tokens < 0 or output_tokens < 0 or tokens <= 0:
        raise ConfigError(f"a trajectory needs a positive token count, got {tokens}")
    return geom.kv_bytes(tokens, tp) + geom.state_bytes_per_sequence(tp)


def max_trajectories(usable_bytes: int, per_trajectory_bytes: int) -> int:
    """Floor of ``usable_bytes / per_trajectory_bytes``: whole trajectories that fit."""
    _positive("per-trajectory bytes", per_trajectory_bytes)
    return max(0, usable_bytes) // per_trajectory_bytes


def max_trajectories_shared(
    usable_bytes: int, shared_bytes: int, private_bytes_per_trajectory: int
) -> int:
    """Equation 7 with full deduplication of a prefix: ``floor((usable - shared) / private)``.

    Contract: the shared prefix is held once; 0 when it alone does not fit.
    """
    _positive("private bytes per trajectory", private_bytes_per_trajectory)
    return max(0, usable_bytes - shared_bytes) // private_bytes_per_trajectory


@dataclass(frozen=True)
class StaticReservation:
    """Worst-case contiguous reservation of ``S_max`` tokens per request (Napkin Math 0.2)."""

    reservation_bytes: int
    max_requests: int
    allocation_efficiency: float
    """Used / allocated bytes when every request holds the mean length."""
    idle_bytes: int
    """Reserved but unwritten bytes at ``max_requests`` requests of mean length."""


def static_reservation(
    geom: ModelGeometry, pool_bytes: int, max_tokens: int, mean_tokens: int, tp: int = 1
) -> StaticReservation:
    """Price static worst-case reservation of ``max_tokens`` for requests of ``mean_tokens``.

    Contract: ``pool_bytes`` and the result are per rank when tp > 1 (the pool and the token
    cost must describe the same devices). Raises ConfigError when mean > max or either <= 0.
    """
    _positive("static reservation tokens", max_tokens)
    _positive("mean tokens", mean_tokens)
    if mean_tokens > max_tokens:
        raise ConfigError(f"mean length {mean_tokens} exceeds the reservation {max_tokens}")
    reserve = geom.kv_bytes(max_tokens, tp)
    used = geom.kv_bytes(mean_tokens, tp)
    requests = max(0, pool_bytes) // reserve
    return StaticReservation(
        reservation_bytes=reserve,
        max_requests=requests,
        allocation_efficiency=used / reserve,
        idle_bytes=requests * (reserve - used),
    )


@dataclass(frozen=True)
class PagedPool:
    """A paged KV pool on one device (Napkin Math 0.3)."""

    block_size: int
    block_bytes: int
    num_blocks: int
    token_capacity: int
    expected_tail_waste_tokens: float
    """(B - 1) / 2: expected unused slots in each sequence's last block."""


def paged_pool(
    pool_bytes_per_device: int, bytes_per_token_per_device: int, block_size: int
) -> PagedPool:
    """Cut one device's pool into blocks of ``block_size`` tokens.

    Contract: ``num_blocks = floor(pool / (B * bytes_per_token))``; ConfigError on sizes <= 0.
    """
    _positive("block size", block_size)
    _positive("bytes per token", bytes_per_token_per_device)
    block_bytes = block_size * bytes_per_token_per_device
    blocks = max(0, pool_bytes_per_device) // block_bytes
    return PagedPool(
        block_size=block_size,
        block_bytes=block_bytes,
        num_blocks=blocks,
        token_capacity=blocks * block_size,
        expected_tail_waste_tokens=(block_size - 1) / 2,
    )


def tail_waste_bytes(num_sequences: int, block_size: int, bytes_per_token: int) -> float:
    """Expected bytes stranded in last blocks: ``n * (B - 1) / 2 * bytes_per_token``."""
    if num_sequences < 0:
        raise ConfigError(f"sequence count must not be negative, got {num_sequences}")
    _positive("block size", block_size)
    return num_sequences * (block_size - 1) / 2 * bytes_per_token


def fragmentation_ratio(
    num_sequences: int, block_size: int, bytes_per_token: int, pool_bytes: int
) -> float:
    """Expected tail waste as a fraction of the pool (0.12% for 256 seqs, B=16, 40 KiB, 60 GiB)."""
    _positive("pool bytes", pool_bytes)
    return tail_waste_bytes(num_sequences, block_size, bytes_per_token) / pool_bytes


@dataclass(frozen=True)
class ToolWaitConcurrency:
    """Little's law for agent trajectories that alternate generation and tool waits."""

    in_flight: float
    """N = lambda * (T_gen + T_tool): trajectories alive at once."""
    resident_without_offload: float
    """All of them hold KV in device memory."""
    resident_with_offload: float
    """Only generating ones do, N = lambda * T_gen; paused ones wait in host/disk tiers."""
    paused: float
    """lambda * T_tool: trajectories waiting on a tool at any moment."""


def littles_law_concurrency(
    arrival_rate_per_s: float, generate_s: float, tool_wait_s: float
) -> ToolWaitConcurrency:
    """Concurrency from Little's law, ``N = lambda * (T_gen + T_tool)``, with and without offload.

    Contract: rates and times are non-negative (ConfigError otherwise); the offload figure
    assumes every paused trajectory leaves device memory and is back before it generates.
    """
    for name, value in (
        ("arrival rate", arrival_rate_per_s),
        ("generation time", generate_s),
        ("tool wait", tool_wait_s),
    ):
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"{name} must be a non-negative number, got {value}")
    generating = arrival_rate_per_s * generate_s
    paused = arrival_rate_per_s * tool_wait_s
    return ToolWaitConcurrency(
        in_flight=generating + paused,
        resident_without_offload=generating + paused,
        resident_with_offload=generating,
        paused=paused,
    )


@dataclass(frozen=True)
class ContextSizing:
    """One context length's answer in a node sizing."""

    tokens: int
    bytes: int
    """Whole-model KV of one trajectory (context + output tokens, plus SSM state)."""
    bytes_per_device: int
    max_trajectories: int | None
    max_trajectories_shared: int | None
    static_max_requests: int | None
    static_allocation_efficiency: float | None
    tail_waste_bytes: float | None
    fragmentation_ratio: float | None
    beyond_max_position: bool


@dataclass(frozen=True)
class NodeSizing:
    """A deployment's KV budget and what it holds at each context length."""

    bytes_per_token: int
    bytes_per_token_per_device: int
    num_devices: int
    tp: int
    kv_pool_bytes: int | None
    usable_pool_bytes: int | None
    shared_bytes: int
    paged: PagedPool | None
    contexts: list[ContextSizing]
    warnings: list[str] = field(default_factory=list)


def size_node(
    geom: ModelGeometry,
    contexts: Sequence[int],
    *,
    pool_bytes: int | None,
    num_devices: int = 1,
    tp: int = 1,
    headroom: float = 0.0,
    output_tokens: int = 0,
    shared_tokens: int = 0,
    block_size: int = 16,
    static_max_tokens: int | None = None,
    num_sequences: int | None = None,
) -> NodeSizing:
    """Answer `agentkv size`: per-context footprint and trajectories a pool of ``pool_bytes`` holds.

    Contract: ``pool_bytes`` is the KV pool summed over ``num_devices`` devices (None: report
    footprints only). Shared tokens are part of each context and held once. Tail waste is taken
    at ``num_sequences`` or, when None, at each context's ``max_trajectories``. A context beyond
    the model's max_position_embeddings is still sized, with a warning.
    """
    _positive("tp", tp)
    _positive("number of devices", num_devices)
    if num_devices % tp:
        raise ConfigError(f"{num_devices} devices cannot be split into TP groups of {tp}")
    if not contexts:
        raise ConfigError("give at least one context length")
    if shared_tokens < 0 or output_tokens < 0:
        raise ConfigError("shared and output token counts must not be negative")
    warnings = list(geom.warnings)
    per_token = geom.kv_bytes_per_token()
    per_token_dev = geom.kv_bytes_per_token(tp)
    usable = None if pool_bytes is None else usable_pool_bytes(pool_bytes, headroom)
    shared_bytes = geom.kv_bytes(shared_tokens) if shared_tokens else 0
    paged = None
    if pool_bytes is not None:
        paged = paged_pool(pool_bytes // num_devices, per_token_dev, block_size)
    replicas = num_devices // tp
    rows = []
    for tokens in contexts:
        _positive("context length", tokens)
        if shared_tokens > tokens:
            raise ConfigError(f"shared prefix {shared_tokens} is longer than context {tokens}")
        beyond = geom.max_position_embeddings is not None and tokens > geom.max_position_embeddings
        if beyond:
            warnings.append(
                f"context {tokens} exceeds max_position_embeddings {geom.max_position_embeddings}"
            )
        whole = trajectory_bytes(geom, tokens, output_tokens)
        per_device = trajectory_bytes(geom, tokens, output_tokens, tp)
        row = ContextSizing(tokens, whole, per_device, None, None, None, None, None, None, beyond)
        if usable is not None and pool_bytes is not None:
            row = _with_pool(
                row,
                geom,
                pool_bytes,
                usable,
                shared_bytes if shared_tokens else None,
                output_tokens,
                replicas,
                static_max_tokens,
                (block_size, num_sequences, per_token),
            )
        rows.append(row)
    return NodeSizing(
        bytes_per_token=per_token,
        bytes_per_token_per_device=per_token_dev,
        num_devices=num_devices,
        tp=tp,
        kv_pool_bytes=pool_bytes,
        usable_pool_bytes=usable,
        shared_bytes=shared_bytes,
        paged=paged,
        contexts=rows,
        warnings=warnings,
    )


def _with_pool(
    row: ContextSizing,
    geom: ModelGeometry,
    pool_bytes: int,
    usable: int,
    shared_bytes: int | None,
    output_tokens: int,
    replicas: int,
    static_max_tokens: int | None,
    paging: tuple[int, int | None, int],
) -> ContextSizing:
    """``row`` with what a pool of ``usable`` bytes holds at its context: trajectories (also with
    ``shared_bytes`` held once; None: no shared prefix), static reservations per replica, tail
    waste of ``paging`` = (block size, sequences or None for the max, bytes per token)."""
    block_size, num_sequences, per_token = paging
    tokens, whole, beyond = row.tokens, row.bytes, row.beyond_max_position
    n = max_trajectories(usable, whole)
    n_shared = (
        n
        if shared_bytes is None
        else max_trajectories_shared(usable, shared_bytes, whole - shared_bytes)
    )
    static = None
    s_max = static_max_tokens or geom.max_position_embeddings
    if s_max is not None and tokens + output_tokens <= s_max:
        static = static_reservation(geom, usable // replicas, s_max, tokens + output_tokens)
    seqs = n if num_sequences is None else num_sequences
    return ContextSizing(
        tokens=tokens,
        bytes=whole,
        bytes_per_device=row.bytes_per_device,
        max_trajectories=n,
        max_trajectories_shared=n_shared,
        static_max_requests=None if static is None else static.max_requests * replicas,
        static_allocation_efficiency=None if static is None else static.allocation_efficiency,
        tail_waste_bytes=tail_waste_bytes(seqs, block_size, per_token),
        fragmentation_ratio=fragmentation_ratio(seqs, block_size, per_token, pool_bytes),
        beyond_max_position=beyond,
    )


@dataclass(frozen=True)
class PlanOption:
    """One way to serve the target load: a TP degree and how many devices it takes."""

    tp: int
    trajectories_per_replica: int
    replicas: int
    devices: int
    nodes: int
    usable_pool_bytes_per_replica: int


def plan_devices(
    geom: ModelGeometry,
    *,
    trajectories: int,
    context_tokens: int,
    device_bytes: int,
    tp: int,
    pp: int = 1,
    runtime_bytes_per_device: int,
    weights_bytes_per_replica: int | None = None,
    headroom: float = 0.0,
    output_tokens: int = 0,
    shared_tokens: int = 0,
    devices_per_node: int = 8,
) -> PlanOption:
    """Answer `agentkv plan` for one TP degree: replicas, devices and nodes for ``trajectories``.

    Contract: a replica is ``tp * pp`` devices of ``device_bytes`` each; the shared prefix is
    held once per replica. Raises ConfigError when one replica holds no trajectory at all.
    """
    _positive("trajectories", trajectories)
    _positive("device memory", device_bytes)
    _positive("devices per node", devices_per_node)
    group = tp * pp
    if weights_bytes_per_replica is None:
        if geom.num_parameters is None:
            raise ConfigError("parameter count unknown for this config; give --weights-bytes")
        weights_bytes_per_replica = (
            weights_bytes_per_device(geom.num_parameters, geom.weight_dtype_bytes, tp, pp) * group
        )
    pool = kv_pool_bytes(
        device_bytes * group, weights_bytes_per_replica, runtime_bytes_per_device * group
    )
    usable = usable_pool_bytes(pool, headroom)
    whole = trajectory_bytes(geom, context_tokens, output_tokens)
    if shared_tokens:
        shared = geom.kv_bytes(shared_tokens)
        per_replica = max_trajectories_shared(usable, shared, whole - shared)
    else:
        per_replica = max_trajectories(usable, whole)
    if per_replica == 0:
        raise ConfigError(
            f"one replica of {group} device(s) cannot hold a single {context_tokens}-token "
            "trajectory; use a larger TP or bigger devices"
        )
    replicas = math.ceil(trajectories / per_replica)
    devices = replicas * group
    return PlanOption(
        tp=tp,
        trajectories_per_replica=per_replica,
        replicas=replicas,
        devices=devices,
        nodes=math.ceil(devices / devices_per_node),
        usable_pool_bytes_per_replica=usable,
    )


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
