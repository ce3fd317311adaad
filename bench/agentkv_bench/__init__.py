"""agentkv_bench: the agent-workload benchmark behind ``agentkv bench agents``.

Modules:
  workload   seeded generator of trajectory plans (pure)
  drivers    run one plan against a server: plain OpenAI requests (vanilla) or harness_sdk (agentkv)
  sampler    periodic KV-occupancy samples from /metrics and /agentkv/v1/status
  report     per-configuration metrics, ratios, JSON and markdown
  plots      PNG plots (matplotlib, Agg)
  overhead   ``vllm bench serve`` plugin vs vanilla on a workload without pauses
  runner     one invocation: start servers in turn, run, collect, write the report
"""
