#!/bin/bash
# Run row $1's printed command (from its committed prediction) with a timeout of $2 seconds;
# refuse if the prediction is not committed.
set -u
P=bench/results/predictions/$1.json
git log --format=%h -1 -- "$P" | grep -q . || { echo "row $1: prediction not committed, not run"; exit 3; }
CMD=$(python3 -c "import json,sys; print(json.load(open('$P'))['command'])")
echo "$(date -u +%H:%M:%S) row $1: $CMD (load $(cut -d' ' -f1-3 /proc/loadavg))"
timeout "$2" /work/wt/run $CMD; rc=$?
echo "$(date -u +%H:%M:%S) row $1 rc=$rc (load $(cut -d' ' -f1-3 /proc/loadavg))"
