"""The API-server side of device prefetch: the manager's orders become internal vLLM requests.

Primitives:
  PrefetchIssuer(engine_client, dp_rank)
      handle(tick_body)  the control channel's tick reply: issue its ``prefetch`` orders,
                         cancel the requests of its ``cancel`` tickets
      issue(order)       one internal prefill-only request: the order's token ids (with the
                         trajectory's cache_salt, so its blocks hash as the turns' did), one new
                         token, the lowest priority, ``kv_transfer_params.agentkv`` carrying the
                         trajectory, branch and the manager's ticket; the output is discarded
      cancel(ticket)     abort it (cancelling the task aborts the request in AsyncLLM)
      close()            cancel everything in flight

Why an ordinary request: vLLM's own load path (the connector's lookup, allocation, the async or
layerwise load on every TP rank) fills the device blocks and puts them in vLLM's prefix cache,
with no engine change; the scheduler-side manager recognises the ticket, plans the load as for a
turn (without a turn) and pins the blocks when the request finishes (agentkv.manager.prefetch).
Each request is bounded by PREFETCH_TIMEOUT_S; a failure is logged once and never retried (the
resume then reloads from the tier as without prefetch).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("agentkv.prefetch")

# vLLM's priority scheduling serves lower values first; FCFS ignores it.
PREFETCH_PRIORITY = 1 << 30
PREFETCH_TIMEOUT_S = 120.0
MAX_IN_FLIGHT = 256


class PrefetchIssuer:
    def __init__(self, engine_client: Any, dp_rank: int | None = None) -> None:
        self.engine_client = engine_client
        self.dp_rank = dp_rank
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.issued = 0
        self.failed = 0

    def handle(self, body: dict[str, Any]) -> None:
        for ticket in body.get("cancel") or ():
            self.cancel(str(ticket))
        for order in body.get("prefetch") or ():
            self.issue(order)

    def issue(self, order: dict[str, Any]) -> None:
        if self.engine_client is None or len(self.tasks) >= MAX_IN_FLIGHT:
            return
        ticket = str(order["ticket"])
        task = asyncio.get_running_loop().create_task(self._run(order))
        self.tasks[ticket] = task
        task.add_done_callback(lambda _t: self.tasks.pop(ticket, None))
        self.issued += 1

    def cancel(self, ticket: str) -> None:
        task = self.tasks.pop(ticket, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        self.tasks.clear()

    async def _run(self, order: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        ticket = str(order["ticket"])
        agentkv = {
            "trajectory_id": order["trajectory_id"],
            "branch": order["branch"],
            "prefetch": ticket,
        }
        params = SamplingParams(
            max_tokens=1,
            detokenize=False,
            extra_args={"kv_transfer_params": {"agentkv": agentkv}},
        )
        prompt = tokens_input(
            [int(t) for t in order["token_ids"]], cache_salt=order.get("cache_salt") or None
        )
        try:
            async with asyncio.timeout(PREFETCH_TIMEOUT_S):
                async for _ in self.engine_client.generate(
                    prompt,
                    params,
                    f"agentkv-prefetch-{ticket}",
                    priority=PREFETCH_PRIORITY,
                    data_parallel_rank=self.dp_rank,
                ):
                    pass  # the one token is nobody's answer
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never retried: the resume reloads from the tier instead
            self.failed += 1
            log.warning("agentkv: device prefetch %s failed: %s", ticket[:8], exc)
