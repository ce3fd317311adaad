"""calibrate --load's engine profile: the measurement over HTTP (a fake engine on a fake clock),
the constrained fits, and `simulate --calibration` reading it as a held-out profile."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from agentkv.simulate.costs import BENCH_SMALL_CPU, Provenance, load_calibration
from agentkv.simulate.engine_profile import (
    LoadSamples,
    _parse_cache_info,
    build_profile,
    measure_under_load,
)

LIN, ATTN, A = 2.5e-4, 4e-8, 0.03
METRICS = (
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="512"} 1.0\n'
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
)


class FakeEngine:
    """Prefix cache by token-id prefix; latency from known costs; time on a fake clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cached: set[tuple[int, ...]] = set()

    def clock(self) -> float:
        return self.now

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        body = json.loads(request.content)
        ids = tuple(body["prompt"])
        hit = 0
        for k in range(len(ids) // 16, 0, -1):
            if ids[: k * 16] in self.cached:
                hit = k * 16
                break
        for k in range(1, len(ids) // 16 + 1):
            self.cached.add(ids[: k * 16])
        n = len(ids) - hit
        out = body["max_tokens"]
        self.now += A + n * LIN + n * len(ids) * ATTN + (out - 1) * 0.02
        return httpx.Response(200, json={"usage": {"prompt_tokens": len(ids)}})


def test_the_measurement_recovers_the_engine_s_prefill_costs() -> None:
    eng = FakeEngine()
    client = httpx.Client(transport=httpx.MockTransport(eng.handler), base_url="http://x")
    samples = measure_under_load("http://x", client=client, clock=eng.clock, load_batch=1)
    assert samples.block_tokens == 16 and samples.num_blocks == 512
    assert samples.max_model_len == 4096 and len(samples.prefill) >= 10
    profile = build_profile(samples, BENCH_SMALL_CPU)
    costs = profile["costs"]
    lin = 2.0 * BENCH_SMALL_CPU.model_params / costs["prefill_flops_per_s"]
    attn = 4.0 * 12 * 1024 / costs["attention_flops_per_s"]
    assert lin == pytest.approx(LIN, rel=0.05) and attn == pytest.approx(ATTN, rel=0.05)


def test_a_profile_is_a_held_out_calibration_for_simulate(tmp_path: Path) -> None:
    s = LoadSamples("http://x", "m", block_tokens=16, num_blocks=512, max_batched_tokens=1024)
    s.prefill = [
        (n, c, A + n * LIN + n * (n + c) * ATTN) for n in (64, 512, 2048) for c in (0, 2000)
    ]
    s.decode = [
        (b, b * ctx, 0.02 + b * 1e-3 + b * ctx * 1e-7) for b in (1, 4) for ctx in (256, 2048)
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(build_profile(s, BENCH_SMALL_CPU)))
    costs = load_calibration(path)
    assert costs.provenance is Provenance.PROFILE_UNDER_LOAD
    assert costs.step_overhead_s == pytest.approx(0.02, rel=1e-3)
    assert costs.decode_token_s(1000) == pytest.approx(1e-3 + 1000 * 1e-7, rel=1e-3)
    assert costs.block_tokens == 16 and costs.max_batched_tokens == 1024
    assert costs.prefill_s(100, 1000) == pytest.approx(100 * LIN + 100 * 1100 * ATTN, rel=1e-3)


def test_cache_info_is_read_from_vllm_metrics() -> None:
    assert _parse_cache_info(METRICS) == (16, 512)
    assert _parse_cache_info("") == (None, None)


class NoisyPrefillEngine:
    """Decode 30 ms per token; a prefill of uncached tokens 1 ms each plus up to 2 s of noise
    (other work on the machine). Cached prompts cost nothing to prefill."""

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.noise = iter([0.0, 2.0, 0.5, 1.5, 1.0, 0.2] * 10)

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        key = tuple(prompt)
        prefill = 0.0 if key in self.cached else len(prompt) * 1e-3 + next(self.noise)
        self.cached.add(key)
        return prefill + max_tokens * 0.03, len(prompt)


def test_decode_steps_are_measured_on_cached_prompts_so_prefill_noise_cancels() -> None:
    import random

    from agentkv.simulate.engine_profile import _decode_steps

    eng = NoisyPrefillEngine()
    for ctx in (256, 2048):
        step = _decode_steps(eng, random.Random(0), 1, ctx, 8, 40)  # type: ignore[arg-type]
        assert step == pytest.approx(0.03)


def test_a_decode_batch_is_sized_to_fit_the_pool() -> None:
    from agentkv.simulate.engine_profile import _decode_context

    # 128 blocks of 128 tokens, one kept by vLLM: 8 requests get 14 blocks each, answers included.
    ctx = _decode_context(2048, 8, 40, 128, 128)
    assert ctx == 14 * 128 - 40 and 8 * -(-(ctx + 40) // 128) <= 127
    assert _decode_context(256, 1, 40, 128, 128) == 256
    assert _decode_context(2048, 8, 40, 128, None) == 2048
