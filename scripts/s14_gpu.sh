#!/usr/bin/env bash
# The fourteenth session's device calls (issue 12: the 33-64-row step's remaining boundaries and small
# kernels). Every figure goes to a file under $OUT. Usage: OUT=... CALL=N bash scripts/s14_gpu.sh
# Calls 1-6 ran on branch h/lead14-probes (its decode_ablation.py variants and kernel knobs, not merged;
# call 6 also scripts/norm_scale_check.py there); calls 7-12 run this tree. The calls ran this script's
# steps written out one by one; the helpers below hold the same commands (shared after the fact, not
# run on the GPU in this form; each ablation's table now also kept as a file).
#  1 (one H200): scripts/decode_ablation.py at bs 40 / 64: light, pdlearly (the twelfth session's
#    probe), pfqkv[0|-b|-d], pfo, pfboth (scripts/decode_ablation.py's docstring says what each is);
#  2 (one H200): the split down projection's sum kernel PDL-launched / on 8 or 2 warps (sumpdl, sumw8,
#    sumw2, sumpdl-w8); then `light` with the KV cache's pages head-major (KV_LAYOUT=head) against the
#    shipped layout, two processes each, alternating (the head-major run failed: the KV write assumed
#    slot = block * page + offset in the flat stride);
#  3 (one H200): call 2 again with the write fixed (at bs 40 / 64: light, sumw8), and the sum kernel on
#    16 warps (sumw16, sumpdl-w16) (the head-major run failed again: attention's launch asserted a
#    contiguous cache);
#  4 (one H200): the sum kernel on 16 / 32 warps, with 2 / 8 K slices; the layout A/B with the
#    assertion relaxed to unit-stride head_dim (light, sumw16);
#  5 (one H200): the row kernels on triton_ops.row_warps (16 at 2,048: `light`) against the sum kernel
#    on 4 (sumw4), and gate_up with its norm weight's multiply skipped (gufold: timing only, the
#    weight not folded); the step profile; the split / norm kernels' GPU tests;
#  6 (one H200): scripts/norm_scale_check.py (the norm weight's product in bf16 against fp32, bitwise),
#    then light / nsbf16 (that product in every fused GEMV) / gufold at bs 1, 8, 32, 40, 64;
#  7 (nvidia-h200-x2): the tree's figures: `pytest -m gpu` on GPU 1 (CPUs 16-31) while GPU 0 runs the
#    bench, the step profile, decode_ablation light / sumw4 (before) at bs 1-64, and the example
#    captured, 256 greedy prompts run replayed and --eager, compared token for token (the suite did not
#    run: tests/test_r13_resume.py imported `openai`, which the device lacks, at collection);
#  8 (nvidia-h200-x2): that import fixed, `pytest -m gpu` on GPU 1 while GPU 0 runs the bench again;
#  9 (one H200): the recording's GPU tests and tests/test_gpu.py's capture / replay / out-of-memory
#    tests after cuda_graph.py's two simplifications, and replay()'s host cost (replay_host_cost.py);
#  10 (one H200): the 33-64-row path from 17 / 25 rows (decode_ablation cut16, cut24) against `light`
#    at bs 17, 24, 32, now that path's sum kernel is faster;
#  11 (one H200): light / cut16 / cut16-head33 (the LM head on the fused GEMV up to 32 rows) / cut8 at
#    bs 16, 17, 24, 32;
#  12 (nvidia-h200-x2): the tree with the fused GEMVs' band at 16 rows: `pytest -m gpu` on GPU 1 while
#    GPU 0 runs the bench, the step profile, decode_ablation light / cut32 (the band before) at bs 17-64,
#    the example captured (its fused_ops: the split's band) and 256 prompts replayed vs --eager.
source "$(dirname "$0")/gpu_lib.sh"
case ${CALL:?CALL=1..} in
1) ablation ablation ${VARIANTS:-light pdlearly pfqkv pfqkv0 pfqkv-b pfqkv-d pfo pfboth} --batches 40,64 ;;
2) ablation sum light sumpdl sumw8 sumw2 sumpdl-w8 --batches 40,64; layouts light sumw8 ;;
3) ablation sum light sumw8 sumw16 sumpdl-w16 --batches 40,64; layouts light sumw8 ;;
4) ablation sum light sumw16 sumw32 split2-w16 split8-w16 --batches 40,64; layouts light sumw16 ;;
5) ablation abl light sumw4 gufold --batches 40,64
   timeout 240 python3 scripts/profile_step.py $CFG 25 > "$OUT/profile.txt" 2>&1; note "profile rc=$?"
   timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_split_residual.py tests/test_kernels.py \
     > "$OUT/pytest.txt" 2>&1; note "pytest rc=$? $(tail -1 "$OUT/pytest.txt")" ;;
6) timeout 120 python3 scripts/norm_scale_check.py > "$OUT/check.txt" 2>&1; note "check rc=$? $(tail -1 "$OUT/check.txt")"
   ablation abl light nsbf16 gufold --batches 1,8,32,40,64 ;;
7) tree_figures light sumw4 --batches 1,8,32,40,64 ;;
8) suite; CUDA_VISIBLE_DEVICES=0 bench; wait $SUITE; tail -3 "$OUT/pytest_gpu.log" >> "$LOG" ;;
9) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_gpu.py \
     -k "cuda_graph or capture_parity or replay_equals_eager or out_of_memory" > "$OUT/pytest.txt" 2>&1
   note "pytest rc=$? $(tail -1 "$OUT/pytest.txt")"
   timeout 60 python3 scripts/replay_host_cost.py >> "$LOG" 2>&1; note "host cost rc=$?" ;;
10) ablation cut light cut16 cut24 --batches 17,24,32 ;;
11) ablation cut light cut16 cut16-head33 cut8 --batches 16,17,24,32 ;;
12) tree_figures light cut32 --batches 17,24,32,40,64 ;;
esac
note done
