#!/usr/bin/env bash
# The eighteenth session's device calls. Every figure goes to a file under $OUT.
# Usage: OUT=... CALL=N bash scripts/s18_gpu.sh
#  1 (one H200): scripts/timer_state_probe.py once per capture timer (graph: the tree's; off; sleep; nowarm;
#    graph again): does capture's GEMM timing put the process in the slow-launch state? (It does: `graph` 1.100 /
#    1.097 ms at bs 64, canary 84.6 -> 102.6 us; off / sleep / nowarm 1.057-1.060, canary unmoved.)
#  2 (one H200, the fix: the timer's warm-up on the current stream): the new GPU test of the launch state, and its
#    snippet with the timer before patched in (it must fail there); tests/test_linear_choice.py -m gpu; the probe
#    with the tree's timer and the one before; the bench and the step profile.
#  3 (one H200, the landing tree): `pytest -m gpu tests/`; 256 greedy prompts captured, replayed and --eager.
#  4 (one H200, the landing tree): the bench again (the spread of call 2's figures), the ablation's `light` at
#    bs 1, 40 and 64 (each variant captured afresh in one process, forwards then backwards).
#  5 (one H200): tests/test_cuda_graph.py -m gpu (the launch-state checks moved there, and one over a whole
#    capture), and that capture's check with the timer before patched in (it must fail there).
source "$(dirname "$0")/gpu_lib.sh"
probe() {  # probe TIMER [NAME]
  TIMER=$1 timeout ${PROBE_T:-150} python3 scripts/timer_state_probe.py $CFG > "$OUT/state_${2:-$1}.txt" 2>&1
  note "probe ${2:-$1} rc=$?"; grep -v "^  [0-9]*x[0-9]*:\|backends" "$OUT/state_${2:-$1}.txt" | tail -6 >> "$LOG"
}
old_capture() {  # test_cuda_graph's whole-capture check with the timer before patched into the executor
  python3 - >> "$LOG" 2>&1 <<'PY'
import sys
sys.path.insert(0, "scripts"); sys.path.insert(0, "tests")
from functools import partial
import timer_state_probe as p
import trtgraph.runtime.step.executor as ex
ex.linear_timer = lambda device: partial(p.side_time_us, device=device)
import test_cuda_graph as t
sys.argv = ["-", "/tmp/oldcap"]
exec(t._CANARY + t._CAPTURE)
PY
  note "old timer capture rc=$? (canary before, after: above)"
}
old_state() {  # the GPU test's snippet with the timer before (timer_state_probe.side_time_us) patched in
  python3 - >> "$LOG" 2>&1 <<'PY'
import ast, sys
sys.path.insert(0, "scripts")
import timer_state_probe as p
import trtgraph.runtime.step.cuda_graph as cg
cg.graph_time_us = p.side_time_us
src = open("tests/test_linear_choice.py").read()
snippet = ast.literal_eval(src.split("_LAUNCH_STATE = ", 1)[1].split('\n"""\n', 1)[0] + '\n"""')
exec(snippet)
PY
  note "old timer state rc=$? (canary before, after: above)"
}
case ${CALL:?CALL=1..} in
6) bench; grep -h "^| *[0-9]* |\|bandwidth\|tokens/s" "$OUT/bench.md" | head -20 >> "$LOG"
   timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
   note "pytest rc=$?"; tail -4 "$OUT/pytest_gpu.log" >> "$LOG" ;;
5) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_graph.py > "$OUT/pytest_graph.log" 2>&1
   note "pytest cuda_graph rc=$?"; tail -3 "$OUT/pytest_graph.log" >> "$LOG"
   old_capture ;;
4) bench; grep -h "^| *[0-9]* |\|bandwidth" "$OUT/bench.md" | head -14 >> "$LOG"
   ablation abl light light --batches 1,40,64 ;;
3) timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
   note "pytest rc=$?"; tail -4 "$OUT/pytest_gpu.log" >> "$LOG"
   parity256; tail -3 "$OUT/compare.txt" >> "$LOG" ;;
2) timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_linear_choice.py > "$OUT/pytest_choice.log" 2>&1
   note "pytest linear_choice rc=$?"; tail -3 "$OUT/pytest_choice.log" >> "$LOG"
   old_state
   probe graph; probe side
   bench; grep -h "^| *64 \|^| *1 \|^| *8 \|^| *32 \|floor\|bandwidth" "$OUT/bench.md" | head -14 >> "$LOG"
   timeout 90 python3 scripts/profile_step.py /tmp/b/artifacts 25 > "$OUT/profile.txt" 2>&1; note "profile rc=$?"
   grep -h "kernels\|kernel time" "$OUT/profile.txt" | head -8 >> "$LOG" ;;
1) nvidia-smi --query-gpu=name,driver_version --format=csv >> "$LOG" 2>&1
   probe graph; probe off; probe sleep; probe nowarm; probe graph graph2 ;;
esac
