#!/bin/bash
# Predict every planned row from the held-out profile $1 and commit the predictions (only those
# paths) before any of their runs starts. Run from the worktree root.
set -u
PROF=$1
EX=/work/shared/traces/multi_session_example.csv
LG=/work/shared/traces/multi_session_large.csv
V="/work/wt/run agentkv simulate validate --calibration $PROF --predict"
$V example_tight9_load --trace $EX --num-blocks 9 || exit 1
$V example_roomy24 --trace $EX --num-blocks 24 || exit 1
$V large16_tight40 --trace $LG --token-scale 0.25 --time-scale 1 --sessions 16 --num-blocks 40 || exit 1
$V large16_roomy192 --trace $LG --token-scale 0.25 --time-scale 1 --sessions 16 --num-blocks 192 || exit 1
$V bench_tight128 --num-blocks 128 || exit 1
$V bench_roomy512 --num-blocks 512 || exit 1
P=bench/results/predictions
FILES="$PROF $P/example_tight9_load.json $P/example_roomy24.json $P/large16_tight40.json $P/large16_roomy192.json $P/bench_tight128.json $P/bench_roomy512.json"
for i in 1 2 3 4 5; do
  git add -f $FILES && git commit -q -m "predictions example_tight9_load, example_roomy24, large16_tight40, large16_roomy192, bench_tight128, bench_roomy512 from the held-out profile $PROF (calibrate --load, measured just before; no row run yet), committed before their runs" -- $FILES && break
  sleep 3
done
git log --oneline -1
