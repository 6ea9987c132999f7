#!/usr/bin/env bash
# The fifteenth session's device calls (issue 12: the 17-64-row step). Every figure goes to a file under
# $OUT. Usage: OUT=... CALL=N bash scripts/s15_gpu.sh
#  1 (one H200): scripts/cublaslt_probe.py (torch's GEMM against cuBLASLt's other algorithms and split-K
#    counts for qkv, o + residual and the down projection's partials at 17-64 rows), then
#    decode_ablation's attention configs at 17-32 and 64 rows (a64w2f2, a128w2f2, a128w4f2, a128w4f1).
#  2 (one H200, branch h/lead15-probes: its kernels/l2_prefetch.py and decode_ablation variants, not merged):
#    L2 prefetch on a side branch of the step (decode rows' K / V pages beside the qkv GEMM: kvpf8,
#    kvpf16; the o weight beside attention: opf) and gate_up PDL-launched after the cuBLAS o (pdl-gu64).
#  3 (nvidia-h200-x2): the tree's figures: `pytest -m gpu` on GPU 1 while GPU 0 runs the bench, the step
#    profile, decode_ablation light / f0-17 (attention without the fold at 17-32 rows: the tree before)
#    and the example captured, 256 greedy prompts replayed and --eager, compared token for token.
#  4 (one H200): scripts/spec_bench.py at batch 4 (verify steps of 20 tokens) and 8, every prompt set (the first
#    attempt named a set `code`, which does not exist: only `copy` ran).
#  5 (one H200, twice, branch h/lead15-pf: its kernels/l2_prefetch.py and decode_ablation variants, not
#    merged): L2 prefetch by extra programs of latency-bound kernels at 17-64 rows (attention's of the o
#    weight, the sum kernel's of the next layer's K / V pages and qkv weight), first each from 1-2
#    programs, then spread over about 128. Calls ran in the order 1, 2, 4, 4, 3, 5, 5.
source "$(dirname "$0")/gpu_lib.sh"
case ${CALL:?CALL=1..} in
1) timeout 200 python3 scripts/cublaslt_probe.py "$OUT/lt.json" --rows ${ROWS:-17,24,32,48,64} > "$OUT/lt.txt" 2>&1
   note "lt rc=$?"; cat "$OUT/lt.txt" >> "$LOG"
   ablation attn light a64w2f2 a128w2f2 a128w4f2 a128w4f1 --batches 17,24,32,64 ;;
3) tree_figures light f0-17 --batches 1,8,17,24,32,40,64 ;;
4) timeout 560 python3 scripts/spec_bench.py "$OUT/spec" --batches 4,8 --sets ${SETS:-copy,code-like,random,repetitive} --repeats 3 \
     > "$OUT/spec.txt" 2>&1; note "spec rc=$?"; tail -8 "$OUT/spec.txt" >> "$LOG" ;;
esac
note done
