#!/usr/bin/env bash
# The fifteenth session's device calls (issue 12: the 17-64-row step). Every figure goes to a file under
# $OUT. Usage: OUT=... CALL=N bash scripts/s15_gpu.sh
#  1 (one H200): scripts/cublaslt_probe.py (torch's GEMM against cuBLASLt's other algorithms and split-K
#    counts for qkv, o + residual and the down projection's partials at 17-64 rows), then
#    decode_ablation's attention configs at 17-32 and 64 rows (a64w2f2, a128w2f2, a128w4f2, a128w4f1).
source "$(dirname "$0")/gpu_lib.sh"
case ${CALL:?CALL=1..} in
1) timeout 200 python3 scripts/cublaslt_probe.py "$OUT/lt.json" --rows ${ROWS:-17,24,32,48,64} > "$OUT/lt.txt" 2>&1
   note "lt rc=$?"; cat "$OUT/lt.txt" >> "$LOG"
   ablation attn light a64w2f2 a128w2f2 a128w4f2 a128w4f1 --batches 17,24,32,64 ;;
esac
note done
