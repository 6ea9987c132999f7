#!/usr/bin/env bash
# The seventeenth session's device calls. Every figure goes to a file under $OUT.
# Usage: OUT=... CALL=N bash scripts/s17_gpu.sh
#  1 (one H200, at efb5e3a's tree): the GEMM choice's GPU tests that the sixteenth session could not run
#    (tests/test_linear_choice.py -m gpu: the timer's calibration, a capture with a timed record started in
#    a fresh process); spec_bench at batch 8 with the policy as shipped and with PROBE_SHARE / HOPE_LIMIT
#    changed (the A/B the sixteenth session left), the shipped policy last again (the machine's drift);
#    then `pytest -m gpu` for the time left.
#  2 (one H200, after merging h/s17-spec: the probe budget): spec_bench at batch 1, 4, 8 and 64 with the budget
#    off (PROBE_BUDGET=0: the policy before) and on, twice each, alternating; the GPU tests of speculation ==
#    plain; the bench and the step profile (the tree's figures).
#  3 (one H200, after pricing an unmeasured verify key's host work with a per-step part, HOST_STEP_ROWS): spec_bench
#    at batch 1, 4, 8 and 64 with it, with HOST_STEP_ROWS=0 (the pricing before: by the rows), with it again;
#    the GPU test of speculation == plain.
#  4 (one H200, at call 3's tree): batch 64 alone, 9 paired runs a set (its cells are 0.2-0.5 s runs whose plain
#    tokens/s moved by up to 1.5x between processes in calls 2-3), twice; batch 8, 5 paired runs.
#  5 (one H200, the landing tree: the review's debt bound and the price above the largest measured verify key):
#    spec_bench at batch 1, 4, 8 and 64; the GPU test of speculation == plain; scripts/pdl_edge_probe.py (do
#    cuBLAS's kernels wait behind a programmatic graph edge, and what does one save).
#  6 (one H200, the landing tree): batch 64 alone, 9 paired runs a set, twice (call 5's 3-pair cells were 0.96-0.98).
#  7 (one H200): pdl_edge_probe.py again with the row op triggering at its start behind programmatic edges.
#  8, 9 (one H200): ran on branch h/s17-pdledge (not merged: its script has them): programmatic edges into cuBLAS's
#    kernels in the real step (decode_ablation `pdl-cublas`, then one cuBLAS kernel's edges at a time).
source "$(dirname "$0")/gpu_lib.sh"
spec_ab() {  # spec_ab NAME [--policy ...]: batch 8, four sets, 3 repeats, the plan captured once
  local name=$1; shift
  rm -f /tmp/spec/spec_bench.json; local reuse=""; [ -d /tmp/spec/artifacts ] && reuse="--artifacts /tmp/spec/artifacts"
  timeout ${SPEC_T:-110} python3 scripts/spec_bench.py /tmp/spec $reuse --batches ${SPEC_B:-8} \
    --sets copy,code-like,random,repetitive --repeats ${SPEC_R:-3} "$@" > "/tmp/spec_$name.txt" 2>&1
  note "spec $name rc=$?"; cp /tmp/spec/spec_bench.json "$OUT/spec_$name.json" 2>/dev/null
  python3 - "$OUT/spec_$name.json" >> "$LOG" 2>&1 <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["cells"]:
    print(f"  {c['prompts']:>10} b{c['batch']}: ratio {c['ratio_median']:.3f} ({c['ratio_min']:.3f}-{c['ratio_max']:.3f}) "
          f"probes {c['probes']} hope {c['hope_probes']} share {c['probe_share']:.4f} verify {c['verify_steps']}")
PY
}
case ${CALL:?CALL=1..} in
7) timeout 150 python3 scripts/pdl_edge_probe.py > "$OUT/pdl_probe.txt" 2>&1; note "pdl probe rc=$?"
   tail -12 "$OUT/pdl_probe.txt" >> "$LOG" ;;
6) export SPEC_T=150; SPEC_B=64 SPEC_R=9 spec_ab b64; SPEC_B=64 SPEC_R=9 spec_ab b64b ;;
5) SPEC_B=1,4,8,64 SPEC_T=150 spec_ab final
   timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_capture_pipeline.py > /tmp/pytest_spec.log 2>&1
   note "pytest spec rc=$?"; tail -1 /tmp/pytest_spec.log >> "$LOG"
   timeout 150 python3 scripts/pdl_edge_probe.py > "$OUT/pdl_probe.txt" 2>&1; note "pdl probe rc=$?"
   tail -12 "$OUT/pdl_probe.txt" >> "$LOG" ;;
4) export SPEC_T=150
   SPEC_B=64 SPEC_R=9 spec_ab b64; SPEC_B=8 SPEC_R=5 spec_ab b8; SPEC_B=64 SPEC_R=9 spec_ab b64b ;;
3) export SPEC_B=1,4,8,64 SPEC_T=140
   spec_ab c16 ; spec_ab c0 --policy HOST_STEP_ROWS=0; spec_ab c16b
   timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_capture_pipeline.py > /tmp/pytest_spec.log 2>&1
   note "pytest spec rc=$?"; tail -1 /tmp/pytest_spec.log >> "$LOG" ;;
2) export SPEC_B=1,4,8,64 SPEC_T=140
   spec_ab off --policy PROBE_BUDGET=0; spec_ab on; spec_ab off2 --policy PROBE_BUDGET=0; spec_ab on2
   timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_capture_pipeline.py > /tmp/pytest_spec.log 2>&1
   note "pytest spec rc=$?"; tail -1 /tmp/pytest_spec.log >> "$LOG"
   bench; grep -h "^| *64 \|^| *1 \|floor\|bandwidth" "$OUT/bench.md" | head -12 >> "$LOG"
   timeout 90 python3 scripts/profile_step.py /tmp/b/artifacts 25 > "$OUT/profile.txt" 2>&1; note "profile rc=$?"
   grep -h "kernels\|kernel time" "$OUT/profile.txt" | head -8 >> "$LOG" ;;
1) timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/test_linear_choice.py > "$OUT/pytest_choice.log" 2>&1
   note "pytest choice rc=$?"; grep -h "^record\|passed\|failed\|Error" "$OUT/pytest_choice.log" | tail -8 >> "$LOG"
   spec_ab base
   spec_ab share4 --policy PROBE_SHARE=0.004
   spec_ab hope1 --policy HOPE_LIMIT=1
   spec_ab base2
   left=$(( 585 - ($(date +%s) - T0) )); note "suite with ${left}s"
   timeout $left python3 -m pytest -m gpu -q -p no:cacheprovider tests/ --deselect tests/test_linear_choice.py \
     > "$OUT/pytest_gpu.log" 2>&1; note "pytest rc=$?"; tail -3 "$OUT/pytest_gpu.log" >> "$LOG" ;;
esac
note done
