"""agentkv on an in-process ``AsyncLLM`` (issue 41): no API server, no HTTP, no routes plugin.

verl 0.9.1's rollout server drives vLLM in process (read from its released source):
``AsyncLLM.generate(TokensPrompt(prompt_token_ids=...), SamplingParams(max_tokens=..., **sp),
request_id)`` in ``workers/rollout/vllm_rollout/vllm_async_server.py`` ~558-662, where
``server.generate(kv_transfer_params=...)`` is merged into
``sampling_params.extra_args["kv_transfer_params"]`` (~629-632), and a new
``request_id = uuid4().hex`` per turn (``workers/rollout/llm_server.py`` ~90-96). This module
makes the same calls with ``agentkv_vllm.inprocess``: the params helper, the stats from the
``RequestOutput``, and the pause/end ops and timer pump of ``InProcessAgentKV``. verl's,
OpenRLHF's and ROLL's own weight syncs (their worker-method names and call shapes, through the
worker extension tests/e2e/trainer_ext.py) leave nothing older loadable.

One engine for the module (~1 min on CPU): the e2e servers' engine arguments (the tiny embedded
model, enforce_eager, the capped block count, max_model_len) and ``own_connector``'s settings.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from tests.e2e.conftest import NUM_BLOCKS, own_connector
from tests.e2e.trainer_ext import perturbed_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402

from agentkv import modelgen  # noqa: E402
from agentkv_vllm import inprocess  # noqa: E402
from agentkv_vllm.params import KV_HINT_ACTION, KV_HINT_VERSION  # noqa: E402

T = TypeVar("T")
VOCAB = 8192  # the tiny model's
MAX_TOKENS = 8


async def _until(probe: Callable[[], Awaitable[T | None]], what: str, timeout: float = 30) -> T:
    """Await ``probe`` until it returns something truthy (a condition wait with a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)


# On the tests' own loop: AsyncLLM's output handler runs on the loop that created it.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[Any]:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    work = Path(tempfile.mkdtemp(prefix="agentkv-e2e-inprocess-"))
    env = {
        "AGENTKV_RUN_DIR": str(work / "run"),
        "AGENTKV_PROFILE": str(work / "no-profile.json"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    args = AsyncEngineArgs(
        model=str(modelgen.ensure_model("tiny")),
        enforce_eager=True,
        max_model_len=8192,
        num_gpu_blocks_override=NUM_BLOCKS,
        enable_prefix_caching=True,
        # The RL frameworks' own weight-sync methods (verl's, OpenRLHF's, ROLL's).
        worker_extension_cls="tests.e2e.trainer_ext.TrainerWeightSync",
        kv_transfer_config=KVTransferConfig(
            kv_connector="AgentKVConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=own_connector(work),
        ),
    )
    llm = AsyncLLM.from_engine_args(args)
    try:
        yield llm
    finally:
        llm.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _verl_generate(
    llm: Any,
    prompt_ids: list[int],
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    **kw: Any,
) -> Any:
    """verl's call: SamplingParams(max_tokens=..., **sampling_params), the kv_transfer_params
    merged into extra_args, a fresh uuid4 request id per turn; the final RequestOutput."""
    sampling_params: dict[str, Any] = {"temperature": 0.0, "logprobs": 0, "ignore_eos": True}
    params = SamplingParams(max_tokens=MAX_TOKENS, **sampling_params)
    if kv_transfer_params is not None:
        params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": kv_transfer_params}
    prompt = TokensPrompt(prompt_token_ids=prompt_ids)
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    final = None
    async for output in llm.generate(prompt, params, request_id=uuid.uuid4().hex, **kw):
        final = output
    assert final is not None and final.finished
    return final


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _sampled(output: Any) -> list[tuple[int, float]]:
    """(token, logprob) of each sampled token: equal only for bit-identical KV."""
    completion = output.outputs[0]
    return [
        (tok, lp[tok].logprob)
        for tok, lp in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


async def test_verl_turns_resume_from_the_host_tier_with_exact_kv(engine: Any) -> None:
    tid = "verl-traj-0"
    params = inprocess.trajectory_params(tid)
    async with inprocess.InProcessAgentKV(engine) as kv:
        first_ids = _tokens(1, 700)
        first = await _verl_generate(engine, first_ids, params)
        stats = inprocess.turn_stats(first)
        assert stats is not None and stats["trajectory_id"] == tid and stats["turn"] == 1
        assert stats["identified_by"] == "kv_transfer_params.agentkv"

        # The environment step: the rollout pauses the trajectory without HTTP.
        status, body = await kv.pause(tid, "sandbox-inprocess", 1.0)
        assert status == 200 and body["decision"]["action"] == "offload_host", body

        async def offloaded() -> dict[str, Any] | None:
            code, got = await kv.get(tid)
            branch = got["branches"]["main"] if code == 200 else {}
            return got if branch.get("state") == "offloaded" else None

        got = await _until(offloaded, "the trajectory's host copy")
        assert got["branches"]["main"]["residency_blocks"].get("host", 0) > 0, got
        assert await engine.reset_prefix_cache()  # vLLM forgets: only the host tier holds it

        observation = _tokens(2, 90)
        second_ids = [*first_ids, *first.outputs[0].token_ids, *observation]
        # Reference: the same two turns from vLLM's own prefix cache (salted: no tier).
        await _verl_generate(engine, first_ids, cache_salt="ref-verl")
        ref = await _verl_generate(engine, second_ids, cache_salt="ref-verl")
        assert inprocess.turn_stats(ref) is None  # no trajectory: a vanilla request

        second = await _verl_generate(engine, second_ids, params)
        stats = inprocess.turn_stats(second)
        assert stats is not None and stats["turn"] == 2, stats
        assert stats["tier_hit_tokens"] > 0 and stats["tier"] == "host", stats
        assert stats["tier_hit_tokens"] == ref.num_cached_tokens, (stats, ref.num_cached_tokens)
        assert _sampled(second) == _sampled(ref)  # exact KV -> identical greedy tokens

        status, body = await kv.end(tid)
        assert status == 200, body
        assert (await kv.get(tid))[0] == 404


async def test_kv_hints_name_the_trajectory_of_an_in_process_request(engine: Any) -> None:
    hints = KvHintsEnvelope(
        protocol_version="1",
        message_id=uuid.uuid4().hex,
        actions=[KvHintAction("a1", KV_HINT_ACTION, KV_HINT_VERSION, {"trajectory_id": "hinted"})],
    )
    out = await _verl_generate(engine, _tokens(3, 300), kv_hints=hints)
    stats = inprocess.turn_stats(out)
    assert stats is not None and stats["trajectory_id"] == "hinted", stats
    assert stats["identified_by"] == "kv_hints"
    async with inprocess.InProcessAgentKV(engine) as kv:
        assert (await kv.end("hinted"))[0] == 200


async def test_an_implicit_pause_needs_no_pause_call(engine: Any) -> None:
    """A rollout loop that never pauses (OpenRLHF 0.11.2 / ROLL / verl: in-process
    ``AsyncLLM.generate``, tool calls parsed from tokens): ``implicit_pause`` in the request's
    params (or the connector's setting) makes each finished turn a pause decided by the wait
    learned for its environment (``env``), and the next turn resumes it from the tier."""
    tid, env = "implicit-traj-0", "sandbox-implicit-e2e"
    params = inprocess.trajectory_params(tid, implicit_pause=True, env=env)
    async with inprocess.InProcessAgentKV(engine) as kv:
        first_ids = _tokens(11, 700)
        first = await _verl_generate(engine, first_ids, params)
        stats = inprocess.turn_stats(first)
        assert stats is not None and stats["turn"] == 1, stats
        pause = stats["pause"]  # decided at the turn's finish: no pause call
        assert pause["implicit"] and pause["decision"]["action"] in ("offload_host", "offload_disk")
        assert pause["wait_estimate"]["source"] == "prior", pause  # nothing learned yet

        async def offloaded() -> dict[str, Any] | None:
            code, got = await kv.get(tid)
            branch = got["branches"]["main"] if code == 200 else {}
            return branch if branch.get("state") == "offloaded" else None

        branch = await _until(offloaded, "the implicit pause's tier copy")
        assert sum(branch["residency_blocks"].values()) > 0, branch
        assert await engine.reset_prefix_cache()  # the environment step: only the tier holds it

        second_ids = [*first_ids, *first.outputs[0].token_ids, *_tokens(12, 90)]
        second = await _verl_generate(engine, second_ids, params)
        stats = inprocess.turn_stats(second)
        assert stats is not None and stats["turn"] == 2, stats
        assert stats["tier_hit_tokens"] > 0, stats  # resumed from the tier
        _, status = await kv.status()
        assert status["predictor"].get(env) == 1, status["predictor"]  # the wait was learned

        assert (await kv.end(tid))[0] == 200


# --- The in-process frameworks' own weight syncs (issue 41) ------------------------------------
# Each framework's generate call and its sync's exact sequence on this module's engine; the
# worker methods (trainer_ext.py) reload a checkpoint where the real ones receive IPC handles,
# NCCL broadcasts or tensor buckets.

Generate = Callable[[Any, list[int], str | None, str | None, str], Awaitable[Any]]


async def _verl_turn(llm: Any, ids: list[int], tid: str | None, salt: str | None, rid: str) -> Any:
    """verl 0.9.1: ``server.generate(kv_transfer_params=...)`` (the one line: the agent loop's
    stable id as the trajectory), a fresh uuid4 per turn."""
    params = inprocess.trajectory_params(tid) if tid is not None else None
    return await _verl_generate(llm, ids, params, cache_salt=salt)


async def _verl_sync(llm: Any, weights: Path) -> None:
    """verl 0.9.1 (integrations.md; call site read in the 0.8.0.dev snapshot b178a3c):
    ``vllm_rollout.py:148-152`` ``_execute_method("update_weights_from_ipc", kwargs=...)``,
    which the rollout server runs as ``self.engine.collective_rpc(...)``
    (``vllm_async_server.py:183-190``); then ``reset_prefix_cache(reset_connector=True)``
    (``clear_kv_cache``/``wake_up``/``resume_kv_cache`` in 0.9.1; a plain reset in 0.8)."""
    await llm.collective_rpc("update_weights_from_ipc", kwargs={"weights_path": str(weights)})
    assert await llm.reset_prefix_cache(reset_connector=True)


async def _openrlhf_turn(
    llm: Any, ids: list[int], tid: str | None, salt: str | None, rid: str
) -> Any:
    """OpenRLHF 0.11 (snapshot 3c3be62, v0.11.0), ``trainer/ray/vllm_engine.py:155-179``:
    ``self.llm.generate(TokensPrompt(prompt_token_ids=...), deepcopy(sampling_params),
    request_id=random_uuid())``; the one line: the env's per-trajectory ``sampling_params``
    carry ``extra_args=inprocess.extra_args(trajectory_id)``."""
    from vllm.utils import random_uuid

    sampling_params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=0,
        ignore_eos=True,
        extra_args=inprocess.extra_args(tid) if tid is not None else None,
    )
    prompt = TokensPrompt(prompt_token_ids=ids)
    if salt is not None:
        prompt["cache_salt"] = salt
    final = None
    async for out in llm.generate(prompt, deepcopy(sampling_params), request_id=random_uuid()):
        final = out
    assert final is not None and final.finished
    return final


async def _openrlhf_sync(llm: Any, weights: Path) -> None:
    """OpenRLHF 0.11 (snapshot 3c3be62), ``trainer/ray/ppo_actor.py:408-427``
    ``broadcast_to_vllm``: a plain ``reset_prefix_cache()`` fired first (``:411-414``,
    ``vllm_engine.py:129-130``), then per parameter ``collective_rpc("update_weight",
    args=(name, dtype, shape, empty_cache))`` (``vllm_engine.py:117-121``): here one
    "parameter", the whole checkpoint."""
    await llm.reset_prefix_cache()
    await llm.collective_rpc("update_weight", args=(str(weights), "bfloat16", [], True))


async def _roll_turn(llm: Any, ids: list[int], tid: str | None, salt: str | None, rid: str) -> Any:
    """ROLL (snapshot 8eb27cc), ``roll/distributed/strategy/vllm_strategy.py:305-318``:
    ``self.model.generate(prompt=TokensPrompt(prompt_token_ids=payload["input_ids"]),
    sampling_params=SamplingParams(**payload["sampling_params"]), request_id=payload["rid"])``;
    the one line: ``payload["sampling_params"]["extra_args"] = inprocess.extra_args(tid)``."""
    payload: dict[str, Any] = {
        "rid": rid,
        "input_ids": ids,
        "sampling_params": {
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
        },
    }
    if tid is not None:
        payload["sampling_params"]["extra_args"] = inprocess.extra_args(tid)
    prompt = TokensPrompt(prompt_token_ids=payload["input_ids"])
    if salt is not None:
        prompt["cache_salt"] = salt
    final = None
    async for out in llm.generate(
        prompt=prompt,
        sampling_params=SamplingParams(**payload["sampling_params"]),
        request_id=payload["rid"],
    ):
        final = out
    assert final is not None and final.finished
    return final


async def _roll_sync(llm: Any, weights: Path) -> None:
    """ROLL (snapshot 8eb27cc): ``roll/third_party/vllm/async_llm.py:21-28``
    ``engine_core.collective_rpc_async(method="update_parameter_in_bucket",
    args=(serialized_named_tensors, is_lora))`` per bucket, then
    ``method="process_weights_after_loading"`` (``roll/pipeline/base_pipeline.py:96-100``);
    the next rollout's ``load_states`` resets the prefix cache plainly
    (``vllm_strategy.py:363-364``)."""
    core = llm.engine_core
    await core.collective_rpc_async(method="update_parameter_in_bucket", args=(str(weights), False))
    await core.collective_rpc_async(method="process_weights_after_loading")
    await llm.reset_prefix_cache()


@dataclass(frozen=True)
class _Framework:
    name: str
    turn: Generate
    sync: Callable[[Any, Path], Awaitable[None]]
    seed: int  # of its new weights: every sync must really change them


_FRAMEWORKS = [
    _Framework("verl", _verl_turn, _verl_sync, seed=6101),
    _Framework("openrlhf", _openrlhf_turn, _openrlhf_sync, seed=6102),
    _Framework("roll", _roll_turn, _roll_sync, seed=6103),
]


@pytest.mark.parametrize("fw", _FRAMEWORKS, ids=lambda fw: fw.name)
async def test_a_frameworks_turns_resume_from_host_and_its_sync_leaves_nothing_older(
    engine: Any, fw: _Framework
) -> None:
    """Two turns with an environment step between them resume from the host tier with exact
    KV; the framework's own weight sync follows a second environment step, and the third turn
    loads nothing older (no tier, no device hit) and gives exactly what the new weights give.
    On a name list of vLLM's weight RPCs (agentkv before issue 41) OpenRLHF's and ROLL's syncs
    passed unseen and their plain resets kept the host copy: the third turn loaded it."""
    async with inprocess.InProcessAgentKV(engine) as kv:
        try:
            await _rollout_across_a_sync(engine, kv, fw, f"{fw.name}-traj-sync")
        finally:  # a failure must not leave the trajectory's blocks to the next test
            await kv.end(f"{fw.name}-traj-sync")


async def _rollout_across_a_sync(engine: Any, kv: Any, fw: _Framework, tid: str) -> None:
    from agentkv import modelgen

    turns = 0

    async def turn(ids: list[int], trajectory: str | None, salt: str | None = None) -> Any:
        nonlocal turns
        turns += 1
        return await fw.turn(engine, ids, trajectory, salt, f"{fw.name}-rid-{turns}")

    async def env_step() -> None:
        status, body = await kv.pause(tid, f"sandbox-{fw.name}", 1.0)
        assert status == 200 and body["decision"]["action"] == "offload_host", body

        async def offloaded() -> dict[str, Any] | None:
            code, got = await kv.get(tid)
            branch = got["branches"]["main"] if code == 200 else {}
            return got if branch.get("state") == "offloaded" else None

        got = await _until(offloaded, "the trajectory's host copy")
        assert got["branches"]["main"]["residency_blocks"].get("host", 0) > 0, got
        # vLLM forgets: only the host tier holds it (retried while a block is still in use)
        await _until(engine.reset_prefix_cache, "vLLM's prefix cache reset")

    p1 = _tokens(fw.seed, 700)
    t1 = await turn(p1, tid)
    stats = inprocess.turn_stats(t1)
    assert stats is not None and stats["trajectory_id"] == tid and stats["turn"] == 1, stats

    await env_step()
    p2 = [*p1, *t1.outputs[0].token_ids, *_tokens(fw.seed + 1, 90)]
    t2 = await turn(p2, tid)
    stats = inprocess.turn_stats(t2)
    assert stats is not None and stats["turn"] == 2, stats
    assert stats["tier_hit_tokens"] > 0 and stats["tier"] == "host", stats
    await turn(p1, None, f"ref-{fw.name}-kv")  # the same two turns from vLLM's own cache
    ref = await turn(p2, None, f"ref-{fw.name}-kv")
    assert stats["tier_hit_tokens"] == ref.num_cached_tokens, (stats, ref.num_cached_tokens)
    assert _sampled(t2) == _sampled(ref)

    await env_step()
    p3 = [*p2, *t2.outputs[0].token_ids, *_tokens(fw.seed + 2, 90)]
    old = await turn(p3, None, f"ref-{fw.name}-old")  # the old weights' answer
    weights = perturbed_checkpoint(
        modelgen.default_model_dir("tiny"), Path(tempfile.mkdtemp()) / "tiny-new", fw.seed
    )
    generation = (await kv.status())[1]["engine"]["kv_generation"]
    await fw.sync(engine, weights)

    t3 = await turn(p3, tid)
    stats = inprocess.turn_stats(t3)
    assert stats is not None and stats["tier_hit_tokens"] == 0, stats  # nothing older loads
    assert t3.num_cached_tokens == 0  # nor a device block of the old weights
    assert (await kv.status())[1]["engine"]["kv_generation"] != generation
    new = await turn(p3, None, f"ref-{fw.name}-new")  # the new weights, from scratch
    assert _sampled(t3) == _sampled(new)
    assert _sampled(new) != _sampled(old), "the weights did not change"
