#!/bin/bash
# Run row $1's printed command (from its committed prediction) with a timeout of $2 seconds;
# refuse if the prediction is not committed; skip a row already measured; with $3, skip the row
# when the job has already run more than $3 seconds (bash's SECONDS of the calling job).
set -u
P=bench/results/predictions/$1.json
git log --format=%h -1 -- "$P" | grep -q . || { echo "row $1: prediction not committed, not run"; exit 3; }
REPORT=$(python3 -c "import json; print(json.load(open('$P'))['measured_report'])")
[ -f "$REPORT" ] && { echo "row $1: already measured ($REPORT)"; exit 0; }
if [ -n "${3:-}" ] && [ "${JOB_ELAPSED:-0}" -gt "$3" ]; then echo "row $1: no time left in this job"; exit 4; fi
CMD=$(python3 -c "import json; print(json.load(open('$P'))['command'])")
echo "$(date -u +%H:%M:%S) row $1: $CMD (load $(cut -d' ' -f1-3 /proc/loadavg))"
timeout "$2" /work/wt/run $CMD; rc=$?
echo "$(date -u +%H:%M:%S) row $1 rc=$rc (load $(cut -d' ' -f1-3 /proc/loadavg))"
