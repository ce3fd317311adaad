"""PNG plots of a report (matplotlib, Agg backend: no display needed).

ttft_cdf.png        CDF of TTFT, resume turns and all turns, one line per configuration
kv_occupancy.png    over time: device KV usage (both), agentkv's bytes pinned on the device /
                    in host RAM / on disk, and how many trajectories are waiting on a tool
hit_rate_by_turn.png  prefix hit rate (cached / prompt tokens) per turn index

For a trace replay (``write_trace_plots``, vanilla, agentkv and the oracle):
trace_ttft_cdf.png      CDF of TTFT, resume rounds and all rounds
trace_stall.png         the mean resume round taken apart: load per tier, prefill, queue + rest,
                        next to the (cold) memcpy time of the loaded bytes
trace_kv_occupancy.png  device KV blocks in use over time and how many sessions are waiting
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {
    "vanilla": "tab:red",
    "agentkv": "tab:blue",
    "retain-always": "tab:green",
    "offload-always": "tab:orange",
    "oracle": "tab:gray",
}


def _cdf(ax: Any, xs: list[float], label: str, color: str) -> None:
    if not xs:
        return
    s = sorted(xs)
    ys = [(i + 1) / len(s) for i in range(len(s))]
    ax.step(s, ys, where="post", label=label, color=color)


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the three PNGs into ``out``; return their paths."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    configs = report["configs"]
    return [
        _ttft_cdf(plt, configs, "turns", "gray", out / "ttft_cdf.png"),
        _kv_occupancy(plt, configs, out / "kv_occupancy.png"),
        _hit_rate_by_turn(plt, configs, out / "hit_rate_by_turn.png"),
    ]


def write_trace_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the trace replay's three PNGs into ``out``; return their paths."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    configs = report["configs"]
    return [
        _ttft_cdf(plt, configs, "rounds", "black", out / "trace_ttft_cdf.png"),
        _stall(plt, report, configs, out / "trace_stall.png"),
        _trace_kv_occupancy(plt, configs, out / "trace_kv_occupancy.png"),
    ]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _ttft_cdf(plt: Any, configs: dict[str, Any], unit: str, default_color: str, path: Path) -> Path:
    """TTFT CDFs of the resume ``unit`` (turns or rounds) and of all of them, side by side."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind, title in ((axes[0], "resume", f"resume {unit}"), (axes[1], None, f"all {unit}")):
        for name, cfg in configs.items():
            xs = [t["ttft_s"] for t in cfg[unit] if kind is None or t["kind"] == kind]
            _cdf(ax, xs, name, COLORS.get(name, default_color))
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log)")
        ax.set_title(f"TTFT CDF, {title}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(f"fraction of {unit}")
    axes[0].legend()
    return _save(plt, fig, path)


def _kv_occupancy(plt: Any, configs: dict[str, Any], path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, cfg in configs.items():
        samples = cfg["samples"]
        ts = [s["t_s"] for s in samples]
        ax1.plot(
            ts,
            [100 * (s["kv_usage"] or 0.0) for s in samples],
            label=f"{name}: device KV in use",
            color=COLORS.get(name, "gray"),
        )
        ax2.plot(
            ts,
            [s["paused_trajectories"] for s in samples],
            label=f"{name}: trajectories waiting on a tool",
            color=COLORS.get(name, "gray"),
            linestyle=":",
        )
        if name == "agentkv":
            mib = 1 << 20
            ax3 = ax2.twinx()
            for key, style, label in (
                ("device_pinned_bytes", "-", "pinned on device"),
                ("host_bytes", "--", "host tier"),
                ("disk_bytes", "-.", "disk tier"),
            ):
                ax3.plot(
                    ts,
                    [(s.get(key) or 0) / mib for s in samples],
                    style,
                    color="tab:green",
                    label=f"agentkv {label} (MiB)",
                    alpha=0.8,
                )
            ax3.set_ylabel("MiB held for trajectories")
            ax3.legend(loc="upper right", fontsize=7)
    ax1.set_ylabel("device KV usage (%)")
    ax1.set_title("KV occupancy over time")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    ax2.set_ylabel("paused trajectories")
    ax2.set_xlabel("time since start (s)")
    ax2.legend(loc="upper left", fontsize=7)
    ax2.grid(True, alpha=0.3)
    return _save(plt, fig, path)


def _hit_rate_by_turn(plt: Any, configs: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, cfg in configs.items():
        by_turn = cfg["summary"]["hit_rate_by_turn"]
        xs = sorted(by_turn, key=int)
        ax.plot(
            [int(x) for x in xs],
            [by_turn[x] for x in xs],
            "o-",
            label=name,
            color=COLORS.get(name, "gray"),
        )
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix hit rate (cached / prompt tokens)")
    ax.set_ylim(0, 1.05)
    ax.set_title("hit rate per turn")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _stall(plt: Any, report: dict[str, Any], configs: dict[str, Any], path: Path) -> Path:
    by_config = report["stall_decomposition"]["by_config"]
    names = [n for n in configs if (by_config.get(n) or {}).get("resume_rounds")]
    tiers = sorted({t for n in names for t in by_config[n]["load_mean_s_by_tier"]})
    fig, ax = plt.subplots(figsize=(7, 4))

    def part(m: dict[str, Any], label: str) -> float:
        if label.startswith("load ("):
            return float(m["load_mean_s_by_tier"].get(label[6:-1], 0.0))
        return float(m["prefill_mean_s" if label == "prefill" else "queue_mean_s"])

    labels = [f"load ({t})" for t in tiers] + ["prefill", "queue + rest"]
    shades = ["tab:green", "tab:olive", "tab:orange", "tab:purple"]
    bottoms = [0.0] * len(names)
    for i, label in enumerate(labels):
        vals = [1000 * part(by_config[n], label) for n in names]
        ax.bar(names, vals, bottom=bottoms, label=label, color=shades[i % len(shades)])
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    memcpy = [1000 * by_config[n]["memcpy_mean_s"] for n in names]
    if any(memcpy):
        ax.scatter(
            names, memcpy, marker="_", s=400, color="black", label="memcpy of loaded bytes (cold)"
        )
    ax.set_ylabel("ms, mean per resume round")
    ax.set_title("resume stall, taken apart")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _trace_kv_occupancy(plt: Any, configs: dict[str, Any], path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, cfg in configs.items():
        samples = cfg["samples"]
        ts = [s["t_s"] for s in samples]
        color = COLORS.get(name, "black")
        # Blocks, not %: the oracle's pool is much larger than the other two.
        blocks = cfg.get("num_blocks") or 0
        ax1.plot(
            ts,
            [(s["kv_usage"] or 0.0) * blocks for s in samples],
            label=f"{name} ({blocks} blocks)",
            color=color,
        )
        ax2.plot(ts, [s["paused_trajectories"] for s in samples], label=name, color=color)
    ax1.set_ylabel("device KV blocks in use")
    ax1.set_title("KV occupancy over time")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    ax2.set_ylabel("sessions waiting")
    ax2.set_xlabel("time since start (s)")
    ax2.grid(True, alpha=0.3)
    return _save(plt, fig, path)
