"""Fleet simulator behind ``agentkv simulate`` (docs/simulate.md): SimPy replicas of a
vLLM-like engine with agentkv's own pause policy, behind a router.

Modules, one idea each:
  workload    the neutral workload form (SimTurn, SimTrajectory, SimWorkload), from_trace
  costs       EngineCosts (step cost model, bandwidths), BENCH_SMALL_CPU, load_calibration
  pool        BlockPool: paged blocks, prefix sharing, pins, LRU eviction by segments
  tiers       Tier: host / disk / remote copies with capacity and a transfer queue
  policies    KV policies: vanilla, agentkv (agentkv.policy / agentkv.predict), retain-always,
              offload-always
  routers     round-robin, session-affinity, least-loaded, kv-aware, affinity-load
  replica     Replica: the engine loop in steps over a pool, tiers and a policy
  fleet       FleetConfig, simulate(workload, config) -> SimResult
  metrics     Recorder, Summary (the bench report's metric names), percentile
  search      find_replicas: the smallest fleet meeting a TTFT p99 objective
  validate    simulated vs measured runs (load_measured, compare)
  grid_fit    BENCH_SMALL_CPU's two fitted constants re-derived from the run they fit
  published   a measured published result (vLLM's single-request TTFT on an H100), simulated
  plots       PNG plots (matplotlib, imported when drawing)

Imports neither vllm, torch, the plugin, harness_sdk nor agentkv_bench.
"""
