#!/usr/bin/env bash
# One device call: GPU tests, then `trtgraph bench` on the Llama-3.2-1B-shaped example
# (capture, decode vs floor, attention alone, transformers baseline, run), then the
# 256-prompt run replayed and --eager with a token-for-token comparison. Results in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=/tmp/bench; ART=$B/artifacts
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/run.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -m gpu -q -s -p no:cacheprovider ${GPU_TESTS:-tests/} > "$OUT/pytest_gpu.log" 2>&1
  tail -4 "$OUT/pytest_gpu.log"; grep -E "bf16 max|FAILED|Error" "$OUT/pytest_gpu.log" | head -20
fi
python3 -m trtgraph bench --config ${CONFIG:-examples/llama-3.2-1b-synthetic.yaml} --out $B ${BENCH_ARGS:-} > "$OUT/bench_stdout.md" 2> "$OUT/bench_stderr.log"
echo "bench rc=$?"; tail -5 "$OUT/bench_stderr.log"
cp $B/bench.json $B/bench.png "$OUT/" 2>/dev/null; cp $ART/manifest.json "$OUT/manifest.json"
head -30 "$OUT/bench_stdout.md"
if [ "${SKIP_RUN:-0}" != 1 ]; then
  python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/p256.jsonl
  python3 -m trtgraph run --prompts /tmp/p256.jsonl --manifest $ART --output /tmp/replay.jsonl --summary-json /tmp/run_replay.json 2>&1 | tail -6
  python3 -m trtgraph run --prompts /tmp/p256.jsonl --manifest $ART --output /tmp/eager.jsonl --eager --summary-json /tmp/run_eager.json 2>&1 | tail -6
  { python3 scripts/compare_outputs.py /tmp/replay.jsonl /tmp/eager.jsonl; cat /tmp/run_replay.json /tmp/run_eager.json; } >> "$OUT/run.txt"
  tail -40 "$OUT/run.txt" | head -14
fi
python3 scripts/profile_step.py $ART > "$OUT/profile.txt" 2>&1; head -60 "$OUT/profile.txt"
if [ "${SKIP_SPEC:-0}" != 1 ]; then
  python3 scripts/spec_bench.py /tmp/specout > /tmp/spec.log 2>&1; echo "spec rc=$?"; tail -8 /tmp/spec.log
  cat /tmp/spec.log >> "$OUT/profile.txt"
fi
