#!/usr/bin/env bash
# One device call: GPU tests, capture of the Llama-3.2-1B-shaped example, inspect, and the
# 256-prompt run (replay and --eager). Everything lands in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ART=/tmp/trtgraph-1b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
python3 -m pytest -m gpu -q -s -p no:cacheprovider ${GPU_TESTS:-tests/} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
/usr/bin/time -v python3 -m trtgraph capture --config examples/llama-3.2-1b-synthetic.yaml --out $ART --json 2> "$OUT/capture_stderr.log" | tee "$OUT/capture.json"
grep -E "Elapsed|Maximum resident" "$OUT/capture_stderr.log"; tail -3 "$OUT/capture_stderr.log"
python3 -m trtgraph inspect $ART | tee "$OUT/inspect.txt"
cp $ART/manifest.json "$OUT/manifest.json"
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/p256.jsonl
python3 -m trtgraph run --prompts /tmp/p256.jsonl --manifest $ART --output /tmp/replay.jsonl --summary-json "$OUT/run_replay.json" 2>&1 | tail -12
python3 -m trtgraph run --prompts /tmp/p256.jsonl --manifest $ART --output /tmp/eager.jsonl --eager --summary-json "$OUT/run_eager.json" 2>&1 | tail -12
python3 scripts/compare_outputs.py /tmp/replay.jsonl /tmp/eager.jsonl | tee "$OUT/compare.txt" | head -20
