"""Plugin part 1: KV really leaves vLLM for a tier and comes back bit-identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    BLOCK_TOKENS,
    NUM_BLOCKS,
    Server,
    full_blocks,
    lcp,
    long_text,
    tokens_and_logprobs,
    two_turns,
)

pytestmark = pytest.mark.e2e


def _turns(seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    return two_turns(seed, system_words=500, observation_words=120)


@pytest.mark.parametrize(("tier", "wait"), [("host", 2.0), ("disk", 3600.0)])
def test_turn_from_tier_matches_device_cache_exactly(
    server: Server, tier: str, wait: float
) -> None:
    seed = 100 if tier == "host" else 200
    first, second = _turns(seed)
    tid = f"exact-{tier}"
    server.chat(first, trajectory=tid)
    decision = server.pause(tid, f"{tid}-tool", wait)
    assert decision["decision"]["action"] == f"offload_{tier}"
    server.wait_state(tid, {"offloaded"})
    residency = server.trajectory(tid)["branches"]["main"]["residency_blocks"]
    assert residency.get(tier, 0) > 0

    server.reset_prefix_cache()  # vLLM forgets; only the tier has the blocks now
    # Reference: the same two turns served from vLLM's own prefix cache (salted: no tier involved).
    server.chat(first, salt=f"ref-{tier}")
    ref = server.chat(second, salt=f"ref-{tier}")

    layerwise_before = server.status()["counters"].get("layerwise_loads", 0)
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    # Every block the reference found in vLLM's cache came from the tier here (vLLM had none).
    ref_cached = ref["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ref_cached == full_blocks(lcp(server.tokenize(first), server.tokenize(second)))
    assert stats["device_hit_tokens"] == 0
    assert stats["tier_hit_tokens"] == ref_cached and stats["tier"] == tier
    # On CPU, host blocks come back layer by layer inside the prefill step (load_mode auto);
    # disk blocks are verified whole, so they load before the request is scheduled.
    layerwise = server.status()["counters"].get("layerwise_loads", 0) - layerwise_before
    assert layerwise == (1 if tier == "host" else 0)
    assert (
        got["usage"]["prompt_tokens_details"]["cached_tokens"]
        == ref["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert tokens_and_logprobs(got) == tokens_and_logprobs(
        ref
    )  # bit-identical KV -> identical output
    server.end(tid)


def test_corrupt_tier_falls_back_to_recompute(server: Server) -> None:
    first, second = _turns(300)
    tid = "corrupt"
    server.chat(first, trajectory=tid)
    server.pause(tid, "corrupt-approval", 7200.0)
    server.wait_state(tid, {"offloaded"})
    files = [
        p for p in Path(server.disk_dir).rglob("*") if p.is_file() and not p.name.startswith(".")
    ]
    assert files, "disk tier wrote nothing"
    for path in files:  # flip one payload byte in every block file
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    server.reset_prefix_cache()
    ref = server.chat(second, salt="ref-corrupt")  # full recompute
    before = server.counters()
    got = server.chat(second, trajectory=tid)
    stats = got["kv_transfer_params"]["agentkv"]
    assert stats["tier_hit_tokens"] == 0, stats  # no corrupt block was served
    assert stats["device_hit_tokens"] == 0, stats
    after = server.counters()
    detected = sum(
        after.get(k, 0) - before.get(k, 0) for k in ("tier_corrupt_blocks", "tier_misses")
    )
    assert detected >= 1, (before, after)  # the checksum caught it: not a silent miss
    assert [t for t, _ in tokens_and_logprobs(got)] == [t for t, _ in tokens_and_logprobs(ref)]
    for (_, a), (_, b) in zip(tokens_and_logprobs(got), tokens_and_logprobs(ref), strict=True):
        assert abs(a - b) < 5e-2
    server.end(tid)


def test_memory_pressure_resume_comes_back_from_tier(server: Server) -> None:
    """Three paused trajectories and three contexts without agentkv, then traffic that cycles the
    whole pool through vLLM's cache; on resume the agentkv ones come back from the host tier, the
    same-sized contexts without agentkv are recomputed."""
    # ~1k-token contexts (8 blocks each) and ~2.6k-token noise requests: prefill on this CPU
    # costs ~2 ms a token and more per token the longer the prompt, so the pool is cycled in
    # short requests, once for both halves of the comparison.
    agentkv = [[{"role": "user", "content": long_text(1050 + i, 200)}] for i in range(3)]
    vanilla = [[{"role": "user", "content": long_text(1000 + i, 200)}] for i in range(3)]
    prompts: dict[str, int] = {}
    for i, msgs in enumerate(agentkv):
        out = server.chat(msgs, trajectory=f"press{i}")
        prompts[f"press{i}"] = out["usage"]["prompt_tokens"]
        server.pause(f"press{i}", "press-pytest", 2.0)
    for i, msgs in enumerate(vanilla):
        out = server.chat(msgs, salt="vanilla")
        prompts[f"vanilla{i}"] = out["usage"]["prompt_tokens"]
    # Noise: more blocks than the pool has (vLLM evicts its least recently freed blocks first,
    # so every context above is gone once the noise has used NUM_BLOCKS blocks).
    noise_blocks, seed = 0, 5000
    while noise_blocks <= NUM_BLOCKS + 16:
        out = server.chat(
            [{"role": "user", "content": long_text(seed, 520)}], salt="noise-press", max_tokens=1
        )
        noise_blocks += out["usage"]["prompt_tokens"] // BLOCK_TOKENS
        seed += 1
    for i, msgs in enumerate(agentkv):
        got = server.chat([*msgs, {"role": "user", "content": "next step"}], trajectory=f"press{i}")
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        stats = got["kv_transfer_params"]["agentkv"]
        assert cached >= 0.9 * (prompts[f"press{i}"] - BLOCK_TOKENS), (i, cached, stats)
        assert stats["tier_hit_tokens"] > 0 and stats["tier"] == "host", stats
    vanilla_cached = 0
    for msgs in vanilla:
        got = server.chat([*msgs, {"role": "user", "content": "next step"}], salt="vanilla")
        vanilla_cached += got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert vanilla_cached <= 0.1 * sum(prompts[f"vanilla{i}"] for i in range(3)), vanilla_cached
    for i in range(3):
        server.end(f"press{i}")


def test_request_without_agentkv_is_vanilla(server: Server) -> None:
    before = server.status()["trajectories"]
    server.chat([{"role": "user", "content": "plain request"}])
    assert server.status()["trajectories"] == before


@pytest.mark.parametrize(
    "params",
    [
        {"agentkv": {"trajectory_id": 42}},
        {"agentkv": {"trajectory_id": "x" * 5000}},
        {"agentkv": "not-an-object"},
        {"agentkv": {"trajectory_id": "ok", "branch": ["list"]}},
    ],
)
def test_malformed_params_are_served_as_vanilla(server: Server, params: Any) -> None:
    before = server.status()
    out = server.chat([{"role": "user", "content": "malformed"}], extra_params=params)
    assert out["choices"][0]["message"]["content"] is not None
    # No stats (no trajectory), only the reason (issue 29): the same text as the server log.
    agentkv = (out.get("kv_transfer_params") or {}).get("agentkv") or {}
    assert list(agentkv) == ["error"] and "kv_transfer_params.agentkv" in agentkv["error"]
    after = server.status()
    # One warning for this request, counted once (not once per scheduler look-up).
    malformed = after["counters"].get("malformed_params", 0)
    assert malformed - before["counters"].get("malformed_params", 0) == 1
    # Served as vanilla: no trajectory came into being (not even "ok", whose id is valid).
    assert after["trajectories"] == before["trajectories"]
    assert after["trajectory_ids"] == before["trajectory_ids"]
    assert server.trajectory_code("ok") == 404


def test_non_object_kv_transfer_params_is_a_client_error(server: Server) -> None:
    # vLLM itself rejects this shape (vanilla behaviour); the engine must stay up.
    r = server.client.post(
        "/v1/chat/completions",
        json={
            "model": server.model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
            "kv_transfer_params": ["a"],
        },
    )
    assert 400 <= r.status_code < 500
    assert server.chat([{"role": "user", "content": "after"}])["usage"]["completion_tokens"] == 4


def test_engine_still_serving_after_everything(server: Server) -> None:
    assert (
        server.chat([{"role": "user", "content": "still alive?"}])["usage"]["completion_tokens"]
        == 4
    )
