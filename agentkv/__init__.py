"""agentkv: engine-agnostic core of the agentkv KV-cache manager for agent workloads.

The core never imports vllm, torch, the plugin (``agentkv_vllm``) or the SDK (``harness_sdk``) at
module level, so capacity planning, the pause policy and the tier store run anywhere.

Modules:
  geometry     model geometry from an HF config.json -> KV bytes per token
  capacity     pool sizing, concurrent trajectories, prefix sharing, tool-wait inflation
  costs        what moving or rebuilding KV costs: reload, round trip, recompute, hold cost
  policy       the pause decision: retain / offload_host / offload_disk / drop, with its numbers
               (policy_inputs: its inputs made safe)
  predict      per-tool wait prediction and prefetch timing
  tiers        host (RAM arena) and disk block stores, GPUDirect Storage when present
  diagnostics  prefix-stability analysis (where and why a prefix broke): a package of
               trajectory (input), prompts (rendering), causes (the rules), replay (the report)
  telemetry    metric and span names, OpenTelemetry set-up
  modelgen     the embedded random-weight model and tokenizer (no hub)
  cli          the ``agentkv`` command
"""

__version__ = "0.1.0"
