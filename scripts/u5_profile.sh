#!/usr/bin/env bash
# Helper U5's profile of start-up and capture on the GPU (one device call): what `import torch`,
# CUDA init and Triton cost alone; a cold capture (fills the Triton cache, packed to $OUT for the
# next call); a warm capture, and `run --verbose` of one prompt, under cProfile and plain; `run`
# under -X importtime. Usage (tree root): OUT=/tmp/u5 bash scripts/u5_profile.sh
OUT=${OUT:-/tmp/u5}; mkdir -p "$OUT"; CFG=examples/llama-3.2-1b-synthetic.yaml; ART=/tmp/art
wall() { local t0; t0=$(date +%s%N); "$@"; echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms: $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; python3 -V
wall python3 -c pass
wall python3 -c "import torch"
wall python3 -c "import torch; torch.zeros(1, device='cuda')"
wall python3 -c "import torch, triton; torch.zeros(1, device='cuda')"
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 | head -1 > /tmp/one.jsonl
echo "== capture, cold"; wall python3 -m trtgraph capture --config $CFG --out $ART --json > "$OUT/cap_cold.json" 2>/dev/null
tar -czf "$OUT/tcache.tgz" -C $ART triton-cache; ls -la "$OUT/tcache.tgz"
echo "== capture, warm"; wall python3 -m trtgraph capture --config $CFG --out $ART --json > "$OUT/cap_warm.json" 2>/dev/null
echo "== capture, warm, cProfile"; wall python3 -m cProfile -o /tmp/cap.prof -m trtgraph capture --config $CFG --out $ART --json >/dev/null 2>&1
python3 -c "import json; t=json.load(open('$ART/manifest.json'))['totals']; print({k: t.get(k) for k in ('warmup_seconds','capture_seconds','replay_timing')}, len(t['warmup_keys']))"
for i in 1 2; do echo "== run $i"; wall python3 -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/o.jsonl --verbose 2>&1 | tail -12; done
echo "== run, cProfile"; wall python3 -m cProfile -o /tmp/run.prof -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/o.jsonl --verbose 2>&1 | tail -12
python3 -X importtime -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/o.jsonl 2> /tmp/imp.txt >/dev/null
python3 - "$OUT" <<'PY' > "$OUT/profiles.txt"
import pstats, sys, io
for f in ("/tmp/cap.prof", "/tmp/run.prof"):
    for order in ("cumulative", "tottime"):
        s = io.StringIO(); p = pstats.Stats(f, stream=s); p.sort_stats(order).print_stats(70); print(f"#### {f} {order}"); print(s.getvalue()[-16000:])
rows = []
for line in open("/tmp/imp.txt"):
    if line.startswith("import time:") and "cumulative" not in line:
        own, cum, name = line[12:].split("|"); d = (len(name) - len(name.lstrip())) // 2
        if d <= 4: rows.append((int(cum) / 1e6, name.rstrip()))
print("#### importtime"); [print(f"{c:7.3f} {n}") for c, n in sorted(rows, reverse=True)[:60]]
PY
cp /tmp/cap.prof /tmp/run.prof /tmp/imp.txt "$OUT/" 2>/dev/null; grep -A40 "#### importtime" "$OUT/profiles.txt" | head -30
