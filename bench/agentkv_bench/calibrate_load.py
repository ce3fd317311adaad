"""A held-out engine profile for the simulator's validation rows: start a vanilla vLLM server with
the trace bench's settings, run ``agentkv calibrate --load`` against it, stop it.

Primitives:
  ProfileRunOptions     the preset, pool, max length, output path, quick grid
  launch_spec(opts, model_dir, log)  the vanilla server (no connector, both cores, as the bench)
  run(opts) -> dict     the ``agentkv-engine-profile/1`` JSON with a ``provenance`` section
                        (how the server was started, the machine, load averages before and after)

Run it through the CPU queue (docs/simulate.md, "Validation protocol"):

    python -m agentkv_bench.calibrate_load --num-blocks 128 --max-model-len 8192 \
        --out bench/results/profiles/small_cpu_under_load.json

The profile is measured on the engine alone, never on a run the simulator is compared with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv.launch import LaunchSpec, running_server


@dataclass(frozen=True)
class ProfileRunOptions:
    preset: str = "small"
    num_blocks: int = 128
    max_model_len: int = 8192
    max_batched_tokens: int = 2048
    out: Path = Path("bench/results/profiles/engine_profile.json")
    quick: bool = False


def launch_spec(opts: ProfileRunOptions, model_dir: str, log: Path, run_dir: Path) -> LaunchSpec:
    """The trace bench's vanilla configuration (``trace_runner._spec``) with this pool."""
    from agentkv_bench.trace_runner import TraceBenchOptions, block_bytes_of

    bb = block_bytes_of(opts.preset)
    return LaunchSpec(
        model=model_dir,
        connector_config=None,
        kv_space_gib=max(1, math.ceil(opts.num_blocks * bb * 1.05 / 2**30)),
        num_blocks=opts.num_blocks,
        served_model_name=opts.preset,
        max_model_len=opts.max_model_len,
        extra_env=dict(TraceBenchOptions(trace=Path(".")).extra_env),
        log_path=log,
        run_dir=run_dir,
    )


def run(opts: ProfileRunOptions) -> dict[str, Any]:
    from agentkv import modelgen
    from agentkv.simulate.costs import BENCH_SMALL_CPU
    from agentkv.simulate.engine_profile import build_profile, measure_under_load
    from agentkv_bench.runner import machine_info

    model_dir = str(modelgen.ensure_model(opts.preset))
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    log = opts.out.with_suffix(".server.log")
    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="agentkv-profile-") as work:
        spec = launch_spec(opts, model_dir, log, Path(work) / "run")
        with running_server(spec) as server:
            ready_s = time.time() - started
            samples = measure_under_load(
                server.base_url,
                model=server.model,
                max_batched_tokens=opts.max_batched_tokens,
                progress=lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", flush=True),
                quick=opts.quick,
            )
            argv = server.argv
    profile = build_profile(samples, BENCH_SMALL_CPU)
    profile["provenance"] = {
        "what": "agentkv calibrate --load against a fresh vanilla vLLM server (trace bench "
        "settings), started and stopped by agentkv_bench.calibrate_load; no validation run "
        "was measured by it",
        "server_argv": argv,
        "preset": opts.preset,
        "num_blocks": opts.num_blocks,
        "max_model_len": opts.max_model_len,
        "quick": opts.quick,
        "server_ready_s": round(ready_s, 1),
        "measure_s": round(time.time() - started - ready_s, 1),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "machine": machine_info(),
    }
    opts.out.write_text(json.dumps(profile, indent=1) + "\n", encoding="utf-8")
    return profile


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--num-blocks", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--out", type=Path, default=ProfileRunOptions.out)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    profile = run(
        ProfileRunOptions(
            a.preset, a.num_blocks, a.max_model_len, a.max_batched_tokens, a.out, a.quick
        )
    )
    c = profile["costs"]
    print(
        f"profile written to {a.out}: linear {c['prefill_flops_per_s']:.3g} FLOP/s, attention "
        f"{c['attention_flops_per_s']:.3g} FLOP/s, step {c['step_overhead_s'] * 1e3:.1f} ms, "
        f"loaded/idle prefill {profile['loaded_over_idle_prefill']}, notes {profile['notes']}, "
        f"{profile['provenance']['measure_s']} s measuring"
    )


if __name__ == "__main__":
    main()
