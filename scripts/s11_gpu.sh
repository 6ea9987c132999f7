#!/usr/bin/env bash
# Eleventh session's measurement of the tree on `nvidia-h200-x2` (two H200s of one host): the GPU
# suite on GPU 1, pinned to CPUs 16-31, while GPU 0 (CPUs 0-15) runs the bench, the step profile
# and the replayed-step ablation of the LM head's config (`light` = the tree, `tmak128` = the TMA
# head's config before this session). Every figure goes to a file under $OUT; log.txt says when
# each part ended. Usage: OUT=... [ABL="light tmak128"] [END=540] bash scripts/s11_gpu.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt; T0=$(date +%s)
note() { echo "$(( $(date +%s) - T0 ))s $*" >> "$LOG"; }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='%H %s' 2>/dev/null || true; } > "$OUT/env.txt" 2>&1
( CUDA_VISIBLE_DEVICES=1 timeout $(( ${END:-540} - 10 )) taskset -c 16-31 \
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
  note "pytest rc=$?" ) &
SUITE=$!
export CUDA_VISIBLE_DEVICES=0
P="taskset -c 0-15"
$P python3 -m trtgraph bench --config examples/llama-3.2-1b-synthetic.yaml --out /tmp/b --prompts 64 --no-hf \
  > "$OUT/bench.md" 2> "$OUT/bench.err"; note "bench rc=$?"
cp /tmp/b/bench.json "$OUT/" 2>/dev/null
$P python3 scripts/profile_step.py /tmp/b/artifacts 25 > "$OUT/profile.txt" 2>&1; note "profile rc=$?"
$P python3 scripts/decode_ablation.py "$OUT/ablation.json" examples/llama-3.2-1b-synthetic.yaml ${ABL:-light tmak128} \
  --batches ${ABL_BATCHES:-1,32,40,64} > "$OUT/ablation.txt" 2>&1; note "ablation rc=$?"
wait $SUITE
tail -3 "$OUT/pytest_gpu.log" >> "$LOG"
