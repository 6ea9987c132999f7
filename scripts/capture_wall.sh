# Capture's wall against its own work on the device (issue 14), before / after alternating.
# From the tree under test, PYTHONPATH=$PWD: OUT=DIR BEFORE=<the base tree> TCACHE=<Triton cache tgz>
# ROUNDS=N PROFILE=1 IMPORTS=1 RUNS=N bash scripts/capture_wall.sh
# A first capture of this tree (untimed) compiles what the carried Triton cache lacks and writes the
# bytecode caches; PROFILE runs scripts/capture_profile.py on both trees (each tree's first start);
# then ROUNDS x (before, after) captures, each timed by the shell around the process; IMPORTS: one
# capture under `python -X importtime`; PROBE: scripts/graph_launch_probe.py (what waits for a busy
# device); RUNS: `trtgraph run --verbose` of one prompt; the Triton
# cache comes back as $OUT/tcache.tgz, everything else in $OUT/results.tgz (the device returns 8 files).
# END (seconds, default 600): a step that would not end by then is skipped, said so ("SKIPPED").
# VARIANTS (default "before after"): the trees each round captures with, in order; "nogc" is this tree
# with the imports' collector left on (startup.defer_gc a no-op: h/u9's with / without). RUN_BEFORE=1: one
# `run --verbose` of the BEFORE tree after this tree's runs. Both trees' bytecode is compiled first.
O=/tmp/capture_wall; rm -rf $O; mkdir -p $O; A=$PWD; S=$SECONDS; CFG=${CFG:-examples/llama-3.2-1b-synthetic.yaml}; ART=/tmp/b/artifacts
case $CFG in /*) CA=$CFG;; *) CA=$A/$CFG;; esac
ms() { echo $(( $(date +%s%N) / 1000000 )); }
left() { [ $((SECONDS - S + $1)) -lt ${END:-600} ] || { echo "SKIPPED (time): $2"; return 1; }; }
mkdir -p $ART && { [ -z "$TCACHE" ] || tar xzf $TCACHE -C $ART; } && echo "tcache ok t=$((SECONDS-S))"
for D in $A $BEFORE; do [ -n "$D" ] && python3 -m compileall -q $D/trtgraph > /dev/null; done; echo "bytecode ok t=$((SECONDS-S))"
t0=$(ms); python3 -m trtgraph capture --config $CFG --out $ART --json > $O/warm.json 2> $O/warm.err
echo "warm rc=$? wall_ms=$(( $(ms) - t0 )) t=$((SECONDS-S))"; tail -2 $O/warm.err
if [ -n "$PROFILE" ]; then
  left 20 profile && { (cd $BEFORE && PYTHONPATH=$BEFORE python3 $A/scripts/capture_profile.py $A/$CFG $ART $O/prof_before.json > /dev/null 2> $O/prof_before.err); echo "prof before rc=$? t=$((SECONDS-S))"
  python3 scripts/capture_profile.py $CFG $ART $O/prof_after.json > /dev/null 2> $O/prof_after.err; echo "prof after rc=$? t=$((SECONDS-S))"; }
fi
summary() { python3 -c "
import json,sys; b=json.load(open(sys.argv[1])); own=b['warmup_seconds']+b['capture_seconds']; p=b['phases']
print(sys.argv[2], 'wall', sys.argv[3], 'own', round(own,3), 'ratio', round(int(sys.argv[3])/1000/own,3), 'phases', round(p['total_seconds'],3), {k: round(v,3) for k,v in p['phases_seconds'].items()}, 'verify_s', b['replay_timing']['verify_seconds'], 'held_back', b['replay_timing'].get('keys_held_back'))" "$@" || tail -3 ${1%.json}.err; }
NOGC="import sys, trtgraph.startup as s; s.defer_gc = lambda: None; from trtgraph.cli import entry; sys.argv[0] = 'trtgraph'; entry()"
for r in $(seq 1 ${ROUNDS:-0}); do
  for t in ${VARIANTS:-before after}; do
    if [ $t = before ]; then D=$BEFORE; else D=$A; fi
    if [ $t = nogc ]; then P=(-c "$NOGC"); else P=(-m trtgraph); fi
    left 8 "cap $t $r" || continue
    t0=$(ms); (cd $D && PYTHONPATH=$D python3 "${P[@]}" capture --config $CA --out $ART --json > $O/cap_${t}_$r.json 2> $O/cap_${t}_$r.err)
    rc=$?; w=$(( $(ms) - t0 )); echo "cap $t $r rc=$rc t=$((SECONDS-S))"; summary $O/cap_${t}_$r.json "$t$r" $w
  done
done
if [ -n "$IMPORTS" ]; then
  python3 -X importtime -m trtgraph capture --config $CFG --out $ART --json > $O/imp_cap.json 2> $O/imp.txt; echo "importtime rc=$? t=$((SECONDS-S))"
  sort -t'|' -k2 -n -r $O/imp.txt | awk -F'|' '$3 ~ /^ {1,3}[a-zA-Z_]/' | head -25
fi
if [ -n "$PROBE" ] && left 25 probe; then
  python3 scripts/graph_launch_probe.py > $O/probe.txt 2>&1; echo "probe rc=$? t=$((SECONDS-S))"; grep "behind a 50 ms" $O/probe.txt
fi
python3 scripts/make_prompts.py --n 1 --in ${PIN:-128} --out ${POUT:-128} > /tmp/one.jsonl
for i in $(seq 1 ${RUNS:-0}); do
  left 6 "run$i" || continue
  t0=$(ms); python3 -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/one.out --verbose > $O/one$i.txt 2>&1
  echo "run$i rc=$? wall_ms=$(( $(ms) - t0 )) t=$((SECONDS-S))"; grep -A14 "phases (" $O/one$i.txt | grep -v "note:"
done
if [ -n "$RUN_BEFORE" ] && left 6 run_before; then
  t0=$(ms); (cd $BEFORE && PYTHONPATH=$BEFORE python3 -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/one.out --verbose > $O/one_before.txt 2>&1)
  echo "run_before rc=$? wall_ms=$(( $(ms) - t0 )) t=$((SECONDS-S))"; grep -A14 "phases (" $O/one_before.txt | grep -v "note:"
fi
(cd $ART && tar czf $OUT/tcache.tgz triton-cache); (cd $O && tar czf $OUT/results.tgz .); echo "done t=$((SECONDS-S))"
