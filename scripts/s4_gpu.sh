#!/usr/bin/env bash
# Issue 14 items 2 and 4 on the GPU in one device call: `trtgraph capture` cold then warm (wall,
# and the capture's own work from totals), `run --verbose` of one prompt twice, scripts/spec_bench.py,
# then `run` once under `python3 -X importtime` (the imports phase split). Results under $OUT; each
# step after the captures is skipped once LIMIT seconds have passed.
# Usage (from the tree's root): OUT=/tmp/s4 bash scripts/s4_gpu.sh
OUT=${OUT:-/tmp/s4}; LIMIT=${LIMIT:-120}; mkdir -p "$OUT"; CFG=examples/llama-3.2-1b-synthetic.yaml; ART=/tmp/art
START=$SECONDS
left() { [ $((SECONDS - START)) -lt "$LIMIT" ] || { echo "SKIPPED (time): $*"; return 1; }; }
wall() { local t0; t0=$(date +%s%N); "$@"; echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms: $*"; }
totals() { python3 -c "import json; t=json.load(open('$ART/manifest.json'))['totals']; print({k: t.get(k) for k in
  ('num_keys', 'warmup_seconds', 'capture_seconds', 'replay_timing')}, len(t.get('warmup_keys', [])), 'warmup_keys')"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 | head -1 > /tmp/one.jsonl
for kind in cold warm; do
  echo "== capture, $kind Triton cache"
  wall python3 -m trtgraph capture --config $CFG --out $ART --json > "$OUT/capture_$kind.json" 2> "$OUT/capture_$kind.log"
  tail -1 "$OUT/capture_$kind.log"; totals
done
cp $ART/manifest.json "$OUT/manifest.json"
for i in 1 2; do
  left "run $i" && { echo "== run --verbose, 1 prompt ($i)"
  wall timeout 60 python3 -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/one_out.jsonl \
    --verbose --summary-json "$OUT/one_$i.json" 2>&1 | tail -11; }
done
left spec_bench && { echo "== spec_bench"; wall python3 scripts/spec_bench.py "$OUT/spec" 2>&1 | grep -v Warning | tail -16; }
left importtime && { echo "== run under -X importtime: the largest imports (cumulative s, depth <= 3)"
  timeout 60 python3 -X importtime -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/one_out.jsonl \
    --verbose 2> /tmp/imp.txt >/dev/null; grep -A9 "start-up phases" /tmp/imp.txt
  python3 - <<'PY'
rows = []
for line in open("/tmp/imp.txt"):
    if line.startswith("import time:") and "cumulative" not in line:
        own, cum, name = line[12:].split("|")
        if (len(name) - len(name.lstrip())) // 2 <= 3:
            rows.append((int(cum) / 1e6, name.rstrip()))
for cum, name in sorted(rows, reverse=True)[:25]:
    print(f"{cum:7.3f} {name}")
PY
}
echo "total $((SECONDS - START)) s"
