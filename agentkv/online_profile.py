"""Online calibration: the served model's prefill rate and the tiers' bandwidths, learned from the
engine's own steps and agentkv's own transfers.

Primitives:
  RollingRate        a robust rate estimate: the median of the last N samples (bytes or tokens
                     per second), with a sample count
  OnlineProfile      the rates the pause policy needs, each with where it came from
    observe_prefill(tokens, seconds)        one engine step that was mostly prefill
    observe_transfer(kind, tier, b, s)      one finished offload / reload of agentkv's
    costs(base) -> CostModel                ``base`` with every measured rate substituted
    view() -> {name: {value, source, samples}}   for GET /agentkv/v1/status

Why a rolling median, not an EWMA: step times on a shared machine have heavy tails (a GC pause, a
neighbour's burst); a median of the last 64 ignores them, and old samples age out so a changed
load is followed within 64 steps. Sources: "measured online" once ``min_samples`` arrived, else
the calibrate file's value, else the built-in default.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections import deque
from typing import Any

from agentkv.costs import CostModel

ONLINE = "measured online"


class RollingRate:
    def __init__(self, window: int = 64) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self._samples.append(amount / seconds)
            self.count += 1

    def value(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None


# CostModel field -> (kind, tier) of the transfers that measure it; a "host link" is both ways
# between the engine's KV and host memory: the slower direction bounds a round trip.
_TRANSFER_FIELDS = {
    ("offload", "host"): "host_write",
    ("reload", "host"): "host_read",
    ("offload", "disk"): "disk_write_bytes_per_s",
    ("reload", "disk"): "disk_read_bytes_per_s",
    ("offload", "remote"): "remote_write_bytes_per_s",
    ("reload", "remote"): "remote_read_bytes_per_s",
}
# Learned and shown, not yet in the cost model: the policy has no remote action of its own (every
# host offload is written through to the remote tier).
_REMOTE_RATES = ("remote_write_bytes_per_s", "remote_read_bytes_per_s")


class OnlineProfile:
    def __init__(self, base_source: str, min_samples: int = 3, window: int = 64) -> None:
        self.base_source = base_source  # "calibrate file" or "default"
        self.min_samples = min_samples
        self._rates = {
            name: RollingRate(window)
            for name in (
                "prefill_tokens_per_s",
                "host_write",
                "host_read",
                "disk_write_bytes_per_s",
                "disk_read_bytes_per_s",
                *_REMOTE_RATES,
            )
        }
        self._lock = threading.Lock()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._rates["prefill_tokens_per_s"].add(tokens, seconds)

    def observe_transfer(self, kind: str, tier: str, nbytes: int, seconds: float) -> None:
        name = _TRANSFER_FIELDS.get((kind, tier))
        if name is None:
            return
        with self._lock:
            self._rates[name].add(nbytes, seconds)

    def _measured(self, name: str) -> float | None:
        rate = self._rates[name]
        return rate.value() if rate.count >= self.min_samples else None

    def costs(self, base: CostModel) -> CostModel:
        """``base`` with each rate measured online (enough samples) put in its place."""
        with self._lock:
            changes: dict[str, Any] = {}
            prefill = self._measured("prefill_tokens_per_s")
            if prefill is not None:
                changes["prefill_tokens_per_s"] = prefill
            links = [v for v in (self._measured("host_write"), self._measured("host_read")) if v]
            if links:
                changes["host_link_bytes_per_s"] = min(links)
            for name in ("disk_write_bytes_per_s", "disk_read_bytes_per_s"):
                value = self._measured(name)
                if value is not None:
                    changes[name] = value
        return dataclasses.replace(base, **changes) if changes else base

    def view(self, base: CostModel) -> dict[str, dict[str, Any]]:
        live = self.costs(base)
        with self._lock:
            counts = {name: rate.count for name, rate in self._rates.items()}
        samples = {
            "prefill_tokens_per_s": counts["prefill_tokens_per_s"],
            "host_link_bytes_per_s": max(counts["host_write"], counts["host_read"]),
            "disk_write_bytes_per_s": counts["disk_write_bytes_per_s"],
            "disk_read_bytes_per_s": counts["disk_read_bytes_per_s"],
        }
        out = {}
        for name, n in samples.items():
            value = getattr(live, name)
            measured = value != getattr(base, name) or (n >= self.min_samples and value is not None)
            source = ONLINE if measured else (self.base_source if value is not None else "unknown")
            out[name] = {
                "value": round(value, 3) if value is not None else None,
                "source": source,
                "samples": n,
            }
        with self._lock:
            for name in _REMOTE_RATES:
                value = self._measured(name)
                out[name] = {
                    "value": round(value, 3) if value is not None else None,
                    "source": ONLINE if value is not None else "unknown",
                    "samples": self._rates[name].count,
                }
        return out
