"""The ``agentkv`` command.

Each sub-command lives in its own module with a ``register(app)`` function, so the root stays
small and ``agentkv --help`` never imports vllm or torch (they are imported inside the commands
that need them).
"""

from __future__ import annotations

import typer

from agentkv.cli import (
    bench_agents,
    bench_fleet,
    bench_overhead,
    bench_rollout,
    bench_scale,
    bench_tiers,
    diagnose,
    fleet,
    model,
    policy,
    serve,
    simulate,
    size,
)

app = typer.Typer(
    name="agentkv",
    help="KV-cache manager for agent workloads: size nodes, decide pauses, serve vLLM with the plugin.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks: tier bandwidth, agent workloads and RL rollouts vs vanilla vLLM, idle-trajectory scale.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

model.register(app)
serve.register(app)
size.register(app)
policy.register(app)
diagnose.register(app)
fleet.register(app)
simulate.register(app)
bench_tiers.register(bench_app)
bench_agents.register(bench_app)
bench_scale.register(bench_app)
bench_overhead.register(bench_app)
bench_fleet.register(bench_app)
bench_rollout.register(bench_app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
