"""The API-server side of device prefetch (plugins/agentkv_vllm/prefetch_issuer.py): each order
becomes one internal request through the engine client's ordinary ``generate``, a cancel
aborts it, a failure is logged and never retried."""

from __future__ import annotations

import asyncio
from typing import Any

from agentkv_vllm.prefetch_issuer import PREFETCH_PRIORITY, PrefetchIssuer

ORDER = {
    "ticket": "ab" * 16,
    "trajectory_id": "t1",
    "branch": "main",
    "cache_salt": "tenant-a",
    "token_ids": [1, 2, 3, 4, 5],
}


class FakeEngine:
    def __init__(self, block: bool = False, fail: bool = False) -> None:
        self.calls: list[tuple[Any, Any, str, dict[str, Any]]] = []
        self.block = block
        self.fail = fail
        self.cancelled = 0

    async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any) -> Any:
        self.calls.append((prompt, params, request_id, kw))
        if self.fail:
            raise RuntimeError("engine said no")
        try:
            if self.block:
                await asyncio.sleep(3600)
            yield object()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def test_an_order_is_one_prefill_only_internal_request() -> None:
    engine = FakeEngine()

    async def go() -> PrefetchIssuer:
        issuer = PrefetchIssuer(engine, dp_rank=1)
        issuer.handle({"prefetch": [ORDER], "cancel": []})
        await asyncio.gather(*issuer.tasks.values())
        return issuer

    issuer = asyncio.run(go())
    ((prompt, params, rid, kw),) = engine.calls
    assert prompt["prompt_token_ids"] == [1, 2, 3, 4, 5] and prompt["cache_salt"] == "tenant-a"
    assert params.max_tokens == 1 and not params.detokenize
    assert params.extra_args == {
        "kv_transfer_params": {
            "agentkv": {"trajectory_id": "t1", "branch": "main", "prefetch": "ab" * 16}
        }
    }
    assert rid == f"agentkv-prefetch-{'ab' * 16}"
    assert kw == {"priority": PREFETCH_PRIORITY, "data_parallel_rank": 1}
    assert issuer.issued == 1 and not issuer.tasks


def test_a_cancel_aborts_the_request_in_flight() -> None:
    engine = FakeEngine(block=True)

    async def go() -> None:
        issuer = PrefetchIssuer(engine)
        issuer.handle({"prefetch": [ORDER]})
        await asyncio.sleep(0.01)  # let the task reach the engine
        assert engine.calls
        issuer.handle({"cancel": [ORDER["ticket"]]})
        await asyncio.sleep(0.01)
        assert not issuer.tasks

    asyncio.run(go())
    assert engine.cancelled == 1


def test_a_failed_prefetch_is_counted_not_raised() -> None:
    engine = FakeEngine(fail=True)

    async def go() -> PrefetchIssuer:
        issuer = PrefetchIssuer(engine)
        issuer.handle({"prefetch": [ORDER]})
        await asyncio.gather(*issuer.tasks.values())
        return issuer

    assert asyncio.run(go()).failed == 1
