"""PNG plots of simulation results (matplotlib, imported only when a plot is drawn).

Primitives:
  plot_results(results, out_dir) -> [paths]   ttft_cdf.png (resume turns, all turns), one line per
                                               configuration; kv_occupancy.png (device use and
                                               pins, host / disk / remote bytes, paused
                                               trajectories over time); hit_rate_by_turn.png
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentkv.simulate.fleet import SimResult


def _cdf(ax: Any, xs: list[float], label: str) -> None:
    if not xs:
        return
    s = sorted(max(x, 1e-3) for x in xs)
    n = len(s)
    ax.step(s, [(i + 1) / n for i in range(n)], where="post", label=label)


def plot_results(results: Mapping[str, SimResult], out_dir: str | Path) -> list[Path]:
    """Write the three plots for ``results`` (label -> result) into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for label, r in results.items():
        _cdf(axes[0], r.resume_ttft, label)
        _cdf(axes[1], r.ttft, label)
    for ax, title in zip(axes, ("resume turns", "all turns"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log)")
        ax.set_title(f"simulated TTFT CDF, {title}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of turns")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for label, r in results.items():
        if not r.samples:
            continue
        t = [s[0] for s in r.samples]
        top.plot(t, [100 * s[1] for s in r.samples], label=f"{label}: device in use")
        if any(s[2] for s in r.samples):
            top.plot(t, [100 * s[2] for s in r.samples], ":", label=f"{label}: pinned")
        mib = 2**20
        for idx, tier in ((3, "host"), (4, "disk"), (5, "remote")):
            if any(s[idx] for s in r.samples):
                bottom.plot(t, [s[idx] / mib for s in r.samples], "--", label=f"{label}: {tier}")
    top.set_ylabel("device KV (%)")
    top.set_title("simulated KV occupancy over time (all replicas)")
    top.legend(fontsize=7)
    top.grid(alpha=0.3)
    bottom.set_ylabel("tier MiB")
    bottom.set_xlabel("time (s)")
    bottom.grid(alpha=0.3)
    if bottom.lines:
        bottom.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "kv_occupancy.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in results.items():
        by = r.summary.hit_rate_by_turn
        ax.plot([int(k) for k in by], list(by.values()), marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix hit rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("simulated hit rate per turn")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "hit_rate_by_turn.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
