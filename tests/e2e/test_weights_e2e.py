"""Tier copies never outlive the weights they were computed with, on the real server.

- ``POST /reset_prefix_cache?reset_external=true`` drops every tier copy (the next turn loads 0
  tier tokens) while a plain ``/reset_prefix_cache`` keeps them (the next turn loads them).
- The RL loop: pause generation (without clearing caches), change the tiny model's weights with
  vLLM's own ``reload_weights`` (``/collective_rpc``), name them with ``/update_weight_version``,
  a plain prefix-cache reset, resume. The next turn of a trajectory offloaded before the update
  loads nothing from the tiers and gives exactly what the new weights give.

Its own server (the weights change): grace_s 0.3, declared waits <= 2 s go to host.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    Server,
    long_text,
    own_server,
    tokens_and_logprobs,
    two_turns,
    wait_until,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rl_server() -> Iterator[Server]:
    # A trainer's own weight-sync RPC (tests/e2e/trainer_ext.py) next to vLLM's.
    with own_server(
        "weights", vllm_args=("--worker-extension-cls", "tests.e2e.trainer_ext.TrainerWeightSync")
    ) as srv:
        yield srv


def _offloaded_to_host(server: Server, tid: str, messages: list[dict[str, str]]) -> None:
    server.chat(messages, trajectory=tid)
    assert server.pause(tid, f"{tid}-tool", 1.0)["decision"]["action"] == "offload_host"
    server.wait_state(tid, {"offloaded"})


def _post(server: Server, path: str, **kw: Any) -> dict[str, Any]:
    r = server.client.post(path, **kw)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return dict(r.json()) if r.content else {}


def test_reset_external_drops_tier_copies_and_a_plain_reset_keeps_them(rl_server: Server) -> None:
    server = rl_server
    first, second = two_turns(10)
    tid = "reset-kept"
    _offloaded_to_host(server, tid, first)
    server.reset_prefix_cache()  # plain: vLLM forgets, the tier copies stay
    kept = server.chat(second, trajectory=tid)["kv_transfer_params"]["agentkv"]
    assert kept["tier_hit_tokens"] > 0, kept

    third = [*second, {"role": "user", "content": "Observation: " + long_text(12, 60)}]
    _offloaded_to_host(server, tid, second)
    generation = server.status()["engine"]["kv_generation"]

    def external_reset() -> bool:
        return bool(
            _post(server, "/reset_prefix_cache", params={"reset_external": "true"})["success"]
        )

    wait_until(external_reset, "reset_prefix_cache?reset_external=true to succeed", timeout=30)
    status = server.status()
    assert status["engine"]["kv_generation"] != generation
    assert status["bytes_held"]["host"] == 0 and status["bytes_held"]["disk"] == 0, status
    got = server.chat(third, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["tier_hit_tokens"] == 0, stats
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    server.end(tid)


def _perturbed_copy(model_dir: Path, out: Path, seed: int = 1234) -> Path:
    """A copy of the tiny model whose every weight moved: other weights, same architecture."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    generator = torch.Generator().manual_seed(seed)
    moved = {
        name: (t.float() + 0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in tensors.items()
    }
    save_file(moved, str(weights), metadata={"format": "pt"})
    return out


def test_weight_update_makes_older_tier_copies_unloadable(rl_server: Server) -> None:
    from agentkv import modelgen

    server = rl_server
    first, second = two_turns(20)
    tid = "rl-rollout"
    old_ref = server.chat(second, salt="ref-old-weights")  # the old weights' answer
    _offloaded_to_host(server, tid, first)
    assert server.trajectory(tid)["branches"]["main"]["residency_blocks"].get("host", 0) > 0
    new_weights = _perturbed_copy(
        modelgen.default_model_dir("tiny"), Path(tempfile.mkdtemp()) / "tiny-v2"
    )
    generation = server.status()["engine"]["kv_generation"]

    # The RL loop: pause without clearing anything, new weights, a new version, a plain prefix
    # reset (vLLM's own cache is the trainer's business), resume. No reset_external anywhere.
    _post(server, "/pause", params={"mode": "abort", "clear_cache": "false"})
    _post(
        server,
        "/collective_rpc",
        json={"method": "reload_weights", "kwargs": {"weights_path": str(new_weights)}},
    )
    _post(server, "/update_weight_version", json={"new_version": "step-1"})
    assert server.client.get("/weight_info").json()["weight_version"] == "step-1"
    server.reset_prefix_cache()
    _post(server, "/resume")

    assert server.status()["engine"]["kv_generation"] != generation
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["tier_hit_tokens"] == 0, stats  # nothing computed by the old weights loads
    new_ref = server.chat(second, salt="ref-new-weights")  # the new weights, from scratch
    assert tokens_and_logprobs(got) == tokens_and_logprobs(new_ref)
    assert tokens_and_logprobs(new_ref) != tokens_and_logprobs(old_ref), (
        "the weights did not change"
    )
    server.end(tid)


def test_a_trainers_own_weight_rpc_and_a_plain_reset_load_nothing_older(rl_server: Server) -> None:
    """OpenRLHF's sync (issue 41): its own worker method ``update_weight`` through
    ``/collective_rpc``, then a plain ``/reset_prefix_cache``, no pause. On a name list of vLLM's
    methods the RPC passed unseen and the plain reset kept the tier copies: the next turn loaded
    the old weights' KV from host (1,408 tokens) and its greedy text differed."""
    from agentkv import modelgen

    server = rl_server
    first, second = two_turns(40)
    tid = "rl-trainer-rpc"
    _offloaded_to_host(server, tid, first)
    new_weights = _perturbed_copy(
        modelgen.default_model_dir("tiny"), Path(tempfile.mkdtemp()) / "tiny-v3", seed=4321
    )
    generation = server.status()["engine"]["kv_generation"]
    _post(
        server,
        "/collective_rpc",
        json={"method": "update_weight", "kwargs": {"weights_path": str(new_weights)}},
    )
    server.reset_prefix_cache()
    assert server.status()["engine"]["kv_generation"] != generation
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["tier_hit_tokens"] == 0, stats
    fresh = server.chat(second, salt="ref-trainer-weights")
    assert tokens_and_logprobs(got) == tokens_and_logprobs(fresh)
    server.end(tid)


def test_vllm_pause_clearing_caches_succeeds_while_agentkv_holds_device_blocks(
    rl_server: Server,
) -> None:
    """vLLM's /pause (clear_cache defaults to true) resets its prefix cache, which it refuses
    while any block is held; a retained trajectory's pins are released first, so the RL loop's
    pause succeeds, and the retained KV (old weights) is gone."""
    server = rl_server
    first, _ = two_turns(30)
    tid = "retained-at-pause"
    server.chat(first, trajectory=tid)
    assert server.pause(tid, "retain-at-pause", 0.0005)["decision"]["action"] == "retain"
    assert server.status()["pool"]["pinned_blocks"] > 0
    _post(server, "/pause")  # mode abort, clear_cache true: vLLM's defaults
    _post(server, "/resume")
    assert server.status()["pool"]["pinned_blocks"] == 0
    assert server.trajectory_code(tid) == 404
