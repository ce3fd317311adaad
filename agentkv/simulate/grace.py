"""The grace period in the simulated replica: a finished turn's blocks stay pinned (the plugin's
HELD state) until the harness's pause arrives, for at most ``grace_s``.

Primitives:
  GraceMixin        the replica's end-of-turn operations:
    _grace_init(grace_s)                  the connector's ``grace_s`` (``ManagerConfig.grace_s``)
    finish_turn(tid, ..., pause_after_s)  a turn's answer is complete and the harness's pause
                                          arrives ``pause_after_s`` later (0: at once, the bench
                                          and trace harnesses; None: never). At once, or for a
                                          policy outside the plugin: the pause applies now.
                                          Otherwise the blocks are pinned (HELD) and
                                          - the pause, arriving within the grace, applies then;
                                          - else the grace ends with the connector's default
                                            action (``ManagerConfig.default_action``,
                                            offload_host, decision ``grace_expired``): a copy
                                            deferred to the eviction forecast under
                                            ``writeback: forecast`` with the agentkv policy,
                                            else at once), and a pause arriving later
                                            still applies (a late pause: a retain re-pins what
                                            vLLM still caches, a copy already made is not
                                            repeated);
                                          - the trajectory's next turn, arriving first, takes
                                            the held blocks as its hit (nothing copied).
    _grace_forget(tid)                    the next turn was submitted, the trajectory ended, or
                                          pressure demoted its held pin
  Under pressure a held pin is demoted like any pin, after the retained ones (its predicted
  return is unknown: 0), which is the manager's order (retained first, then grace pins).

Kept apart from replica.py like the admission, prefetch and write-back mixins; ``Replica`` is
its only user.
"""

from __future__ import annotations

import itertools
import math
from functools import partial
from typing import Any

from agentkv.manager import ManagerConfig
from agentkv.policy import Action

GRACE_S = ManagerConfig.grace_s
"""The connector's default grace period (one definition: the manager's)."""
DEFAULT_ACTION = Action(ManagerConfig.default_action)
"""What a HELD branch gets when no pause came within the grace (the connector's default)."""


class GraceMixin:
    # The replica's (declared for the type checker; Replica sets them).
    env: Any
    pool: Any
    policy: Any
    host: Any
    remote: Any
    decisions: dict[str, int]
    demotions: int
    copy_blocks: dict[str, int]

    def _at(self, delay: float, fn: Any) -> None:
        raise NotImplementedError

    def pause(
        self, tid: str, tool: str | None, declared: float | None, tokens: int, blocks: int
    ) -> Any:
        raise NotImplementedError

    def _check_high_water(self) -> None:
        raise NotImplementedError

    _wb_on: bool

    def _defer_writeback(self, tid: str, wait_p90_s: float) -> None:
        raise NotImplementedError

    def _writeback_placed(self, tid: str) -> None:
        raise NotImplementedError

    def _writeback_pinned(self, tid: str) -> None:
        raise NotImplementedError

    def _grace_init(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._held: dict[str, int] = {}
        """Trajectories whose blocks are HELD, with the token of their turn."""
        self._turn: dict[str, int] = {}
        """Trajectories whose pause is still to come, with the token of their turn."""
        self._grace_seq = itertools.count(1)

    def finish_turn(
        self,
        tid: str,
        tool: str | None,
        declared: float | None,
        tokens: int,
        blocks: int,
        pause_after_s: float | None,
    ) -> None:
        if (pause_after_s is not None and pause_after_s <= 0) or not self.policy.holds_grace:
            self.pause(tid, tool, declared, tokens, blocks)
            return
        token = next(self._grace_seq)
        self.copy_blocks[tid] = blocks  # what a demotion of the held pin copies
        self._turn[tid] = token
        self._held[tid] = token
        self._writeback_pinned(tid)
        self.pool.pin(tid)  # the turn's blocks, cached since the request finished
        self._check_high_water()
        arrive = partial(self._pause_arrives, tid, token, tool, declared, tokens, blocks)
        if self.grace_s <= 0:
            self._grace_end(tid, token, blocks)
        else:
            self._at(self.grace_s, partial(self._grace_end, tid, token, blocks))
        if pause_after_s is not None:
            self._at(pause_after_s, arrive)

    def _pause_arrives(
        self,
        tid: str,
        token: int,
        tool: str | None,
        declared: float | None,
        tokens: int,
        blocks: int,
    ) -> None:
        if self._turn.get(tid) != token:
            return  # the next turn (or the end) came first
        del self._turn[tid]
        if self._held.pop(tid, None) == token:
            self.pool.unpin(tid)
        self.pause(tid, tool, declared, tokens, blocks)

    def _grace_end(self, tid: str, token: int, blocks: int) -> None:
        if self._held.get(tid) != token:
            return
        del self._held[tid]
        self.pool.unpin(tid)
        self.decisions["grace_expired"] = self.decisions.get("grace_expired", 0) + 1
        self.demotions += 1
        if DEFAULT_ACTION is Action.OFFLOAD_HOST and self.host is not None:
            if self._wb_on:
                # The manager's rule (Transitions.default_action): no wait is predicted, so
                # the copy is made once the pool forecasts the blocks' eviction.
                self._defer_writeback(tid, math.nan)
                return
            now = self.env.now
            if self.host.store(tid, blocks, now) is not None and self.remote is not None:
                self.remote.store(tid, blocks, now)
        self._writeback_placed(tid)

    def _grace_forget(self, tid: str) -> None:
        self._held.pop(tid, None)
        self._turn.pop(tid, None)
