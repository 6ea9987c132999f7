# The device calls' shared steps (sourced by scripts/s14_gpu.sh, s15_gpu.sh): the environment, the log,
# an ablation table, the GPU suite beside the bench, the 256-prompt replay vs --eager parity.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt; T0=$(date +%s)
note() { echo "$(( $(date +%s) - T0 ))s $*" >> "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
CFG=examples/llama-3.2-1b-synthetic.yaml
P="taskset -c 0-15"  # the steps beside the suite (GPU 0); the suite on GPU 1, CPUs 16-31
ablation() {  # ablation NAME VARIANTS... --batches B: the table to $OUT/NAME.txt and the log (TASKSET: a CPU pin)
  local name=$1; shift
  ${TASKSET:-} timeout 300 python3 scripts/decode_ablation.py "$OUT/$name.json" $CFG "$@" > "$OUT/$name.txt" 2>&1
  note "$name rc=$?"; grep -h "#" "$OUT/$name.txt" >> "$LOG"
}
layouts() {  # layouts VARIANTS...: the shipped KV layout against head-major pages, two processes each
  for i in 1 2; do for lay in row head; do
    KV_LAYOUT=$lay timeout 100 python3 scripts/decode_ablation.py "$OUT/layout_$lay$i.json" $CFG "$@" \
      --batches 40,64 > "$OUT/layout_$lay$i.txt" 2>&1
    note "layout $lay $i rc=$?"; grep -h "#" "$OUT/layout_$lay$i.txt" | sed "s/^/$lay$i /" >> "$LOG"
  done; done
}
suite() {  # the GPU suite on GPU 1 in the background ($SUITE), beside what runs on GPU 0
  ( CUDA_VISIBLE_DEVICES=1 timeout ${END:-560} taskset -c 16-31 \
      python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
    note "pytest rc=$?" ) &
  SUITE=$!
}
bench() {
  $P python3 -m trtgraph bench --config $CFG --prompts 64 --no-hf --out /tmp/b > "$OUT/bench.md" 2>> "$LOG"
  note "bench rc=$?"
}
parity256() {  # the example captured (its fused_ops logged), 256 greedy prompts replayed and --eager, compared
  $P python3 -m trtgraph capture --config $CFG --out /tmp/art > /tmp/capture.txt 2>&1
  note "capture rc=$? $(tail -1 /tmp/capture.txt)"
  python3 -c "import json; print(json.load(open('/tmp/art/manifest.json'))['totals']['fused_ops'])" >> "$LOG" 2>&1
  python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/p256.jsonl
  for m in replay eager; do
    $P python3 -m trtgraph run --prompts /tmp/p256.jsonl --manifest /tmp/art --output /tmp/$m.jsonl \
      --summary-json /tmp/run_$m.json $([ $m = eager ] && echo --eager) > /tmp/run_$m.txt 2>&1; note "run $m rc=$?"
  done
  python3 scripts/compare_outputs.py /tmp/replay.jsonl /tmp/eager.jsonl > "$OUT/compare.txt" 2>&1; note "compare rc=$?"
  cat /tmp/run_replay.json >> "$OUT/compare.txt" 2>/dev/null
}
tree_figures() {  # tree_figures ABLATION_VARIANTS... --batches B (calls 7 and 12)
  { nvidia-smi --query-gpu=index,name,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >> "$LOG" 2>&1
  suite
  export CUDA_VISIBLE_DEVICES=0
  bench
  $P timeout 90 python3 scripts/profile_step.py /tmp/b/artifacts 25 > "$OUT/profile.txt" 2>&1; note "profile rc=$?"
  TASKSET="$P" ablation abl "$@"
  parity256
  wait $SUITE
  tail -3 "$OUT/pytest_gpu.log" >> "$LOG"
}
