"""Tier copies never outlive the weights they were computed with, on the real server.

- ``POST /reset_prefix_cache?reset_external=true`` drops every tier copy (the next turn loads 0
  tier tokens) while a plain ``/reset_prefix_cache`` keeps them (the next turn loads them).
- The RL loop: pause generation (without clearing caches), change the tiny model's weights with
  vLLM's own ``reload_weights`` (``/collective_rpc``), name them with ``/update_weight_version``,
  a plain prefix-cache reset, resume. The next turn of a trajectory offloaded before the update
  loads nothing from the tiers and gives exactly what the new weights give.
- The HTTP RL frameworks' own syncs (issue 41), SkyRL's and AReaL's exact call sequences with
  their own worker-method names (tests/e2e/trainer_ext.py): a trajectory's turns resume from
  host with exact KV, and after the sync nothing older loads.

Its own server (the weights change; with the frameworks' worker extension and
``--enable-scale-out`` for SkyRL's ``/inference/v1/generate``): grace_s 0.3, declared waits
<= 2 s go to host.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from tests.e2e.trainer_ext import perturbed_checkpoint

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rl_server() -> Iterator[Server]:
    # The RL frameworks' own weight-sync RPCs (tests/e2e/trainer_ext.py) next to vLLM's, and
    # vLLM's token-in/token-out route (SkyRL's; served only with --enable-scale-out).
    ext = ("--worker-extension-cls", "tests.e2e.trainer_ext.TrainerWeightSync")
    with own_server("weights", vllm_args=(*ext, "--enable-scale-out")) as srv:
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
    return perturbed_checkpoint(model_dir, out, seed)


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


# --- The HTTP frameworks' own syncs (issue 41): SkyRL and AReaL, their exact call sequences ----


@dataclass(frozen=True)
class _Turn:
    tokens: list[int]  # the generated ids (the next turn's prompt goes on from them)
    sampled: list[Any]  # ids and logprobs: equal only for bit-identical KV and weights
    stats: dict[str, Any] | None  # agentkv's stats of the turn (None: a vanilla request)


_MAX_TOKENS = 8


def _agentkv_stats(reply: dict[str, Any]) -> dict[str, Any] | None:
    params = reply.get("kv_transfer_params") or {}
    return params.get("agentkv")


def _skyrl_generate(server: Server, ids: list[int], session: str | None, salt: str | None) -> _Turn:
    """SkyRL 0.3.0 (snapshot a956457), ``remote_inference_client.py:469-501``: ``POST
    /inference/v1/generate {token_ids, sampling_params, model, cache_salt}``; the generator's
    ``X-Session-ID: {instance_id}_{repetition_id}`` (``skyrl_gym_generator.py`` ~325)."""
    body: dict[str, Any] = {
        "model": server.model,
        "token_ids": ids,
        "sampling_params": {
            "max_tokens": _MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
        },
    }
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"X-Session-ID": session} if session is not None else {}
    r = server.client.post("/inference/v1/generate", json=body, headers=headers)
    assert r.status_code == 200, r.text
    reply = dict(r.json())
    choice = reply["choices"][0]
    return _Turn(
        list(choice["token_ids"]), [choice["token_ids"], choice["logprobs"]], _agentkv_stats(reply)
    )


def _skyrl_sync(server: Server, weights: Path) -> None:
    """SkyRL 0.3.0 (snapshot a956457), a non-colocated sync: ``pause_generation()`` = ``/pause
    mode=keep clear_cache=False`` (``workers/worker_dispatch.py:702``,
    ``remote_inference_client.py:985-1017``); ``/collective_rpc`` ``skyrl_start_weight_update``
    ``{is_checkpoint_format: True}``, ``update_weights_ipc {update_info}`` per chunk,
    ``skyrl_finish_weight_update`` (``weight_sync/cuda_ipc_strategy.py:194,247,257``,
    ``remote_inference_client.py:1197,1223,1269``); the prefix reset
    ``/reset_prefix_cache?reset_running_requests=True`` created before the chunks and awaited
    after them (``workers/fsdp/fsdp_worker.py:285,318``); ``resume_generation()``
    (``worker_dispatch.py:707``). The chunk's payload names a checkpoint (trainer_ext.py)."""
    _post(server, "/pause", params={"mode": "keep", "clear_cache": "false"})
    try:
        rpc = "/collective_rpc"
        _post(
            server,
            rpc,
            json={"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}},
        )
        update_info = {"weights_path": str(weights)}
        _post(
            server,
            rpc,
            json={"method": "update_weights_ipc", "kwargs": {"update_info": update_info}},
        )
        _post(server, rpc, json={"method": "skyrl_finish_weight_update"})
        _post(server, "/reset_prefix_cache", params={"reset_running_requests": "true"})
    finally:
        _post(server, "/resume")


def _areal_generate(server: Server, ids: list[int], session: str | None, salt: str | None) -> _Turn:
    """AReaL 1.0.4 (snapshot 4aef98d), ``areal/engine/vllm_remote.py:52-96``: ``POST
    /v1/completions`` with the prompt's token ids and this flat payload; the tokens come back as
    ``token:<id>`` in ``logprobs.tokens`` (``:106-109``). AReaL sends no trajectory id: the one
    added line is the body's ``session_id`` (docs/rl.md)."""
    payload: dict[str, Any] = {
        "model": server.model,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": _MAX_TOKENS,
        "temperature": 0.0,
        "stop_token_ids": [],
        "ignore_eos": True,
        "skip_special_tokens": True,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
        "use_beam_search": False,
        "stream": False,
        "prompt": ids,
    }
    if session is not None:
        payload["session_id"] = session
    if salt is not None:
        payload["cache_salt"] = salt
    r = server.client.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    reply = dict(r.json())
    logprobs = reply["choices"][0]["logprobs"]
    tokens = [int(t.split(":")[1]) for t in logprobs["tokens"]]
    return _Turn(tokens, [tokens, logprobs["token_logprobs"]], _agentkv_stats(reply))


def _areal_sync(server: Server, weights: Path) -> None:
    """AReaL 1.0.4 (snapshot 4aef98d): its route ``/areal_update_weights {model_path}``
    (``areal/engine/vllm_ext/areal_vllm_server.py:164-177``) runs
    ``pause_generation(wait_for_inflight_requests=False, clear_cache=True)``,
    ``collective_rpc("areal_update_weights", args=(model_path,))`` and ``resume_generation()``.
    That route is AReaL's own app's; on vLLM's the same three calls are ``/pause`` (mode abort,
    clear_cache true), ``/collective_rpc`` with ``args`` and ``/resume``."""
    _post(server, "/pause", params={"mode": "abort", "clear_cache": "true"})
    try:
        _post(
            server,
            "/collective_rpc",
            json={"method": "areal_update_weights", "args": [str(weights)]},
        )
    finally:
        _post(server, "/resume")


@dataclass(frozen=True)
class _HttpFramework:
    name: str
    generate: Callable[[Server, list[int], str | None, str | None], _Turn]
    sync: Callable[[Server, Path], None]
    seed: int  # of its new weights: every sync must really change them


_HTTP_FRAMEWORKS = [
    # SkyRL with generator.use_cache_salt=False: its default per-weight-version cache_salt would
    # put the next turn in another namespace and hide a stale load; without it the sync's RPCs
    # and plain reset are all that stand between old KV and the new weights.
    _HttpFramework("skyrl", _skyrl_generate, _skyrl_sync, seed=5101),
    _HttpFramework("areal", _areal_generate, _areal_sync, seed=5102),
]


@pytest.mark.parametrize("fw", _HTTP_FRAMEWORKS, ids=lambda fw: fw.name)
def test_an_http_frameworks_turns_resume_from_host_and_its_sync_leaves_nothing_older(
    rl_server: Server, fw: _HttpFramework
) -> None:
    """Two turns of a trajectory with an environment step between them resume from the host
    tier with exact KV; the framework's own weight sync follows a second environment step, and
    the third turn loads nothing from the tiers and gives exactly what the new weights give.
    No agentkv pause call: after the grace a finished turn's blocks get a host copy."""
    tid = f"{fw.name}-instance-{fw.seed}_0"
    try:
        _rollout_across_a_sync(rl_server, fw, tid)
    finally:  # a failure must not leave the trajectory's blocks to the next test
        rl_server.end(tid)


def _rollout_across_a_sync(server: Server, fw: _HttpFramework, tid: str) -> None:
    from agentkv import modelgen

    first, _ = two_turns(fw.seed)
    p1 = server.tokenize(first)
    t1 = fw.generate(server, p1, tid, None)
    assert t1.stats is not None and t1.stats["trajectory_id"] == tid and t1.stats["turn"] == 1

    def env_step() -> None:
        server.wait_state(tid, {"offloaded"})
        assert server.trajectory(tid)["branches"]["main"]["residency_blocks"].get("host", 0) > 0
        server.reset_prefix_cache()  # vLLM forgets: only the host tier holds the context

    def observation(seed: int) -> list[int]:
        return server.tokenize([{"role": "user", "content": long_text(seed, 60)}])

    env_step()
    p2 = [*p1, *t1.tokens, *observation(fw.seed + 1)]
    t2 = fw.generate(server, p2, tid, None)
    assert t2.stats is not None and t2.stats["turn"] == 2, t2.stats
    assert t2.stats["tier_hit_tokens"] > 0 and t2.stats["tier"] == "host", t2.stats
    # The same two turns from vLLM's own prefix cache (salted: no tier) on the same weights.
    fw.generate(server, p1, None, f"ref-{fw.name}-kv")
    assert t2.sampled == fw.generate(server, p2, None, f"ref-{fw.name}-kv").sampled

    env_step()
    p3 = [*p2, *t2.tokens, *observation(fw.seed + 2)]
    old = fw.generate(server, p3, None, f"ref-{fw.name}-old")  # the old weights' answer
    weights = perturbed_checkpoint(
        modelgen.default_model_dir("tiny"), Path(tempfile.mkdtemp()) / "tiny-new", fw.seed
    )
    generation = server.status()["engine"]["kv_generation"]
    fw.sync(server, weights)

    t3 = fw.generate(server, p3, tid, None)
    assert t3.stats is not None and t3.stats["tier_hit_tokens"] == 0, t3.stats
    assert server.status()["engine"]["kv_generation"] != generation
    new = fw.generate(server, p3, None, f"ref-{fw.name}-new")  # the new weights, from scratch
    assert t3.sampled == new.sampled
    assert new.sampled != old.sampled, "the weights did not change"


def test_the_rollout_bench_drives_a_rollout_across_a_real_weight_sync(rl_server: Server) -> None:
    """``agentkv bench rollout``'s driver and sync on the real server: each trajectory is one
    agentkv trajectory of consecutive turns (its one line: the id with ``implicit_pause``), each
    turn's history is cached, and after the bench's weight sync (OpenRLHF's ``update_weight``
    through ``/collective_rpc``, a plain reset) the tiers that held step 0's contexts hold
    nothing and step 1's first turns load nothing from them."""
    import asyncio

    from agentkv import modelgen
    from agentkv_bench.rollout import RolloutShape, plan_step, run_steps
    from agentkv_bench.rollout_run import http_sync
    from agentkv_bench.rollout_weights import perturbed_checkpoint as trainer_step

    server = rl_server
    shape = RolloutShape(
        trajectories=2,
        group=2,
        turns=2,
        steps=2,
        system_tokens=300,
        task_tokens=100,
        observation_tokens=60,
        output_tokens=4,
        env_median_s=0.0,
        seed=41,
    )
    weights = trainer_step(
        modelgen.default_model_dir("tiny"), Path(tempfile.mkdtemp()) / "tiny-rollout", 4101
    )
    inner = http_sync(server.base_url, [weights], True, server.headers)

    def tier_blocks() -> int:
        tiers = server.status()["tiers"]
        return int(tiers["host"]["blocks"]) + int(tiers["disk"]["blocks"])

    async def sync(k: int) -> tuple[float, int | None]:
        # The server writes back eagerly: step 0's paused contexts reach a tier first (the
        # first pause, with nothing learned, goes to disk), so the sync has something to drop.
        await asyncio.to_thread(wait_until, tier_blocks, "step 0's tier copies")
        check_turns(k)
        return await inner(k)

    def check_turns(k: int) -> None:
        for plan in plan_step(shape, k):
            turns = server.trajectory(plan.trajectory_id)["turns"]
            assert [t["turn"] for t in turns] == [1, 2], (plan.trajectory_id, turns)
            if k == 1:
                assert turns[0]["tier_hit_tokens"] == 0, turns[0]

    steps = asyncio.run(
        run_steps(server.base_url, "tiny", shape, True, sync, headers=server.headers)
    )
    assert steps[0].tier_blocks_after_sync == 0, steps[0]
    # The sync ended step 0's trajectories (their KV was computed by the old weights).
    assert all(server.trajectory_code(p.trajectory_id) == 404 for p in plan_step(shape, 0))
    check_turns(1)
    for t in (t for s in steps for t in s.turns if t.turn == 2):
        assert t.cached_tokens >= 384, t  # the first turn's 400 prompt tokens, whole blocks
