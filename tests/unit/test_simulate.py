"""agentkv.simulate: pool accounting, routers' choices, policies, costs, determinism."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from agentkv.errors import ConfigError
from agentkv.policy import DEMOTION_ACTION, Writeback, decide
from agentkv.predict import WaitEstimate
from agentkv.simulate.costs import BENCH_SMALL_CPU, CALIBRATION_SCHEMA, load_calibration
from agentkv.simulate.fleet import FleetConfig, simulate
from agentkv.simulate.policies import (
    AgentKVPolicy,
    OffloadAlwaysPolicy,
    PauseContext,
    RetainAlwaysPolicy,
    VanillaPolicy,
    make_policy,
)
from agentkv.simulate.pool import PREFIX, BlockPool
from agentkv.simulate.routers import (
    AffinityLoad,
    KvAware,
    LeastLoaded,
    RoundRobin,
    RouteRequest,
    SessionAffinity,
    make_router,
)
from agentkv.simulate.tiers import TierStore
from agentkv.simulate.workload import SimTrajectory, SimTurn, SimWorkload
from agentkv.tier import Tier

# -- pool ---------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_freed_trajectory_from_its_tail() -> None:
    pool = BlockPool(10)
    a = pool.admit("a", "", 4, 0, 0, 0)
    assert a is not None
    pool.release("a", "", a, 4)
    b = pool.admit("b", "", 4, 0, 0, 0)
    assert b is not None
    pool.release("b", "", b, 4)
    assert pool.empty == 2 and pool.cached_free == 8
    c = pool.admit("c", "", 5, 0, 0, 0)  # needs 3 more than empty: taken from a's tail
    assert c is not None and c.evicted == 3
    assert pool.private == {"a": 1, "b": 4}
    assert pool.device_hit("a", "", 0, 4) == (0, 1)  # what survives is a prefix of a's context
    pool.check()


def test_a_hit_moves_blocks_out_of_the_lru_and_recency_follows_release_order() -> None:
    pool = BlockPool(8)
    for tid in ("a", "b"):
        alloc = pool.admit(tid, "", 4, 0, 0, 0)
        assert alloc is not None
        pool.release(tid, "", alloc, 4)
    # a's next turn hits its 4 blocks and adds 2; freed again it becomes the most recent.
    alloc = pool.admit("a", "", 6, 0, 0, 4)
    assert alloc is not None and alloc.evicted == 2 and pool.private["b"] == 2
    pool.release("a", "", alloc, 6)
    assert list(pool.lru) == ["b", "a"]
    pool.check()


def test_shared_prefix_blocks_are_held_once_and_freed_with_their_last_user() -> None:
    pool = BlockPool(20)
    a = pool.admit("a", "g", 6, 4, 0, 0)
    assert a is not None and pool.active == 6
    pre, priv = pool.device_hit("b", "g", 4, 0)
    assert (pre, priv) == (4, 0)
    b = pool.admit("b", "g", 6, 4, pre, priv)
    assert b is not None and pool.active == 8  # 4 shared + 2 + 2
    pool.release("a", "g", a, 2)
    assert pool.active == 6 and PREFIX + "g" not in pool.lru
    pool.release("b", "g", b, 2)
    assert pool.active == 0 and pool.lru[PREFIX + "g"] == 4
    assert list(pool.lru)[-1] == PREFIX + "g"  # the prefix is freed last: evicted last
    pool.check()


def test_a_private_hit_needs_the_whole_prefix() -> None:
    pool = BlockPool(6)
    a = pool.admit("a", "g", 6, 2, 0, 0)
    assert a is not None
    pool.release("a", "g", a, 4)
    pool._evict(5)  # a's 4 private blocks, then one prefix block
    assert pool.prefix_cached["g"] == 1
    assert pool.device_hit("a", "g", 2, 4) == (1, 0)


def test_pinned_blocks_are_never_evicted_and_can_block_admission() -> None:
    pool = BlockPool(8)
    a = pool.admit("a", "", 6, 0, 0, 0)
    assert a is not None
    pool.release("a", "", a, 6, pin=True)
    assert pool.pinned == 6 and pool.used == 6
    assert pool.admit("b", "", 4, 0, 0, 0) is None
    assert pool.unpin("a") == 6
    b = pool.admit("b", "", 4, 0, 0, 0)
    assert b is not None and b.evicted == 2 and pool.private["a"] == 4
    pool.check()


# -- tiers --------------------------------------------------------------------------------------


def test_tier_copies_only_new_blocks_and_evicts_the_oldest_copy() -> None:
    tier = TierStore(Tier.HOST, 4 * 100.0, 100.0, 1000.0, 100.0)
    assert tier.store("a", 2, 0.0) == pytest.approx(2.0)
    assert tier.store("a", 3, 0.0) == pytest.approx(3.0)  # one more block, after the first copy
    tier.store("b", 1, 10.0)
    tier.store("c", 2, 10.0)  # 3 + 1 + 2 > 4 blocks: a goes
    assert tier.blocks("a") == 0 and tier.blocks("b") == 1 and tier.evicted_copies == 1
    assert tier.store("huge", 5, 0.0) is None
    assert tier.load("c", 2, 20.0) == pytest.approx(20.2)


# -- routers ------------------------------------------------------------------------------------


class _View:
    def __init__(self, load: int, held: tuple[int, int, int, int] = (0, 0, 0, 0)) -> None:
        self.load = load
        self.held = held

    def outstanding(self) -> int:
        return self.load

    def queued_prefill_s(self) -> float:
        return self.load * 1.0

    def cached_tokens(self, req: RouteRequest) -> tuple[int, int, int, int]:
        return self.held

    def prefill_s(self, tokens: int, cached: int) -> float:
        return tokens / 1000.0


REQ = RouteRequest("traj-1", 4000, "", 0, 3968)


def test_round_robin_and_session_affinity() -> None:
    views = [_View(0) for _ in range(3)]
    rr = RoundRobin()
    assert [rr.choose(REQ, views) for _ in range(4)] == [0, 1, 2, 0]
    sa = SessionAffinity()
    first = sa.choose(REQ, views)
    assert all(sa.choose(REQ, views) == first for _ in range(5))
    spread = {sa.choose(replace(REQ, trajectory_id=f"t{i}"), views) for i in range(30)}
    assert spread == {0, 1, 2}


def test_least_loaded_picks_the_lowest_index_on_ties() -> None:
    assert LeastLoaded().choose(REQ, [_View(3), _View(1), _View(1)]) == 1


def test_kv_aware_credits_tiers_and_weighs_load() -> None:
    router = KvAware()
    # Device hit beats a host hit of the same size, which beats nothing.
    views = [_View(0), _View(0, (0, 3968, 0, 0)), _View(0, (3968, 0, 0, 0))]
    assert router.choose(REQ, views) == 2
    assert router.choose(REQ, views[:2]) == 1
    # A long queue outweighs the credit.
    assert router.choose(REQ, [_View(0), _View(20, (3968, 0, 0, 0))]) == 0


def test_affinity_load_objective_moves_with_mu() -> None:
    views = [_View(0), _View(4, (3968, 0, 0, 0))]
    assert AffinityLoad(mu=1.0).choose(REQ, views) == 1  # match only
    assert AffinityLoad(mu=0.0).choose(REQ, views) == 0  # load only
    # mu 0.5, gamma 2: 0.5 * 0.992 - 0.5 * 1 < 0: the idle replica wins; gamma 8 flips it? No:
    # the loaded one is the max load, (L/Lmax)^gamma = 1 whatever gamma.
    assert AffinityLoad(mu=0.5, gamma=2.0).choose(REQ, views) == 0
    views = [_View(1), _View(2, (3968, 0, 0, 0)), _View(4)]
    # 0.5 * 0.992 - 0.5 * (2/4)^2 = 0.371 beats 0 - 0.5 * (1/4)^2 = -0.031.
    assert AffinityLoad(mu=0.5, gamma=2.0).choose(REQ, views) == 1
    with pytest.raises(ValueError):
        make_router("nope")


# -- policies -----------------------------------------------------------------------------------


def _ctx(wait: float | None, tool: str = "pytest", host_free: float | None = None) -> PauseContext:
    return PauseContext("t", tool, wait, 5000, 5000 * 12288.0, 0.5, host_free, 0.0)


def test_vanilla_leaves_blocks_to_the_cache() -> None:
    assert VanillaPolicy().on_pause(_ctx(3.0)).action == "cache"


def test_agentkv_policy_is_agentkvs_own_decision() -> None:
    pol = AgentKVPolicy(BENCH_SMALL_CPU)
    plan = pol.on_pause(_ctx(3.0))
    direct = decide(
        tokens=5000,
        kv_bytes=5000 * 12288.0,
        wait=WaitEstimate(1.5, 3.0, 6.0, "declared"),
        costs=BENCH_SMALL_CPU.policy_costs(),
        pressure=0.5,
        host_free_bytes=None,
        disk_free_bytes=0.0,
        params=pol.params,
    )
    assert plan.action == direct.action == "offload_host"
    assert plan.prefetch_at_s == direct.prefetch_at_s
    # A wait far below the break-even wait is retained under a lease.
    short = pol.on_pause(_ctx(0.001, tool="ls"))
    assert short.action == "retain" and short.lease_s > 0
    # The predictor learns: after observing long waits of 'ls' the same declaration offloads.
    for _ in range(50):
        pol.on_resume("ls", 30.0)
    assert pol.on_pause(_ctx(0.001, tool="ls")).action == "offload_host"
    assert pol.expiry_action == DEMOTION_ACTION


def test_retain_always_and_offload_always() -> None:
    assert RetainAlwaysPolicy(12.0).on_pause(_ctx(600.0)).lease_s == 12.0
    off = OffloadAlwaysPolicy()
    assert off.on_pause(_ctx(1.0)).action == "offload_host"
    full = PauseContext("t", "x", 1.0, 5000, 6e7, 0.5, 0.0, None)
    assert off.on_pause(full).action == "offload_disk"
    with pytest.raises(ValueError):
        make_policy("nope", BENCH_SMALL_CPU)


# -- costs --------------------------------------------------------------------------------------


def test_prefill_cost_matches_the_policy_recompute_formula() -> None:
    c = BENCH_SMALL_CPU
    assert c.prefill_s(4096, 0) == pytest.approx(c.full_recompute_s(4096))
    # Attention makes a chunk after a long context dearer than the same chunk from scratch.
    assert c.prefill_s(512, 8192) > c.prefill_s(512, 0)


def test_calibration_files(tmp_path: Path) -> None:
    own = tmp_path / "cal.json"
    own.write_text(json.dumps({"schema": CALIBRATION_SCHEMA, "prefill_flops_per_s": 1e12}))
    assert load_calibration(own).prefill_flops_per_s == 1e12
    own.write_text(json.dumps({"schema": CALIBRATION_SCHEMA, "name": "x", "source": "here"}))
    assert (load_calibration(own).name, load_calibration(own).source) == ("x", "here")
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"host_copy_bytes_per_s": 8e9, "prefill_tokens_per_s": 1000.0}))
    c = load_calibration(prof)
    assert c.host_link_bytes_per_s == 8e9 and c.policy_prefill_known
    assert c.prefill_flops_per_s == pytest.approx(1000.0 * 2 * c.model_params)
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ConfigError):
        load_calibration(bad)


# -- the fleet ----------------------------------------------------------------------------------


def _workload(n: int = 6, turns: int = 4) -> SimWorkload:
    trajs = []
    for i in range(n):
        ts = [SimTurn(1536, 2500, 24)]
        for k in range(1, turns):
            ts.append(SimTurn(ts[-1].prompt_tokens + 24, 300 + 50 * k, 24, 0.5 * k, "t", 0.5))
        trajs.append(SimTrajectory(f"t{i}", 1.0 * i, tuple(ts), 1536, "g"))
    return SimWorkload(tuple(trajs))


def test_same_inputs_same_result_and_arrivals_follow_the_seed() -> None:
    wl = _workload()
    a = simulate(wl, FleetConfig(replicas=2, router="least-loaded")).summary.to_dict()
    b = simulate(wl, FleetConfig(replicas=2, router="least-loaded")).summary.to_dict()
    assert a == b
    assert wl.with_poisson_arrivals(0.5, 1) == wl.with_poisson_arrivals(0.5, 1)
    assert wl.with_poisson_arrivals(0.5, 1) != wl.with_poisson_arrivals(0.5, 2)


def test_agentkv_beats_vanilla_under_pressure_and_every_turn_completes() -> None:
    wl = _workload()
    out = {}
    for pol in ("vanilla", "agentkv", "retain-always", "offload-always"):
        s = simulate(wl, FleetConfig(policy=pol, num_blocks=96)).summary
        assert s.turns == wl.turns and s.rejected_turns == 0
        out[pol] = s
    assert (out["agentkv"].resume_hit_rate or 0) > (out["vanilla"].resume_hit_rate or 1)
    assert out["agentkv"].tier_hit_tokens > 0 and out["vanilla"].tier_hit_tokens == 0
    assert out["retain-always"].decisions == {"retain": wl.turns - len(wl.trajectories)}


def test_a_prompt_larger_than_the_pool_is_rejected_not_hung() -> None:
    wl = SimWorkload((SimTrajectory("big", 0.0, (SimTurn(0, 9000, 8),)),))
    s = simulate(wl, FleetConfig(num_blocks=16)).summary
    assert s.rejected_turns == 1 and s.turns == 0


def test_the_core_imports_no_engine_plugin_sdk_or_bench() -> None:
    import subprocess
    import sys

    code = (
        "import sys, agentkv.simulate.fleet, agentkv.simulate.search, agentkv.simulate.validate, "
        "agentkv.simulate.plots, agentkv.simulate.grid_fit\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'vllm', 'torch', 'agentkv_vllm', 'harness_sdk', 'agentkv_bench', 'matplotlib'})\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_a_remote_tier_serves_a_resume_routed_to_another_replica() -> None:
    # Eager write-backs: a deferred copy (the forecast mode) reaches the remote tier only once
    # the replica that paused it forecasts eviction, so a resume routed away would find nothing.
    wl = _workload(n=4, turns=4)
    base = FleetConfig(replicas=2, router="round-robin", num_blocks=96, writeback=Writeback.EAGER)
    local = simulate(wl, base).summary
    shared = simulate(wl, replace(base, remote_capacity_gib=4.0)).summary
    assert shared.tier_hit_tokens > local.tier_hit_tokens
    assert (shared.resume_hit_rate or 0) > (local.resume_hit_rate or 1)


def _slow_and_busy() -> SimWorkload:
    """A slow trajectory (a 400 s human wait) whose context a busy one evicts meanwhile."""
    turns = [SimTurn(1536, 2500, 24)]
    turns.append(SimTurn(turns[-1].prompt_tokens + 24, 400, 24, 400.0, "human", 400.0))
    other = [SimTurn(0, 9000, 24, 0.0), SimTurn(9024, 300, 24, 10.0, "t", 10.0)]
    return SimWorkload(
        (
            SimTrajectory("slow", 0.0, tuple(turns), 1536, "g"),
            SimTrajectory("busy", 60.0, tuple(other)),
        )
    )


def test_long_declared_waits_go_to_disk_and_come_back_through_the_prefetch() -> None:
    wl = _slow_and_busy()
    cfg = FleetConfig(num_blocks=96, host_capacity_gib=1.0, disk_capacity_gib=4.0)
    s = simulate(wl, cfg).summary
    assert s.decisions.get("offload_disk") == 1
    assert s.tier_hit_tokens > 0  # the busy trajectory evicted it; the copy came back


def test_a_bench_report_calibrates_the_flop_rate(tmp_path: Path) -> None:
    turns = [
        {"prompt_tokens": 4000, "cached_tokens": 0, "latency_s": 20.0},
        {"prompt_tokens": 5000, "cached_tokens": 1536, "latency_s": 20.0},
    ]
    report = {
        "schema": "agentkv-bench-agents/1",
        "configs": {"vanilla": {"summary": {"makespan_s": 40.0}, "turns": turns}},
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    c = load_calibration(path)
    flops = BENCH_SMALL_CPU.flops(4000, 0) + BENCH_SMALL_CPU.flops(3464, 1536)
    assert c.prefill_flops_per_s == pytest.approx(flops / 40.0)


def test_engine_costs_fitted_to_measured_turns() -> None:
    from agentkv.simulate.costs import fit_rounds

    truth = replace(BENCH_SMALL_CPU, prefill_flops_per_s=1.2e12, attention_flops_per_s=6e11)
    rounds = []
    for n, c in [(100 * i, 300 * (i % 5)) for i in range(1, 30)]:
        ttft = 0.08 + truth.prefill_s(n, c)
        rounds.append(
            {
                "prompt_tokens": n + c,
                "cached_tokens": c,
                "ttft_s": ttft,
                "latency_s": ttft + 9 * 0.04,
                "completion_tokens": 10,
            }
        )
    fitted = fit_rounds(rounds, BENCH_SMALL_CPU, "test")
    assert fitted.prefill_flops_per_s == pytest.approx(1.2e12, rel=1e-6)
    assert fitted.attention_flops_per_s == pytest.approx(6e11, rel=1e-6)
    assert fitted.step_overhead_s == pytest.approx(0.04)
    # Too few turns: the base's costs with a note, never an error (issue 28).
    few = fit_rounds(rounds[:3], BENCH_SMALL_CPU, "test")
    assert few.prefill_flops_per_s == BENCH_SMALL_CPU.prefill_flops_per_s
    assert any("too few" in n for n in few.notes)


def test_the_capacity_equal_bound_beats_every_policy_on_the_same_pool() -> None:
    from agentkv.simulate.bounds import capacity_equal

    turns = [SimTurn(0, 1500, 16)]
    for _ in range(4):
        turns.append(SimTurn(turns[-1].prompt_tokens, 300, 16, wait_before_s=5.0, tool="t"))
    wl = SimWorkload(tuple(SimTrajectory(f"t{i}", i * 0.5, tuple(turns)) for i in range(6)))
    bound = capacity_equal(wl, 40, BENCH_SMALL_CPU)
    assert bound.resume_hit_rate is not None and bound.resume_hit_rate > 0.75
    for policy in ("vanilla", "agentkv"):
        s = simulate(wl, FleetConfig(policy=policy, num_blocks=40)).summary
        assert s.recomputed_tokens >= bound.recomputed_tokens
        assert s.jct_mean_s is not None and bound.jct_mean_s is not None
        assert s.jct_mean_s >= bound.jct_mean_s * 0.999
    # It hits what an infinite-memory oracle hits; only admission differs (the oracle runs
    # every request at once, which batches their prefills: not always sooner for each).
    oracle = simulate(wl, FleetConfig(policy="vanilla", num_blocks=4000)).summary
    assert oracle.recomputed_tokens == bound.recomputed_tokens


def test_a_trace_report_gets_its_capacity_equal_bound_next_to_the_oracle() -> None:
    from agentkv.simulate.bounds import trace_report_bound

    trace = Path("/work/shared/traces/multi_session_example.csv")
    if not trace.is_file():
        pytest.skip("the example trace is not on this machine")
    fixture = Path(__file__).parent / "fixtures/simulate/trace_report_negative_fit.json"
    report = json.loads(fixture.read_text())
    report["trace"] = {"path": str(trace), "token_scale": 1.0, "time_scale": 1.0}
    report["server"] = {"num_blocks": 8}
    bound = trace_report_bound(report)
    assert bound is not None and bound["num_blocks"] == 8
    assert bound["summary"]["resume_hit_rate"] > 0.5 and bound["summary"]["jct_mean_s"] > 0
    report["trace"]["path"] = ""
    assert trace_report_bound(report) is None  # no trace file: no bound, no error


def test_a_trace_report_too_short_to_fit_gets_no_bound_and_says_why() -> None:
    """8 oracle rounds cannot be fitted: the built-in small model's costs would give a "bound"
    the tiny model's measured runs beat by 10x (seen in a sweep of the example trace)."""
    from agentkv.simulate.bounds import trace_report_bound

    trace = Path("/work/shared/traces/multi_session_example.csv")
    if not trace.is_file():
        pytest.skip("the example trace is not on this machine")
    fixture = Path(__file__).parent / "fixtures/simulate/trace_report_negative_fit.json"
    report = json.loads(fixture.read_text())
    report["configs"]["oracle"]["rounds"] = report["configs"]["oracle"]["rounds"][:8]
    report["trace"] = {"path": str(trace), "token_scale": 1.0, "time_scale": 1.0}
    report["server"] = {"num_blocks": 8}
    bound = trace_report_bound(report)
    assert bound is not None and bound["summary"] is None
    assert any("too few measured turns (8)" in n for n in bound["notes"]), bound


def test_chunk_admission_preempts_the_newest_request_by_recompute_and_finishes() -> None:
    from agentkv.simulate.admission import Admission

    # Two long answers in a pool that holds both prompts but not both outputs: vLLM admits
    # both (their prompts fit), then the older one's decode needs a block the newer one holds.
    trajs = tuple(
        SimTrajectory(f"t{i}", i * 0.01, (SimTurn(0, 1000, 600),), output_in_cache=False)
        for i in range(2)
    )
    wl = SimWorkload(trajs)
    chunk = simulate(wl, FleetConfig(num_blocks=20, admission=Admission.CHUNK)).summary
    assert chunk.preemptions >= 1 and chunk.turns == 2
    whole = simulate(wl, FleetConfig(num_blocks=20, admission=Admission.WHOLE)).summary
    assert whole.preemptions == 0 and whole.turns == 2
    # The preempted request recomputed, but its hit accounting is that of its first admission.
    assert chunk.cached_tokens == whole.cached_tokens == 0


def test_vllm_s_null_block_is_not_usable() -> None:
    # 9 blocks of 128: vLLM uses 8; a 960-token request (8 blocks) fits, a 1,100-token one not.
    fits = SimWorkload((SimTrajectory("a", 0.0, (SimTurn(0, 950, 10),)),))
    too_big = SimWorkload((SimTrajectory("b", 0.0, (SimTurn(0, 1100, 10),)),))
    assert simulate(fits, FleetConfig(num_blocks=9)).summary.rejected_turns == 0
    assert simulate(too_big, FleetConfig(num_blocks=9)).summary.rejected_turns == 1


def test_device_prefetch_turns_the_disk_reload_into_a_device_hit_by_the_managers_rule() -> None:
    """The manager's rule (agentkv.prefetch_rule) in the simulator: the slow trajectory's
    context, evicted by the busy one and copied to disk, is back in device blocks before its
    resume, so the resume reloads nothing; without the prefetch it reloads from the tier.
    Eager write-backs: with the forecast, the busy trajectory's copy is deferred (nothing to
    prefetch: vLLM still caches it)."""
    wl = _slow_and_busy()
    base = FleetConfig(
        num_blocks=96, host_capacity_gib=1.0, disk_capacity_gib=4.0, writeback=Writeback.EAGER
    )
    off = simulate(wl, base).summary
    on = simulate(wl, replace(base, device_prefetch=True)).summary
    assert off.prefetch == {}
    assert on.prefetch.get("on_time") == on.resume_turns == 2, on.prefetch  # both resumes
    assert on.tier_hit_tokens < off.tier_hit_tokens
    assert on.resume_ttft_p99_s is not None and off.resume_ttft_p99_s is not None
    assert on.resume_ttft_p99_s < off.resume_ttft_p99_s


def test_the_simulators_prefetch_skips_a_wide_prediction() -> None:
    """No declared wait: the cold-start prior's p90/p10 is 120, past the rule's 8."""
    turns = [SimTurn(1536, 2500, 24)]
    turns.append(SimTurn(turns[-1].prompt_tokens + 24, 400, 24, 400.0, "human", None))
    wl = SimWorkload((SimTrajectory("slow", 0.0, tuple(turns), 1536, "g"),))
    cfg = FleetConfig(
        num_blocks=96, host_capacity_gib=1.0, disk_capacity_gib=4.0, device_prefetch=True
    )
    s = simulate(wl, cfg).summary
    assert "on_time" not in s.prefetch
