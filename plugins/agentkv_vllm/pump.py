"""The timer pump: the API server task that fires the manager's timers while the engine is idle
and collects the device prefetch work only a ``tick`` hands out.

Primitives:
  timer_pump(client, issuer, engine_client)   forever: tick, hand the prefetch orders and
                                              cancels to ``issuer``, wake the engine loop when
                                              the tick queued engine work, sleep pump_delay
  pump_delay(body, last_steps)                the sleep after a tick reply (pure)

Why it backs off while the engine steps: vLLM's engine loop sleeps until a request arrives, so on
an idle engine only this task fires grace, lease, prefetch and job timers (and wakes the loop
for the work they queue); it then sleeps until the next timer, PUMP_MIN_S..PUMP_MAX_S. But every
engine step fires due timers too (``take_step``), so while the step count moves between two
ticks the pump sleeps PUMP_MAX_S, except that a PREFETCH timer's order reaches the API server
only through a tick: the sleep still ends when the next one is due. A timer that comes due just
as the engine goes idle fires at most PUMP_MAX_S late (the bound a timer armed between two ticks
already had). Each tick is one control call over a kept socket (``agentkv_vllm.control``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agentkv_vllm.control import ControlClient
from agentkv_vllm.prefetch_issuer import PrefetchIssuer

log = logging.getLogger("agentkv.routes")

PUMP_MIN_S, PUMP_MAX_S = 0.02, 0.2
RETRY_S = 1.0  # after a failed tick: the engine may be starting or gone


def _clamp(seconds: Any) -> float:
    return PUMP_MAX_S if seconds is None else min(PUMP_MAX_S, max(PUMP_MIN_S, float(seconds)))


def pump_delay(body: dict[str, Any], last_steps: int | None) -> float:
    """Seconds to sleep after a tick answered ``body``; ``last_steps``: the step count the
    previous tick answered (None: none yet). An engine that stepped since then fires every timer
    but PREFETCH itself; an engine that did not (or an old engine that does not say) needs the
    pump for the next timer of any kind."""
    steps = body.get("steps")
    stepping = steps is not None and last_steps is not None and steps != last_steps
    return _clamp(body.get("prefetch_in_s") if stepping else body.get("next_in_s"))


async def timer_pump(
    client: ControlClient, issuer: PrefetchIssuer | None = None, engine_client: Any = None
) -> None:
    """Forever: one tick, then the sleep ``pump_delay`` says; never raises."""
    last_steps: int | None = None
    while True:
        delay = PUMP_MAX_S
        try:
            status, body = await client.call("tick")
            if status == 200:
                if issuer is not None:
                    issuer.handle(body)
                if body.get("engine_work") and engine_client is not None:
                    # Any utility call wakes an idle engine loop, which then runs the work.
                    await engine_client.is_sleeping()
                delay = pump_delay(body, last_steps)
                last_steps = body.get("steps")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("agentkv: timer pump: %s", exc)
            delay = RETRY_S
        await asyncio.sleep(delay)
