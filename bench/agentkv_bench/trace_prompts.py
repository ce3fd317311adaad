"""Token-id prompts for a recorded trace: each round's prefix really is the session's history.

Primitives:
  RoundPrompt       one round's prompt ids, the scripted reply ids committed after it, and how
                    many leading prompt tokens came from the history
  TOKEN_RANGE       the default id range [16, 8192): the embedded models' vocabulary without
                    their special tokens (ids 0-7 and a margin)
  session_prompts(session, index, seed, token_range) -> [RoundPrompt]
  build_prompts(workload, seed, token_range) -> one list per session
  oracle_blocks(workload, block_tokens) -> device blocks that hold the whole workload at once

Round i+1's prompt is the first ``prefix_len`` tokens of round i's prompt followed by round i's
reply (the history), then ``input_len`` new tokens. When a trace keeps more than the history (a
``prefix_len`` beyond it, e.g. a first round that starts with a cached prefix) the rest is new
content of the session.

The reply committed to the history is a scripted one, drawn here, not what the model
generated: every configuration then sends token-identical prompts every round, whatever the
random-weight model produced and however bf16 rounding differed between servers. The cost is
that the reply's own KV (computed during decode) never matches the next prompt, in every
configuration alike: the next round recomputes it. Each session draws its ids from its own RNG
(seeded by the seed and the session's index), so no two sessions share a block.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from agentkv.traces import TraceSession, TraceWorkload

TOKEN_RANGE = (16, 8192)


@dataclass(frozen=True)
class RoundPrompt:
    prompt: tuple[int, ...]
    reply: tuple[int, ...]
    from_history: int  # leading prompt tokens copied from the previous round's prompt + reply

    @property
    def context(self) -> tuple[int, ...]:
        return self.prompt + self.reply


def _ids(rng: random.Random, n: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    lo, hi = token_range
    return tuple(rng.randrange(lo, hi) for _ in range(n))


def session_prompts(
    session: TraceSession,
    index: int,
    seed: int = 0,
    token_range: tuple[int, int] = TOKEN_RANGE,
) -> list[RoundPrompt]:
    """The prompts of ``session`` (the ``index``-th of its workload); deterministic."""
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"token_range must be 0 <= lo < hi, got {token_range}")
    rng = random.Random(f"{seed}:trace-session:{index}")
    history: tuple[int, ...] = ()
    out: list[RoundPrompt] = []
    for r in session.rounds:
        kept = min(r.prefix_len, len(history))
        prompt = (
            history[:kept]
            + _ids(rng, r.prefix_len - kept, token_range)
            + _ids(rng, r.input_len, token_range)
        )
        rp = RoundPrompt(prompt, _ids(rng, r.output_len, token_range), kept)
        out.append(rp)
        history = rp.context
    return out


def build_prompts(
    workload: TraceWorkload, seed: int = 0, token_range: tuple[int, int] = TOKEN_RANGE
) -> list[list[RoundPrompt]]:
    return [session_prompts(s, i, seed, token_range) for i, s in enumerate(workload.sessions)]


def oracle_blocks(workload: TraceWorkload, block_tokens: int = 128) -> int:
    """Device blocks for a prefix cache that never has to evict anything of ``workload``.

    Per session: every block of its history, shared rounds counted once (``distinct_tokens``),
    plus per round the blocks of the reply the model actually generated (vLLM caches them; the
    next prompt carries the scripted reply instead, so they are extra) and one partial block
    (a block is cached only once full). Sessions share nothing. Plus 10% and 16 blocks of
    slack: an upper bound, and the bench checks it held (every resume turn a device hit).
    """
    need = 0
    for s in workload.sessions:
        need += math.ceil(s.distinct_tokens() / block_tokens)
        need += sum(math.ceil(r.output_len / block_tokens) + 1 for r in s.rounds)
    return math.ceil(need * 1.1) + 16
