#!/usr/bin/env bash
# Helper U5's profile of start-up and capture on the GPU (one device call): `import torch`, CUDA
# init and `import triton` alone; a cold capture (fills the Triton cache, packed to $OUT for the
# next call); a warm capture and `run --verbose` of one prompt under cProfile (the .prof files come
# back under $OUT; read them with pstats); `run` under -X importtime.
# Usage (tree root): OUT=/tmp/u5 bash scripts/u5_profile.sh
OUT=${OUT:-/tmp/u5}; mkdir -p "$OUT"; CFG=examples/llama-3.2-1b-synthetic.yaml; ART=/tmp/art
wall() { local t0; t0=$(date +%s%N); "$@"; echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms: $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; python3 -V
wall python3 -c pass
wall python3 -c "
import time; t0 = time.perf_counter()
import torch; t1 = time.perf_counter(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); t2 = time.perf_counter()
import triton; t3 = time.perf_counter(); print(f'import torch {t1-t0:.3f} s, cuda init {t2-t1:.3f} s, import triton {t3-t2:.3f} s')"
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 2>/dev/null | head -1 > /tmp/one.jsonl
echo "== capture, cold"; wall python3 -m trtgraph capture --config $CFG --out $ART --json > "$OUT/cap_cold.json" 2>/dev/null
tar -czf "$OUT/tcache.tgz" -C $ART triton-cache; ls -la "$OUT/tcache.tgz"
echo "== capture, warm, cProfile"; wall python3 -m cProfile -o "$OUT/cap.prof" -m trtgraph capture --config $CFG --out $ART --json > "$OUT/cap_warm.json" 2>/dev/null
echo "== run, cProfile"; wall python3 -m cProfile -o "$OUT/run.prof" -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/o.jsonl --verbose 2>&1 | tail -12
echo "== run, importtime"; wall python3 -X importtime -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/o.jsonl --verbose 2> "$OUT/imp.txt" >/dev/null
grep -A12 "start-up phases" "$OUT/imp.txt"
