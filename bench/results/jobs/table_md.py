"""Render `agentkv simulate validate --json` as the markdown table of docs/simulate.md."""
import json
import sys

rows = json.load(sys.stdin)
KEYS = {"resume_ttft_p50_s": "resume TTFT p50", "resume_ttft_p99_s": "resume TTFT p99",
        "jct_mean_s": "JCT mean", "resume_hit_rate": "resume hit rate"}


def f(v):
    if v is None:
        return "-"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


for r in rows:
    if not r["metrics"]:
        print(f"| {r['row']} | {str(r['commit'])[:7]} | not run | | | | | | | | |")
        continue
    by = {(c, k): (p, m, e, ok) for c, k, p, m, e, ok in r["metrics"]}
    for k, label in KEYS.items():
        cells = []
        for c in ("vanilla", "agentkv", "agentkv/vanilla"):
            p, m, e, ok = by[(c, k)]
            err = "-" if e is None else f"{e:+.0%}" + ("" if ok else " **miss**")
            cells.append(f"{f(p)} / {f(m)} ({err})")
        before = "yes" if r.get("committed_before_run") else "NO"
        print(f"| {r['row']} | {str(r['commit'])[:7]} | {before} | {label} | " + " | ".join(cells) + " |")
