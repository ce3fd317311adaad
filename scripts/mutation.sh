#!/usr/bin/env bash
# Mutation testing of agentkv/manager/ and agentkv/tiers/store.py with mutmut (docs/testing.md).
#
#   scripts/mutation.sh [SAMPLE] [SEED]     SAMPLE mutants drawn with SEED (default 150, 24);
#                                           SAMPLE=all runs every mutant (hours on 2 cores)
#
# Works in a scratch copy (build/mutation: the sources, the tests and pyproject.toml's
# [tool.mutmut]), so the checkout is never mutated. mutmut 3 generates every mutant, records
# which tests reach which function, then runs each sampled mutant against the tests that reach
# it (the manager and store unit tests, the stateful test at its default profile, the fake-store
# contract). Writes build/mutation/report.txt: the score and every surviving mutant's diff.
# MUTATION_REUSE=1 keeps the generated mutants (same sources) and recollects the test map;
# MUTATION_NAMES=FILE runs exactly the mutants FILE lists (one per line) instead of a sample.
# CPU heavy: run it under `nice -n 10`. Env: PYTHON (default: the venv's or python3),
# MUTATION_DIR, MUTATION_CHILDREN (parallel mutants, default: all cores).
set -euo pipefail

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
sample=${1:-${MUTATION_SAMPLE:-150}}
seed=${2:-${MUTATION_SEED:-24}}
work=${MUTATION_DIR:-$root/build/mutation}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
bin=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")
mutmut="$bin/mutmut"
[[ -x "$mutmut" ]] || { echo "mutmut not installed in $bin (pip install -e '.[dev]')"; exit 2; }
children=${MUTATION_CHILDREN:-$(nproc)}

copy_tests() {  # into $1: the tests the selection names, and what they import
    mkdir -p "$1/tests/unit"
    cp "$root/pyproject.toml" "$1/"
    cp "$root/tests/__init__.py" "$root/tests/valkey_fixture.py" "$1/tests/"
    for f in __init__.py sim_engine.py sim_pool.py sim_workers.py fake_store.py manager_helpers.py manager_answers.json \
        stateful_invariants.py stateful_control.py stateful_restart.py \
        key_helpers.py remote_fixtures.py \
        test_manager.py test_manager_bugs.py test_manager_mutants.py test_manager_net.py \
        test_manager_pressure.py test_manager_tenants.py test_manager_stateful.py test_recovery.py \
        test_writeback.py test_preempt_save.py test_device_prefetch.py test_invalidation.py \
        test_tiers_store.py test_fake_store.py test_tiers_remote.py test_tiers_store_remote.py; do
        cp "$root/tests/unit/$f" "$1/tests/unit/"
    done
}
if [[ "${MUTATION_REUSE:-0}" == 1 && -d "$work/mutants" ]]; then
    # Reuse the generated mutants (the sources must be unchanged); the tests are copied again and
    # the test map recollected, so tests added since count.
    copy_tests "$work"
    copy_tests "$work/mutants"
    rm -f "$work/mutants/mutmut-stats.json"
    cd "$work"
    unset PYTHONPATH
    export PATH="$bin:$PATH" AGENTKV_HYPOTHESIS_PROFILE=mutation
else
rm -rf "$work"
mkdir -p "$work"
cp -r "$root/agentkv" "$work/agentkv"
copy_tests "$work"
find "$work" -name __pycache__ -prune -exec rm -rf {} +
cd "$work"
# Imports resolve to mutants/ (mutmut puts it first on sys.path), never to the checkout.
unset PYTHONPATH
export PATH="$bin:$PATH"
# Shrinking a failing example does not change whether a mutant is killed, only the time.
export AGENTKV_HYPOTHESIS_PROFILE=mutation

# 1. Generate every mutant and record which tests reach which function (a filter that matches
#    nothing stops mutmut right after that).
"$mutmut" run --max-children "$children" "generate-only-no-such-mutant" >gen.log 2>&1 || true
fi
if [[ -n "${MUTATION_NAMES:-}" ]]; then
    # Exactly the mutants listed in that file (e.g. the survivors of the last run).
    cp "$MUTATION_NAMES" sample.txt
else
"$PYTHON" - "$sample" "$seed" >sample.txt <<'EOF'
import json, random, sys
from pathlib import Path
names = sorted(
    name
    for meta in Path("mutants").rglob("*.meta")
    for name in json.loads(meta.read_text())["exit_code_by_key"]
)
if not names:
    sys.exit("no mutants generated: see build/mutation/gen.log")
n = sys.argv[1]
pick = names if n == "all" else sorted(random.Random(int(sys.argv[2])).sample(names, min(int(n), len(names))))
print(f"# {len(pick)} of {len(names)} mutants, seed {sys.argv[2]}", file=sys.stderr)
print("\n".join(pick))
EOF
fi
echo "mutants: $(grep -c . sample.txt) sampled of $(
    "$PYTHON" -c 'import json,pathlib;print(sum(len(json.loads(m.read_text())["exit_code_by_key"]) for m in pathlib.Path("mutants").rglob("*.meta")))'
) (seed $seed)"

# 2. Run the sample.
mapfile -t names <sample.txt
"$mutmut" run --max-children "$children" "${names[@]}" >run.log 2>&1 || true

# 3. Score and survivors.
"$PYTHON" - <<'EOF' >report.txt
import json, subprocess
from collections import Counter
from pathlib import Path
# mutmut's own meaning of a mutant's exit code (mutmut/stats.py)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 37: "caught by type check", -24: "timeout", 24: "timeout",
          152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault", None: "not checked"}
picked = set(Path("sample.txt").read_text().split())
status = {}
for meta in Path("mutants").rglob("*.meta"):
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        if name in picked:
            status[name] = STATUS.get(code, "suspicious")
counts = Counter(status.values())
killed = counts["killed"] + counts["timeout"]
live = sorted(n for n, s in status.items() if s in ("survived", "no tests"))
print(f"sampled {len(picked)}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
print(f"score (killed + timeout) / (killed + timeout + survived + no tests): "
      f"{killed}/{killed + len(live)} = {100 * killed / max(1, killed + len(live)):.1f}%")
for name in live:
    print(f"\n===== {status[name].upper()} {name}")
    print(subprocess.run(["mutmut", "show", name], capture_output=True, text=True).stdout)
EOF
head -2 report.txt
echo "report: $work/report.txt"
