#!/usr/bin/env bash
# Issue 14 on the GPU, one device call: this tree ("after") against BEFORE (another tree's root,
# the first argument). Results under $OUT. Each step is skipped once LIMIT seconds have passed.
# Usage (from this tree's root): bash scripts/h14_gpu.sh ../before_tree   ("-": this tree only, and the
# warm capture under cProfile)
BEFORE=$([ "$1" = - ] || cd "$1" && pwd); AFTER=$PWD; LIMIT=${LIMIT:-215}; OUT=${OUT:-/tmp/h14}; mkdir -p "$OUT"
CFG=examples/llama-3.2-1b-synthetic.yaml; ART=/tmp/art; START=$SECONDS
left() { [ $((SECONDS - START)) -lt "$LIMIT" ] || { echo "SKIPPED (time): $*"; return 1; }; }
wall() { local t0; t0=$(date +%s%N); "$@"; echo "wall $(( ($(date +%s%N) - t0) / 1000000 )) ms: $*"; }
in_tree() { (cd "$1" && shift && PYTHONPATH=$PWD "$@"); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/p.jsonl
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 --temperature 0.8 > /tmp/pt.jsonl
python3 scripts/make_prompts.py --n 512 --in-min 8 --in 1500 --out-min 16 --out 256 --sampled 0.333 > /tmp/mixed.jsonl
head -1 /tmp/p.jsonl > /tmp/one.jsonl
wall python3 -m trtgraph capture --config $CFG --out $ART --json > "$OUT/capture_cold.json" 2> "$OUT/capture_cold.log"
tail -2 "$OUT/capture_cold.log"; head -6 "$OUT/capture_cold.json"
host() {  # tree name prompts
  [ "$2" = after ] || [ "$BEFORE" != "$AFTER" ] || return
  left "host_step $2 $3" || return
  echo "== host_step $2 $3"; in_tree "$1" timeout 60 python3 scripts/host_step.py --manifest $ART --prompts "$3" \
    --repeats 2 --dump "$OUT/tokens_$2_$(basename "$3" .jsonl).json" 2>&1 | grep -v Warning
}
host "$AFTER" after /tmp/p.jsonl
host "$BEFORE" before /tmp/p.jsonl
left mixed && { echo "== mixed after"; wall timeout 60 python3 -m trtgraph run --prompts /tmp/mixed.jsonl --manifest $ART \
  --output /tmp/mixed_after.jsonl --summary-json "$OUT/mixed_after.json" 2>&1 | tail -3; }
host "$AFTER" after /tmp/pt.jsonl
for i in 1 $([ "$BEFORE" != "$AFTER" ] && echo 2); do left "run one $i" && { echo "== run --verbose, 1 prompt ($i)"; wall timeout 60 python3 -m trtgraph run \
  --prompts /tmp/one.jsonl --manifest $ART --output /tmp/one_out.jsonl --verbose --summary-json "$OUT/one_$i.json" 2>&1 | tail -14; }; done
left "capture warm" && { echo "== capture, warm Triton cache"; PROF=(); [ "$BEFORE" = "$AFTER" ] && PROF=(-m cProfile -o /tmp/cap.prof)
  wall python3 "${PROF[@]}" -m trtgraph capture --config $CFG --out $ART --json > "$OUT/capture_warm.json" 2> "$OUT/capture_warm.log"
  tail -1 "$OUT/capture_warm.json"; head -6 "$OUT/capture_warm.json"
  [ -f /tmp/cap.prof ] && python3 -c "import pstats; pstats.Stats('/tmp/cap.prof').sort_stats('cumtime').print_stats(25)" \
    | grep -E "cumtime|trtgraph|torch/cuda|triton" | head -30; }
[ "$BEFORE" != "$AFTER" ] && left "mixed before" && { echo "== mixed before"; wall in_tree "$BEFORE" timeout 60 python3 -m trtgraph run --prompts /tmp/mixed.jsonl \
  --manifest $ART --output /tmp/mixed_before.jsonl --summary-json "$OUT/mixed_before.json" 2>&1 | tail -3; }
host "$BEFORE" before /tmp/pt.jsonl
python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
for name in ("p", "pt"):
    a, b = (os.path.join(out, f"tokens_{t}_{name}.json") for t in ("after", "before"))
    if os.path.exists(a) and os.path.exists(b):
        x, y = json.load(open(a)), json.load(open(b))
        print(f"{name}: {sum(x[k] == y.get(k) for k in x)}/{len(x)} requests with the same tokens before and after")
for f in sorted(glob.glob(os.path.join(out, "mixed_*.json"))):
    r = json.load(open(f))
    print(os.path.basename(f), {k: r.get(k) for k in ("tokens_per_second", "seconds", "steps", "padding_waste_pct",
                                                      "completion_tokens", "preemptions")})
PY
echo "total $((SECONDS - START)) s"
