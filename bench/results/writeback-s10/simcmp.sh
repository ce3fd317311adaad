set -e
A=.venv/bin/agentkv
echo "== fleet 300x20 r8 256 blocks"
$A simulate -n 300 -t 20 --time-scale 1 --rate 0.05 -r 8 --num-blocks 256 --host-capacity-gib 16 --policy agentkv 2>/dev/null | grep -E "TTFT p99|resume TTFT p50|hit rate, resume|write-backs|tokens recomputed"
echo "== large16 128"
$A simulate --trace ../shared/traces/multi_session_large.csv --sessions 16 --token-scale 0.25 --time-scale 1 --num-blocks 128 -r 1 --policy agentkv 2>/dev/null | grep -E "TTFT p99|resume TTFT p50|hit rate, resume|write-backs|tokens recomputed"
for nb in 48 24; do echo "== large16 $nb"
$A simulate --trace ../shared/traces/multi_session_large.csv --sessions 16 --token-scale 0.25 --time-scale 1 --num-blocks $nb -r 1 --policy agentkv 2>/dev/null | grep -E "TTFT p99|resume TTFT p50|hit rate, resume|write-backs|tokens recomputed"; done
echo "== full large trace 128"
$A simulate --trace ../shared/traces/multi_session_large.csv --token-scale 0.25 --time-scale 1 --num-blocks 128 -r 1 --policy agentkv 2>/dev/null | grep -E "TTFT p99|resume TTFT p50|hit rate, resume|write-backs|tokens recomputed"
