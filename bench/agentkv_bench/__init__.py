"""agentkv_bench: the agent-workload benchmark behind ``agentkv bench agents``.

Modules:
  workload   seeded generator of trajectory plans (pure)
  drivers    run one plan against a server: plain OpenAI requests (vanilla) or harness_sdk (agentkv)
  streaming  one streamed request measured (TTFT, latency, usage): the vanilla driver and the replay
  progress   ProgressFn and reporter(progress) -> say: the progress reports of every runner
  sampler    periodic KV-occupancy samples from /metrics and /agentkv/v1/status
  report     per-configuration metrics, ratios, JSON and markdown
  plots      PNG plots (matplotlib, Agg)
  overhead   ``vllm bench serve`` plugin vs vanilla on a workload without pauses
  runner     one invocation: start servers in turn, run, collect, write the report

Recorded traces (``agentkv bench agents --trace FILE``; the parser is ``agentkv.traces``):
  trace_prompts  token-id prompts whose prefix is the session's history; the oracle's pool size
  trace_replay   a closed loop per session against one server (vanilla, agentkv or oracle)
  trace_report   summaries, agentkv/vanilla and agentkv/oracle ratios, JSON and markdown
  stall_report   the resume stall taken apart (load per tier, prefill, queue), each tier's
                 reload against memcpy, the worker's reload phases
  copy_baseline  the memcpy baselines: cold (shuffled slots of pools past the LLC: the
                 target's) and cache-hot
  trace_runner   one invocation: the three configurations in turn, the report and the plots
"""
