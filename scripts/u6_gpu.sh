#!/usr/bin/env bash
# Issue 14 (sixth session, h/u6): capture's wall against its own work, before and after, on
# a warm Triton cache; each key's manifest replay time against 5 fresh runs; host_step's two
# step-time bounds. Run from the tree under test: OUT=dir [BEFORE=tree] [TCACHE=tgz] [CFG=yaml] bash scripts/u6_gpu.sh
O=${OUT:?}; A=$PWD; B=${BEFORE:-}; CFG=${CFG:-examples/llama-3.2-1b-synthetic.yaml}; ART=${ART:-/tmp/b/artifacts}
S=$SECONDS; END=${END:-170}; export PYTHONPATH=$A PYTHONUNBUFFERED=1
left() { [ $((SECONDS - S + $1)) -lt $END ] || { echo "SKIPPED (time): $2"; return 1; }; }
ms() { echo $(( $(date +%s%N) / 1000000 )); }
mkdir -p "$ART"; [ -n "${TCACHE:-}" ] && tar xzf "$TCACHE" -C "$ART" && echo tcache-ok
cap() {  # cap TREE LABEL: one `trtgraph capture --json` of the config, timed by the shell
  local t0; t0=$(ms)
  (cd "$1" && PYTHONPATH="$1" timeout 90 python3 -m trtgraph capture --config "$A/$CFG" --out "$ART" --json \
     > "$O/cap_$2.json" 2> "$O/cap_$2.err")
  echo "$2 rc=$? wall_s=$(( $(ms) - t0 ))e-3 t=$((SECONDS - S))"; python3 "$A/scripts/u6_phases.py" "$O/cap_$2.json"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
cap "$A" first  # writes the bytecode cache; compiles what the Triton cache lacks
for i in 1 2 3; do
  left 20 "capture $i" || break
  [ -n "$B" ] && cap "$B" before$i
  cap "$A" after$i
done
left 25 timing && { timeout 40 python3 scripts/u6_timing_check.py "$ART" > "$O/timing.txt" 2>&1; echo "timing rc=$? t=$((SECONDS - S))"; tail -12 "$O/timing.txt"; }
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/u6p.jsonl
left 30 host && { timeout $((END - SECONDS + S - 3)) python3 scripts/host_step.py --manifest "$ART" --prompts /tmp/u6p.jsonl --repeats 2 > "$O/host.txt" 2>&1
  echo "host rc=$? t=$((SECONDS - S))"; grep -v Warning "$O/host.txt" | head -12; }
echo "done t=$((SECONDS - S))"; cd "$O" && tar czf u6.tgz *.json *.err *.txt 2>/dev/null; ls
