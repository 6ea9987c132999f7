#!/usr/bin/env bash
# The eighteenth session's device calls. Every figure goes to a file under $OUT.
# Usage: OUT=... CALL=N bash scripts/s18_gpu.sh
#  1 (one H200): scripts/timer_state_probe.py once per capture timer (graph: the tree's; off; sleep; nowarm;
#    graph again): does capture's GEMM timing put the process in the slow-launch state?
source "$(dirname "$0")/gpu_lib.sh"
probe() {  # probe TIMER [NAME]
  TIMER=$1 timeout ${PROBE_T:-150} python3 scripts/timer_state_probe.py $CFG > "$OUT/state_${2:-$1}.txt" 2>&1
  note "probe ${2:-$1} rc=$?"; grep -v "^  [0-9]*x[0-9]*:\|backends" "$OUT/state_${2:-$1}.txt" | tail -6 >> "$LOG"
}
case ${CALL:?CALL=1..} in
1) nvidia-smi --query-gpu=name,driver_version --format=csv >> "$LOG" 2>&1
   probe graph; probe off; probe sleep; probe nowarm; probe graph graph2 ;;
esac
