"""``agentkv calibrate --load``: the serving engine measured under load, as a simulator profile.

Primitives:
  LoadSamples           raw measurements: prefill (new tokens, cached tokens, seconds) on an idle
                        engine and under a decode load; decode (batch, total context, seconds per
                        step); the engine's pool and step budget; admission (requests running at
                        once when their blocks exceed the pool, observed and predicted)
  measure_under_load(server, ...) -> LoadSamples   over HTTP (/v1/completions with token-id
                        prompts, /metrics); ``client`` and ``clock`` are for tests
  build_profile(samples, base) -> dict   the ``agentkv-engine-profile/1`` JSON: samples, the
                        constrained fits (agentkv.simulate.fit) as EngineCosts fields, notes
  costs_from_profile(data, where, base) -> EngineCosts   what ``simulate --calibration`` reads

What is measured and why each one: the prefill grid separates the linear and the attention cost
(n new tokens after c cached, c from 0 to the longest context the model takes); the same grid
while ``load_batch`` sequences decode gives the cost a prefill really has in a busy engine
(chunked prefill shares every step with the decodes); decode at batch 1..8 and two context
lengths gives the step overhead and the per-sequence cost; a burst larger than the pool shows
admission (vLLM runs a request only when its blocks fit, the rest wait). None of it is taken
from a run the simulator is then compared with: a profile made here is held out.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from agentkv.calibrate import served_model
from agentkv.errors import EngineUnavailableError
from agentkv.simulate.costs import ENGINE_PROFILE_SCHEMA, EngineCosts, Provenance
from agentkv.simulate.fit import fit_decode, fit_prefill

Progress = Callable[[str], None]
Clock = Callable[[], float]


@dataclass
class LoadSamples:
    server: str
    model: str
    block_tokens: int | None = None
    num_blocks: int | None = None
    max_batched_tokens: int | None = None
    max_model_len: int | None = None
    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    prefill_loaded: list[tuple[int, int, float]] = field(default_factory=list)
    load_batch: int = 0
    decode: list[tuple[int, int, float]] = field(default_factory=list)
    admission: dict[str, Any] = field(default_factory=dict)


def _noop(_: str) -> None:
    return None


def _ids(rng: random.Random, n: int) -> list[int]:
    # Ids well inside any vocabulary; random so no two prompts share a cached block.
    return [rng.randrange(1000, 8000) for _ in range(n)]


def _parse_cache_info(text: str) -> tuple[int | None, int | None]:
    """(block size, device blocks) from vLLM's ``vllm:cache_config_info`` metric labels."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.rindex("}")].split(",")
                if "=" in part
            )
            vals = {k.strip(): v.strip().strip('"') for k, v in labels.items()}
            bs, nb = vals.get("block_size", ""), vals.get("num_gpu_blocks", "")
            return (int(bs) if bs.isdigit() else None, int(nb) if nb.isdigit() else None)
    return None, None


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


class _Engine:
    """HTTP calls to one server, timed with ``clock``."""

    def __init__(self, http: Any, model: str, clock: Clock) -> None:
        self.http = http
        self.model = model
        self.clock = clock

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        import httpx

        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        start = self.clock()
        try:
            resp = self.http.post("/v1/completions", json=body).raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"completion request failed: {exc}") from exc
        elapsed = self.clock() - start
        usage = resp.json().get("usage") or {}
        return elapsed, int(usage.get("prompt_tokens") or len(prompt))

    def metrics(self) -> str:
        try:
            return str(self.http.get("/metrics").text)
        except Exception:  # /metrics is optional: pool size and admission are then not measured
            return ""


def _prefill_grid(
    eng: _Engine, rng: random.Random, news: list[int], contexts: list[int], bt: int
) -> list[tuple[int, int, float]]:
    out: list[tuple[int, int, float]] = []
    for c in contexts:
        for n in news:
            prefix = _ids(rng, c)
            if c:
                eng.complete(prefix, 1)  # puts the prefix in the cache
            seconds, _ = eng.complete(prefix + _ids(rng, n), 1)
            cached = (c // bt) * bt
            out.append((c + n - cached, cached, seconds))
    return out


def _decode_steps(
    eng: _Engine, rng: random.Random, batch: int, ctx: int, short: int, long: int
) -> float:
    """Seconds per decode step at ``batch`` sequences of ``ctx`` tokens: the difference of
    ``long`` and ``short`` answers to the same prompts, cached beforehand. Uncached, each run
    also prefilled batch x ctx tokens (16k at batch 8: ~16 s on a loaded 2-core machine), whose
    noise swamped the difference (2026-12-02: 0 to 212 ms per step)."""
    prompts = [_ids(rng, ctx) for _ in range(batch)]
    for p in prompts:
        eng.complete(p, 1)

    def run(tokens: int) -> float:
        with ThreadPoolExecutor(batch) as pool:
            times = list(pool.map(lambda p: eng.complete(p, tokens)[0], prompts))
        return max(times)

    return max(0.0, (run(long) - run(short)) / (long - short))


def _decode_context(ctx: int, batch: int, long: int, bt: int, num_blocks: int | None) -> int:
    """``ctx`` lowered so that ``batch`` cached prompts and their answers fit in the pool
    (vLLM keeps one block): otherwise the batch queues or preempts instead of decoding."""
    if not num_blocks:
        return ctx
    per_request = (num_blocks - 1) // batch - 1
    return max(bt, min(ctx, per_request * bt - long))


def _admission(
    eng: _Engine, rng: random.Random, samples: LoadSamples, count: int | None = None
) -> dict[str, Any]:
    """A burst of requests whose blocks exceed the pool: how many run at once."""
    bt, blocks = samples.block_tokens, samples.num_blocks
    if not bt or not blocks:
        return {"measured": False, "why": "no vllm:cache_config_info on /metrics"}
    per_req = min(blocks // 2, (samples.max_model_len or 2048) // bt - 1)
    tokens = max(bt, per_req * bt - 64)
    count = count or max(4, 2 * blocks // max(1, per_req))
    peak = {"running": 0.0, "waiting": 0.0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            text = eng.metrics()
            for key in ("running", "waiting"):
                v = _gauge(text, f"vllm:num_requests_{key}")
                if v is not None:
                    peak[key] = max(peak[key], v)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda _: eng.complete(_ids(rng, tokens), 16), range(count)))
    finally:
        done.set()
        watcher.join(timeout=5)
    return {
        "measured": True,
        "requests": count,
        "prompt_tokens": tokens,
        "predicted_running": max(1, blocks // -(-(tokens + 16) // bt)),
        "max_running": peak["running"],
        "max_waiting": peak["waiting"],
    }


def measure_under_load(
    server: str,
    *,
    model: str | None = None,
    max_batched_tokens: int = 2048,
    load_batch: int = 4,
    client: Any | None = None,
    clock: Clock = time.perf_counter,
    progress: Progress = _noop,
    seed: int = 0,
    quick: bool = False,
) -> LoadSamples:
    """Measure the engine at ``server`` (see the module docstring).

    Contract: raises EngineUnavailableError when the server cannot be reached or fails a
    request; /metrics is optional (pool size and admission are then not measured). ``quick``:
    a grid of short prompts (up to 512 new after up to 512 cached), batches up to 4, a burst
    of 4 (minutes instead of tens of minutes on a shared 2-core machine)."""
    import httpx

    http = client or httpx.Client(base_url=server.rstrip("/"), timeout=600.0)
    rng = random.Random(f"{seed}:calibrate-load")
    try:
        model, limit = served_model(http, server, model)
        eng = _Engine(http, model, clock)
        s = LoadSamples(server, model, max_batched_tokens=max_batched_tokens, load_batch=load_batch)
        s.max_model_len = int(limit) if limit else None
        s.block_tokens, s.num_blocks = _parse_cache_info(eng.metrics())
        bt = s.block_tokens or 16
        top = (s.max_model_len or 8192) - 64
        sizes = (
            (64, 256, 512) if quick else (64, 256, 1024, max_batched_tokens, 2 * max_batched_tokens)
        )
        news = [n for n in sizes if n < top]
        contexts = [c for c in ((0, 512) if quick else (0, top // 4, top // 2)) if c + 64 < top]
        progress("warm-up")
        eng.complete(_ids(rng, 32), 1)
        progress("prefill vs chunk size and context, idle engine")
        s.prefill = [
            x for x in _prefill_grid(eng, rng, news, contexts, bt) if x[0] + x[1] <= top + 64
        ]
        progress(f"prefill under a decode load of {load_batch} sequences")
        stop = threading.Event()

        def background() -> None:
            while not stop.is_set():
                eng.complete(_ids(rng, 256), 64)

        with ThreadPoolExecutor(load_batch) as pool:
            futures = [pool.submit(background) for _ in range(load_batch)]
            try:
                s.prefill_loaded = _prefill_grid(eng, rng, news[:3], contexts, bt)
            finally:
                stop.set()
            for f in futures:
                f.result()
        short, long = (4, 16) if quick else (8, 40)
        for batch in (1, 2, 4) if quick else (1, 2, 4, 8):
            for want in (128, 512) if quick else (256, min(2048, top // 2)):
                ctx = _decode_context(want, batch, long, bt, s.num_blocks)
                progress(f"decode: batch {batch}, {ctx}-token contexts")
                step = _decode_steps(eng, rng, batch, ctx, short, long)
                s.decode.append((batch, batch * (ctx + (short + long) // 2), step))
        progress("admission: a burst larger than the pool")
        s.admission = _admission(eng, rng, s, 4 if quick else None)
        return s
    finally:
        if client is None:
            http.close()


def build_profile(samples: LoadSamples, base: EngineCosts) -> dict[str, Any]:
    """The profile JSON: raw samples, the fits as EngineCosts fields, notes."""
    fit = fit_prefill(samples.prefill, base)
    dec = fit_decode(samples.decode, base)
    notes = list(fit.notes + dec.notes)
    # The loaded grid is not fitted: the simulator adds the decodes' share of every step
    # itself. How much slower the same prefills were under load says how far a model of the
    # idle engine is from the busy one (reported, and compared in the docs).
    idle = {(n, c): t for n, c, t in samples.prefill}
    ratios = [t / idle[(n, c)] for n, c, t in samples.prefill_loaded if idle.get((n, c))]
    loaded_ratio = sorted(ratios)[len(ratios) // 2] if ratios else None
    costs: dict[str, Any] = {
        "prefill_flops_per_s": 2.0 * base.model_params / fit.linear_s_per_token,
        "attention_flops_per_s": 4.0
        * base.num_layers
        * base.hidden_size
        / fit.attention_s_per_pair,
        "step_overhead_s": dec.overhead_s if dec.overhead_s > 0 else base.step_overhead_s,
        "decode_seq_s": dec.per_seq_s,
        "decode_context_s_per_token": dec.attention_s_per_token,
        "request_overhead_s": max(0.0, fit.intercept_s - dec.overhead_s),
        "max_batched_tokens": samples.max_batched_tokens or base.max_batched_tokens,
        "policy_prefill_known": True,
    }
    if samples.block_tokens:
        costs["block_tokens"] = samples.block_tokens
    return {
        "schema": ENGINE_PROFILE_SCHEMA,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "server": samples.server,
        "model": samples.model,
        "num_blocks": samples.num_blocks,
        "loaded_over_idle_prefill": loaded_ratio,
        "samples": asdict(samples),
        "costs": costs,
        "notes": notes,
    }


def costs_from_profile(data: dict[str, Any], where: str, base: EngineCosts) -> EngineCosts:
    """EngineCosts from an ``agentkv-engine-profile/1`` file (fields not in it from ``base``)."""
    known = set(EngineCosts.__dataclass_fields__)
    values = {k: v for k, v in (data.get("costs") or {}).items() if k in known}
    return replace(
        base,
        **values,
        name=f"profile {data.get('model', '')}".strip(),
        source=f"{where} (measured {data.get('measured_at', '?')} at {data.get('server', '?')})",
        provenance=Provenance.PROFILE_UNDER_LOAD,
        notes=tuple(str(n) for n in data.get("notes") or ()),
    )
