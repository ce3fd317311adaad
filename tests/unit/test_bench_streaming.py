"""The one SSE reader (harness_sdk.sse) and the bench's measured stream (agentkv_bench.streaming)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agentkv_bench.streaming import stream_measured, usage_counts
from harness_sdk.sse import sse_data

USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 32},
}
SSE = (
    ": keep-alive\n\n"
    'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
    "event: ping\n\n"
    f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n"
    "data: [DONE]\n\n"
    'data: {"choices": [{"index": 0, "delta": {"content": "after done"}}]}\n\n'
)


def _client(status: int = 200, text: str = SSE) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, text=text)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_sse_data_yields_data_payloads_up_to_done() -> None:
    async def go() -> list[str]:
        async with _client() as c, c.stream("POST", "http://x/v1/completions") as r:
            return [d async for d in sse_data(r)]

    got = asyncio.run(go())
    assert len(got) == 2  # the comment, the event line and everything after [DONE] are skipped
    assert json.loads(got[0])["choices"][0]["delta"]["content"] == "a"
    assert json.loads(got[1])["usage"] == USAGE


def test_stream_measured_reads_usage_from_the_final_chunk() -> None:
    async def go() -> tuple[float, float, int, int, int]:
        async with _client() as c:
            s = await stream_measured(c, "http://x/v1/completions", {"stream": True})
            return s.ttft_s, s.latency_s, s.prompt_tokens, s.cached_tokens, s.completion_tokens

    ttft, latency, prompt, cached, completion = asyncio.run(go())
    assert 0.0 <= ttft <= latency
    assert (prompt, cached, completion) == (40, 32, 3)


def test_stream_measured_names_the_failed_request() -> None:
    async def go() -> None:
        async with _client(503, "overloaded") as c:
            await stream_measured(c, "http://x/v1/chat/completions", {}, what="chat completion")

    with pytest.raises(RuntimeError, match="chat completion failed: 503 overloaded"):
        asyncio.run(go())


def test_a_request_longer_than_the_pool_allows_is_a_config_error_that_says_what_to_change() -> None:
    """A sweep's smallest pool sets --max-model-len for every pool; a workload longer than that
    used to end the sweep in a traceback (seen: `--quick --num-blocks 48,24,16`)."""
    from agentkv.errors import ConfigError

    text = '{"error":{"message":"This model\'s maximum context length is 1920 tokens."}}'

    async def go() -> None:
        async with _client(400, text) as c:
            await stream_measured(c, "http://x/v1/chat/completions", {}, what="chat completion")

    with pytest.raises(ConfigError, match=r"--max-model-len .* larger smallest pool"):
        asyncio.run(go())


def test_usage_counts_of_a_missing_usage_is_zero() -> None:
    assert usage_counts(None) == (0, 0, 0)
    assert usage_counts({"prompt_tokens": 5}) == (5, 0, 0)


def test_a_streamed_measurement_spreads_into_every_record_type() -> None:
    """drivers and trace_replay build their records with ``**asdict(streamed)``."""
    from dataclasses import asdict, fields

    from agentkv_bench.records import RequestRecord, RoundRecord, TurnRecord
    from agentkv_bench.streaming import Streamed

    s = Streamed(0.5, 1.5, 40, 32, 3)
    assert {f.name for f in fields(Streamed)} <= {f.name for f in fields(RequestRecord)}
    turn = TurnRecord(
        trajectory_id="t", kind="first", sent_at_s=0.0, branch="main", turn=0, tool=None,
        wait_s=0.0, **asdict(s),
    )  # fmt: skip
    rnd = RoundRecord(
        trajectory_id="t", kind="resume", sent_at_s=0.0, session_id="s", round=1,
        wait_before_s=2.0, planned_prefix=30, reusable_tokens=30, **asdict(s),
    )  # fmt: skip
    assert turn.recomputed_tokens == rnd.recomputed_tokens == 8
    assert (turn.ttft_s, rnd.latency_s) == (0.5, 1.5)
