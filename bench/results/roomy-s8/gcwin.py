import sys, collections
sys.path.insert(0, "/work/main/bench")
from pathlib import Path
from array import array
from agentkv_bench.step_probe_site.sitecustomize import KEYS
d = Path(sys.argv[1])
keys = KEYS + tuple(l for l in (d/"extra-targets.txt").read_text().splitlines() if l)
procs = []
for p in sorted(d.glob("probe-*.bin")):
    a = array("d"); raw = p.read_bytes(); a.frombytes(raw[: len(raw) - len(raw) % 24])
    recs = [(keys[int(a[i])], a[i+1], a[i+2]) for i in range(0, len(a), 3)]
    if recs: procs.append((min(r[1] for r in recs), p.name, recs))
procs.sort()
# server windows: from each engine core's step records, the busy stretch (steps more than 2/s)
steps = [(t0, n, [r for r in recs if r[0] == "EngineCore.step"]) for t0, n, recs in procs]
wins = []
for t0, n, st in steps:
    if len(st) > 100:
        ts = sorted(r[1] for r in st)
        # last 800 steps: the run (warm-up is a handful)
        wins.append((ts[-min(len(ts), 850)], ts[-1]))
print("windows", [(round(a), round(b), round(b - a, 1)) for a, b in wins])
for t0, name, recs in procs:
    for a, b in wins:
        inwin = [r for r in recs if a <= r[1] <= b]
        if not inwin: continue
        c = collections.defaultdict(list)
        for k, s, dur in inwin:
            if k.startswith("gc."): c[k].append(dur)
        if c:
            print(name, f"win {round(a)}", "  ".join(f"{k}: n={len(v)} sum={sum(v)*1e3:.1f}ms max={max(v)*1e3:.1f}ms" for k, v in sorted(c.items())))
