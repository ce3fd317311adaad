"""A measured published result, simulated: vLLM's single-request TTFT, recomputed or from CPU.

The source: "Inside vLLM's New KV Offloading Connector" (Or Ozeri and Danny Harnik, IBM
Research; blog.vllm.ai, 2026-01-08; vllm-project/vllm-project.github.io,
``_posts/2026-01-08-kv-offloading-connector.md``), Figure 1, "Single request TTFT
(Llama-3.1-8B-Instruct, NVIDIA H100)": the time to first token of one request of 1k to 100k
tokens, its KV either computed on the GPU or loaded from CPU memory by vLLM's
OffloadingConnector. The post's setup: H100 80GB HBM3, vLLM commit 2a1776b, FlashAttention,
GPU prefix caching disabled (so a CPU hit is a load), 16-token GPU and CPU blocks, no
tokenization. The figure prints no numbers: ``OFFLOAD_BLOG_FIG1`` holds the marker centres read
off its PNG (1,999 x 1,114 pixels; one pixel is 9.4 ms, so the 1k points are too small to
compare).

Primitives:
  OFFLOAD_BLOG_FIG1        (prompt tokens, GPU compute ms, load from CPU ms) per point
  offload_connector_costs(base)  a preset as that connector runs: the load precedes the
                           compute (it is not layerwise)
  first_prediction_costs() the H100 / Llama-3.1-8B preset as it stood before this comparison
  single_request_ttft(costs, prompt, from_host)  one request on an idle simulated replica
  compare(costs) -> list[Row]    simulated next to published, with the errors
  OFFLOAD_BLOG_FIG2, concurrent_throughput(costs, hit_pct)   the post's Figure 2: 10,000
                           512-token prompts at once, tokens/s against the CPU hit rate
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import simpy

from agentkv.hardware import get_preset
from agentkv.simulate.costs import EngineCosts
from agentkv.simulate.policies import make_policy
from agentkv.simulate.presets import get_model, gpu_costs, gpu_num_blocks
from agentkv.simulate.replica import Replica, Request

GPU, MODEL = "H100", "llama-3.1-8b"
SOURCE = (
    "vLLM blog, 'Inside vLLM's New KV Offloading Connector' (2026-01-08), Figure 1: single "
    "request TTFT, Llama-3.1-8B-Instruct, NVIDIA H100"
)

OFFLOAD_BLOG_FIG1: tuple[tuple[int, float, float], ...] = (
    (10_000, 266.0, 42.0),
    (20_000, 637.0, 71.0),
    (30_000, 1104.0, 94.0),
    (40_000, 1660.0, 124.0),
    (50_000, 2302.0, 153.0),
    (60_000, 3028.0, 190.0),
    (70_000, 3865.0, 217.0),
    (80_000, 4814.0, 248.0),
    (90_000, 5769.0, 276.0),
    (100_000, 6883.0, 311.0),
)
"""(prompt tokens, TTFT with the KV computed on the GPU in ms, TTFT with it loaded from CPU in
ms): the figure's markers, read to about +-5 ms. Its 1k point (about 27 and 16 ms) is left
out: within two pixels of the axis."""


def offload_connector_costs(base: EngineCosts) -> EngineCosts:
    """``base`` as vLLM's OffloadingConnector serves a CPU hit: the request waits until every
    layer of its blocks is back, then computes its last block (no layer-by-layer overlap)."""
    return replace(base, layerwise_overlap=False)


def first_prediction_costs() -> EngineCosts:
    """The H100 / Llama-3.1-8B preset before this comparison (PREFILL_MFU and
    ATTENTION_EFFICIENCY 0.5, the reference's n*(c+n) attention count, the datasheet's 64 GB/s
    host link), run as the first comparison ran it (layerwise loads, the preset's default)."""
    c = gpu_costs(GPU, MODEL)
    peak = get_preset(GPU).bf16_dense_flops_per_s
    link = get_preset(GPU).host_link_bytes_per_s
    assert peak is not None and link is not None
    return replace(
        c,
        prefill_flops_per_s=0.5 * peak,
        attention_flops_per_s=0.5 * peak,
        decode_seq_s=2.0 * c.model_params / (0.5 * peak),
        host_link_bytes_per_s=link,
        causal_attention=False,
    )


def single_request_ttft(costs: EngineCosts, prompt: int, from_host: bool) -> float:
    """Seconds to the first token of one ``prompt``-token request on an idle replica (the
    GPU's blocks at vLLM's 0.9 utilization): computed from nothing, or, with ``from_host``,
    with every full block of its prompt in host memory and none on the device (the post ran
    with GPU prefix caching off)."""
    env = simpy.Environment()
    blocks = gpu_num_blocks(get_preset(GPU), get_model(MODEL))
    host_gib = 2 * costs.kv_bytes(prompt) / 2**30 if from_host else None
    replica = Replica(env, 0, costs, blocks, make_policy("vanilla", costs), host_gib, None)
    if from_host:
        assert replica.host is not None
        stored = replica.host.store("t", prompt // costs.block_tokens, env.now)
        assert stored is not None
        env.run(until=stored)
    sent = env.now
    done = env.event()
    reusable = prompt if from_host else 0
    req = Request("t", "g", prompt, 1, 0, reusable, prompt, costs.block_tokens, sent, done)
    replica.submit(req)
    env.run(until=done)
    return req.first_token_at - sent + costs.request_overhead_s


@dataclass(frozen=True)
class Row:
    prompt_tokens: int
    compute_published_s: float
    compute_simulated_s: float
    load_published_s: float
    load_simulated_s: float

    @property
    def compute_error(self) -> float:
        return self.compute_simulated_s / self.compute_published_s - 1.0

    @property
    def load_error(self) -> float:
        return self.load_simulated_s / self.load_published_s - 1.0


def compare(costs: EngineCosts) -> list[Row]:
    """Every point of the figure next to what ``costs`` simulates."""
    return [
        Row(
            n,
            gpu_ms / 1e3,
            single_request_ttft(costs, n, from_host=False),
            cpu_ms / 1e3,
            single_request_ttft(costs, n, from_host=True),
        )
        for n, gpu_ms, cpu_ms in OFFLOAD_BLOG_FIG1
    ]


def table(rows: list[Row]) -> str:
    """The comparison as a markdown table (times in ms)."""
    out = [
        "| prompt | GPU compute, published | simulated | error "
        "| load from CPU, published | simulated | error |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.prompt_tokens // 1000}k | {r.compute_published_s * 1e3:,.0f} "
            f"| {r.compute_simulated_s * 1e3:,.0f} | {r.compute_error:+.0%} "
            f"| {r.load_published_s * 1e3:,.0f} | {r.load_simulated_s * 1e3:,.0f} "
            f"| {r.load_error:+.0%} |"
        )
    return "\n".join(out)


OFFLOAD_BLOG_FIG2: tuple[tuple[int, float], ...] = (
    (0, 42_500.0),
    (10, 46_700.0),
    (20, 51_900.0),
    (30, 56_800.0),
    (40, 64_600.0),
    (50, 74_300.0),
    (60, 89_400.0),
    (70, 116_600.0),
    (80, 159_200.0),
    (90, 218_900.0),
    (100, 390_800.0),
)
"""The same post's Figure 2: (CPU hit rate in %, prompt tokens per second) of 10,000 unique
512-token prefill requests sent at once, GPU prefix caching off (markers read off the PNG,
about +-500 tokens/s). Its baseline without offloading, 43,900 tokens/s, sets PREFILL_MFU."""


def concurrent_throughput(
    costs: EngineCosts, hit_pct: int, n: int = 10_000, per_token: bool = False
) -> float:
    """Prompt tokens per second of ``n`` 512-token requests submitted at once to an idle
    replica, ``hit_pct`` % of them (spread evenly) with their whole prompt in host memory.
    The post does not say whether its hit rate is per request or per token; this is the
    per-request reading, ``per_token`` the other: every prompt's first ``hit_pct`` % (whole
    blocks) in host memory."""
    env = simpy.Environment()
    prompt, bt = 512, costs.block_tokens
    blocks = gpu_num_blocks(get_preset(GPU), get_model(MODEL))
    host_gib = 2 * n * costs.kv_bytes(prompt) / 2**30
    replica = Replica(env, 0, costs, blocks, make_policy("vanilla", costs), host_gib, None)
    assert replica.host is not None
    reqs = []
    for i in range(n):
        if per_token:
            cached = prompt * hit_pct // 100 // bt
        else:
            cached = prompt // bt if (i * hit_pct) % 100 < hit_pct else 0
        if cached:
            replica.host.copies[str(i)] = cached
            replica.host.used_blocks += cached
        req = Request(str(i), "g", prompt, 1, 0, cached * bt, prompt, bt, 0.0, env.event())
        reqs.append(req)
        replica.submit(req)
    env.run()
    return n * prompt / max(r.finished_at for r in reqs)


def main() -> None:
    print(SOURCE)
    print("\nThe H100 preset before this comparison (as first predicted):\n")
    print(table(compare(first_prediction_costs())))
    print("\nThe H100 preset now:\n")
    costs = offload_connector_costs(gpu_costs(GPU, MODEL))
    print(table(compare(costs)))
    print("\nFigure 2, 10,000 prompts of 512 tokens at once (tokens/s; hits per request, or")
    print("per token: every prompt that part cached):\n")
    print("| CPU hits | published | simulated | error | per token | error |")
    print("|---:|---:|---:|---:|---:|---:|")
    for hit_pct, published in OFFLOAD_BLOG_FIG2:
        got = concurrent_throughput(costs, hit_pct)
        tok = concurrent_throughput(costs, hit_pct, per_token=True)
        print(
            f"| {hit_pct}% | {published:,.0f} | {got:,.0f} | {got / published - 1:+.0%} "
            f"| {tok:,.0f} | {tok / published - 1:+.0%} |"
        )


if __name__ == "__main__":
    main()
