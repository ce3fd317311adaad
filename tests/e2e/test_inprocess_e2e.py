"""agentkv on an in-process ``AsyncLLM`` (issue 41): no API server, no HTTP, no routes plugin.

verl 0.9.1's rollout server drives vLLM in process (read from its released source):
``AsyncLLM.generate(TokensPrompt(prompt_token_ids=...), SamplingParams(max_tokens=..., **sp),
request_id)`` in ``workers/rollout/vllm_rollout/vllm_async_server.py`` ~558-662, where
``server.generate(kv_transfer_params=...)`` is merged into
``sampling_params.extra_args["kv_transfer_params"]`` (~629-632), and a new
``request_id = uuid4().hex`` per turn (``workers/rollout/llm_server.py`` ~90-96). This module
makes the same calls with ``agentkv_vllm.inprocess``: the params helper, the stats from the
``RequestOutput``, and the pause/end ops and timer pump of ``InProcessAgentKV``.

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
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from tests.e2e.conftest import NUM_BLOCKS, own_connector

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
