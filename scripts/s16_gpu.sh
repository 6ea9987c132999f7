#!/usr/bin/env bash
# The sixteenth session's device calls (issue 12: the GEMM backends chosen by time at capture). Every
# figure goes to a file under $OUT. Usage: OUT=... CALL=N bash scripts/s16_gpu.sh
#  1 (one H200): the choice's GPU tests; the stdlib model (fp32) at 64 rows / 512 tokens profiled at 1-32
#    rows with the choice off (--margin 0: cuBLAS wherever allowed, the tree before) and on; the stdlib
#    example and the 1B example captured (their backends and times logged; inspect), the 1B's 256 greedy
#    prompts replayed and --eager, compared; spec_bench at batch 4 and 8 (the stdlib model's plain
#    steps of 8 rows were cuBLAS's slow fp32 tiles before). Ran with the first form of the timing (CUDA
#    events around eager calls: the host's launch cost, not the kernels), which picked cuBLAS everywhere.
#  2 (one H200): the same choice timed as replayed graphs: its GPU tests, the stdlib profiles (margin 0 /
#    0.8), the stdlib example captured (backends, times, inspect), the 1B's GEMM row times at 1-64 rows.
#    (Picked by the sums over the row counts: bs 8-16 faster, bs 1 slower on the stdlib model.)
#  3 (one H200): the choice per row count without `deterministic`: its GPU tests, the stdlib profiles,
#    the stdlib example captured, spec_bench at batch 4 and 8.
#  4 (nvidia-h200-x2): the tree's figures (timing now cycles weight copies past twice the L2):
#    `pytest -m gpu` on GPU 1 while GPU 0 runs the bench, the step profile, decode_ablation `light`, the
#    1B example captured (its GEMM record and times), 256 greedy prompts replayed and --eager; then
#    on GPU 0 the stdlib profiles and spec_bench at batch 4 and 8.
#  5 (one H200): after call 4's one failure (test_gpu.py's out-of-memory capture: the timing ran out of
#    the capped memory first, and a new stream per timing made cuBLAS a workspace inside each graph's
#    pool): the choice's GPU tests and test_gpu.py; the stdlib example captured (backends, inspect).
#  6 (one H200): Triton timed only where cuBLAS is slower than at more rows, fewer calls a graph for long
#    calls (call 4's 1B capture spent 14.7 s in kv_cache_and_buffers against 0.1-0.2 before the timing): the
#    choice's GPU tests and test_gpu.py's out-of-memory capture; the stdlib profiles; the 1B example
#    captured twice (its phases, record and times).
#  7 (one H200, after merging h/s16-spec): the 1B example captured (phases: the timing's inputs drawn on
#    the device now), spec_bench at batch 4 and 8 with the probes table.
#  8 (one H200, after the review: no timing with `deterministic`, a start loads the Triton kernels its record
#    runs, the split gated on cuBLAS at each row of its band): tests/test_linear_choice.py -m gpu (the timer's
#    calibration, a stdlib capture with a timed record started in a fresh process).
source "$(dirname "$0")/gpu_lib.sh"
backends() {  # backends MANIFEST: the record and the times to the log
  python3 -c "import json, sys; t = json.load(open(sys.argv[1]))['totals']; print(t.get('linear_backends'), t.get('linear_times_us'))" "$1" >> "$LOG" 2>&1
}
choice_tests() {
   timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_linear_choice.py > "$OUT/pytest_choice.log" 2>&1
   note "pytest choice rc=$?"; tail -2 "$OUT/pytest_choice.log" >> "$LOG"
}
stdlib_profiles() {  # the stdlib model at 64 rows / 512 tokens, 1-32 rows, the choice off (margin 0) and on
   sed -e 's/max_batch_size: 4, max_num_tokens: 256/max_batch_size: 64, max_num_tokens: 256, max_seq_len: 512/' \
       -e 's#path: ../trtgraph#path: '"$PWD"'/trtgraph#' examples/stdlib-llama.yaml > /tmp/p.yaml
   for m in 0 0.8; do
     timeout 120 python3 scripts/profile_step.py /tmp/p.yaml 8 --batches 1,4,8,12,16,24,32 --margin $m \
       > "$OUT/profile_std_m$m.txt" 2>&1; note "profile margin $m rc=$?"
     grep -h "gemm\|kernel time" "$OUT/profile_std_m$m.txt" | head -20 >> "$LOG"
   done
}
capture_std() {
   timeout 200 python3 -m trtgraph capture --config examples/stdlib-llama.yaml --out /tmp/std > "$OUT/capture_std.txt" 2>&1
   note "capture stdlib rc=$?"; backends /tmp/std/manifest.json
   python3 -m trtgraph inspect /tmp/std/manifest.json > "$OUT/inspect_std.txt" 2>&1; head -12 "$OUT/inspect_std.txt" >> "$LOG"
}
spec() {
   timeout 400 python3 scripts/spec_bench.py "$OUT/spec" --batches 4,8 --sets ${SETS:-copy,code-like,random,repetitive} \
     --repeats 3 > "$OUT/spec.txt" 2>&1; note "spec rc=$?"; tail -12 "$OUT/spec.txt" >> "$LOG"; rm -rf "$OUT/spec"
}
case ${CALL:?CALL=1..} in
8) timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/test_linear_choice.py > "$OUT/pytest_choice.log" 2>&1
   note "pytest rc=$?"; grep -h "^record\|passed\|failed\|Error" "$OUT/pytest_choice.log" | tail -8 >> "$LOG" ;;
7) timeout 120 python3 -m trtgraph capture --config $CFG --out /tmp/art > "$OUT/capture_1b.txt" 2>&1
   note "capture 1b rc=$? $(tail -1 "$OUT/capture_1b.txt")"; backends /tmp/art/manifest.json
   timeout 170 python3 scripts/spec_bench.py "$OUT/spec" --batches 4,8 --sets copy,code-like,random,repetitive \
     --repeats 3 > "$OUT/spec.txt" 2>&1; note "spec rc=$?"; tail -30 "$OUT/spec.txt" >> "$LOG"; rm -rf "$OUT/spec" ;;
6) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_linear_choice.py \
     tests/test_gpu.py -k "choice or timing or out_of_memory" > "$OUT/pytest_choice.log" 2>&1
   note "pytest rc=$?"; tail -2 "$OUT/pytest_choice.log" >> "$LOG"
   stdlib_profiles
   for i in 1 2; do
     timeout 200 python3 -m trtgraph capture --config $CFG --out /tmp/art$i > "$OUT/capture_1b_$i.txt" 2>&1
     note "capture 1b rc=$? $(tail -1 "$OUT/capture_1b_$i.txt")"; backends /tmp/art$i/manifest.json
   done ;;
5) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_linear_choice.py tests/test_gpu.py \
     > "$OUT/pytest_choice.log" 2>&1; note "pytest rc=$?"; tail -3 "$OUT/pytest_choice.log" >> "$LOG"
   capture_std ;;
4) tree_figures light --batches 1,8,17,32,64; backends /tmp/art/manifest.json
   stdlib_profiles; spec ;;
3) choice_tests; stdlib_profiles; capture_std; spec ;;
2) choice_tests; stdlib_profiles; capture_std
   timeout 200 python3 scripts/profile_step.py $CFG 8 --batches 1,8,17,32,64 > "$OUT/profile_1b.txt" 2>&1
   note "profile 1b rc=$?"; grep -h "gemm\|kernel time" "$OUT/profile_1b.txt" >> "$LOG" ;;
1) choice_tests; stdlib_profiles; capture_std
   parity256; backends /tmp/art/manifest.json; cat "$OUT/compare.txt" >> "$LOG"
   spec ;;
esac
note done
