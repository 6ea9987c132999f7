#!/usr/bin/env bash
# The twentieth session's device calls. Every figure goes to a file under $OUT.
# Usage: OUT=... CALL=N bash scripts/s20_gpu.sh
#  1 (one H200, the landing tree): `pytest -m gpu tests/` (the landing tree of the merges)
#  2 (one H200, the landing tree): the bench (decode bs 1-64 against the floor, prefill, run, mixed), the step
#    profile, 256 greedy prompts captured, replayed and --eager.
source "$(dirname "$0")/gpu_lib.sh"
case ${CALL:?CALL=1..} in
1) { nvidia-smi --query-gpu=name,driver_version --format=csv
     python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >> "$LOG" 2>&1
   timeout ${END:-520} python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
   note "pytest rc=$?"; tail -6 "$OUT/pytest_gpu.log" >> "$LOG" ;;
2) bench; grep -h "^| *[0-9]* |\|bandwidth\|tokens/s" "$OUT/bench.md" | head -24 >> "$LOG"
   timeout 90 python3 scripts/profile_step.py /tmp/b/artifacts 25 > "$OUT/profile.txt" 2>&1; note "profile rc=$?"
   grep -h "kernels\|kernel time" "$OUT/profile.txt" | head -8 >> "$LOG"
   parity256; tail -3 "$OUT/compare.txt" >> "$LOG" ;;
esac
