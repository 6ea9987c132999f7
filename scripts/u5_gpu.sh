#!/usr/bin/env bash
# Helper U5's before/after of start-up and capture on the GPU, in one device call:
#  - this tree: `trtgraph capture --json` twice (the first also writes the bytecode cache and
#    Triton's key file, one-time costs; the second is the steady state), then `run --verbose` of
#    one prompt 3 times;
#  - BEFORE=DIR (a tree of main, optional): the same capture once and run once there, on the
#    same machine and the same warm Triton cache.
# TCACHE=FILE (optional): a .tgz of a Triton cache for this config (from scripts/u5_profile.sh),
# so the first capture is warm too. Results under $OUT; a table last.
# Usage (tree root): OUT=/tmp/u5 [TCACHE=tcache.tgz] [BEFORE=/path/to/main] bash scripts/u5_gpu.sh
OUT=${OUT:-/tmp/u5}; mkdir -p "$OUT"; CFG=${CFG-examples/llama-3.2-1b-synthetic.yaml}; HERE=$PWD
CONF=(); [ -n "$CFG" ] && CONF=(--config "$CFG")  # CFG= : the embedded default (a CPU smoke test)
ms() { echo $(( $(date +%s%N) / 1000000 )); }
timed() { local name=$1 t0; shift; t0=$(ms); "$@"; echo "$name $(( $(ms) - t0 ))" >> "$OUT/walls.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 2>/dev/null | head -1 > /tmp/one.jsonl
for art in /tmp/art /tmp/artb; do mkdir -p $art; [ -n "$TCACHE" ] && tar -xzf "$TCACHE" -C $art; done
: > "$OUT/walls.txt"
for i in 1 2; do
  timed "after_capture_$i" python3 -m trtgraph capture "${CONF[@]}" --out /tmp/art --json > "$OUT/after_capture_$i.json" 2>/dev/null
done
for i in 1 2 3; do
  timed "after_run_$i" python3 -m trtgraph run --prompts /tmp/one.jsonl --manifest /tmp/art --output /tmp/o.jsonl \
    --verbose --summary-json "$OUT/after_run_$i.json" 2> "$OUT/after_run_$i.txt"
done
if [ -n "$BEFORE" ]; then
  cd "$BEFORE" && export PYTHONPATH=$BEFORE
  timed before_capture python3 -m trtgraph capture "${CONF[@]}" --out /tmp/artb --json > "$OUT/before_capture.json" 2>/dev/null
  timed before_run python3 -m trtgraph run --prompts /tmp/one.jsonl --manifest /tmp/artb --output /tmp/ob.jsonl \
    --verbose --summary-json "$OUT/before_run.json" 2> "$OUT/before_run.txt"
  cd "$HERE" && export PYTHONPATH=$HERE
fi
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
walls = dict(line.split() for line in open(f"{out}/walls.txt"))
for name in sorted(walls):
    path = f"{out}/{name}.json"
    if not os.path.exists(path):
        print(name, "no output"); continue
    body = json.load(open(path))
    wall = int(walls[name]) / 1e3
    if "capture" in name:
        own = body["warmup_seconds"] + body["capture_seconds"]
        ph = body.get("phases", {}).get("phases_seconds", {})
        print(f"{name}: wall {wall:.2f} s, own work {own:.2f} s (warm-up {body['warmup_seconds']:.2f} + capture "
              f"{body['capture_seconds']:.2f}), wall/own {wall / own:.2f}x, verify+time "
              f"{body['replay_timing'].get('verify_seconds')} s, repeats {body['replay_timing'].get('repeats_min')}-"
              f"{body['replay_timing'].get('repeats_max')}, spread median {body['replay_timing'].get('spread_median')}"
              f" max {body['replay_timing'].get('spread_max')}")
        print("   phases " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    else:
        st = body["startup"]
        print(f"{name}: wall {wall:.2f} s, phases total {st['total_seconds']:.3f} s, first token "
              f"{st.get('first_token_seconds', st['phases_seconds'].get('first_token'))}")
        print("   phases " + ", ".join(f"{k} {v:.3f}" for k, v in st["phases_seconds"].items()))
PY
