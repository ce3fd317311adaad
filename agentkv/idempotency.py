"""Retried control calls are idempotent: a call that names an idempotency key is applied once, and
every retry with the same key (in the same tenant) answers the first call's answer again.

Why: a control call (pause, resume, DELETE) that times out at the client or at the route (503)
may still have been applied by the engine. Retrying it blindly pauses twice (a second decision,
learned waits counted twice) or answers 404 to a DELETE that did succeed. With a key the retry
gets the first answer, whatever happened in between.

Primitives:
    KEY_HEADER, KEY_FIELD       ``Idempotency-Key`` (HTTP header) / ``idempotency_key`` (body
                                field and control-channel field; routers drop unknown headers)
    WINDOW_S, MAX_KEYS          an answer is remembered for 600 s after the first call, at most
                                10,000 keys (the oldest is forgotten first)
    validate_key(value)         the key, or ValueError: 1-255 visible ASCII characters
    ReplayCache(clock, window_s, max_keys)
        run(key, tenant, request, apply) -> (status, body, replayed)
                                the first call with ``key`` runs ``apply()`` and remembers its
                                answer unless it is a 5xx (a failure: a retry tries again); a
                                retry of the same request answers that answer (``replayed``
                                True) without running ``apply``; the same key with another
                                request (op, trajectory, branch, fields) is a 422 and runs
                                nothing. Keys are scoped to the tenant (its cache_salt): another
                                tenant's same key is another key. Thread-safe: a retry arriving
                                while the first call runs waits for its answer.
    forget(), __len__           (tests and memory accounting)

The cache lives in the engine process next to the manager (the routes' answers may be lost
in transit, the engine's are not), per DP rank; it does not survive a restart.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agentkv.manager.state import scoped_id

KEY_HEADER = "idempotency-key"
KEY_FIELD = "idempotency_key"
WINDOW_S = 600.0
MAX_KEYS = 10_000
MAX_KEY_LEN = 255

Reply = tuple[int, dict[str, Any]]


def validate_key(value: object) -> str:
    """Return ``value`` when it is a usable idempotency key, else raise ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_KEY_LEN:
        raise ValueError(f"must be 1-{MAX_KEY_LEN} characters, got {len(value)}")
    if not all("!" <= ch <= "~" for ch in value):
        raise ValueError("must be visible ASCII characters (no spaces)")
    return value


def _fingerprint(request: Mapping[str, Any]) -> bytes:
    """What a retry must repeat: every field but the key and the tenant (both in the scope)."""
    fields = {k: v for k, v in request.items() if k not in (KEY_FIELD, "cache_salt")}
    raw = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.blake2b(raw, digest_size=16).digest()


@dataclass(slots=True)
class _Answer:
    fingerprint: bytes
    expires_at: float
    status: int
    body: dict[str, Any]


class ReplayCache:
    """Answers of control calls by idempotency key (see the module docstring)."""

    def __init__(
        self,
        clock: Callable[[], float],
        window_s: float = WINDOW_S,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self._clock = clock
        self.window_s = window_s
        self.max_keys = max_keys
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        # Held while a keyed call runs: control calls are served one at a time anyway (one
        # control thread), and a retry must see the first call's answer, not run beside it.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._answers)

    def forget(self) -> None:
        with self._lock:
            self._answers.clear()

    def run(
        self,
        key: str,
        tenant: str | None,
        request: Mapping[str, Any],
        apply: Callable[[], Reply],
    ) -> tuple[int, dict[str, Any], bool]:
        scope = scoped_id(key, tenant)
        fingerprint = _fingerprint(request)
        with self._lock:
            now = self._clock()
            self._expire(now)
            seen = self._answers.get(scope)
            if seen is not None:
                if seen.fingerprint != fingerprint:
                    return (
                        422,
                        {
                            "detail": f"{KEY_FIELD} {key!r} was used for another request "
                            "(another op, trajectory, branch or body) within the last "
                            f"{self.window_s:g} s"
                        },
                        False,
                    )
                return seen.status, dict(seen.body), True
            status, body = apply()
            if status < 500:
                # A deep copy (the answer is JSON): the manager may change what it returned.
                kept = copy.deepcopy(body)
                self._answers[scope] = _Answer(fingerprint, now + self.window_s, status, kept)
                while len(self._answers) > self.max_keys:
                    self._answers.popitem(last=False)
            return status, body, False

    def _expire(self, now: float) -> None:
        # Insertion order is expiry order (one window for every key).
        while self._answers:
            oldest = next(iter(self._answers.values()))
            if oldest.expires_at > now:
                break
            self._answers.popitem(last=False)
