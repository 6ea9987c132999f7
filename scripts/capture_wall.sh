# Capture's wall against its own work on the device (issue 14), trees alternating.
# From the tree under test, PYTHONPATH=$PWD: OUT=DIR BEFORE=<the base tree> TCACHE=<Triton cache tgz>
# ROUNDS=N PROFILE=1 IMPORTS=1 RUNS=N bash scripts/capture_wall.sh
# A first capture of this tree (untimed) compiles what the carried Triton cache lacks (both trees'
# bytecode is compiled before it); then the steps of SCHEDULE, in order, each skipped (said so:
# "SKIPPED") where it would not end by END seconds (default 600):
#   before:R / after:R / nogc:R  one `trtgraph capture --json` of the BEFORE tree / this tree / this
#                  tree with the imports' collector left on (startup.defer_gc a no-op), timed by the
#                  shell around the process (R names the round);
#   runs           RUNS x `trtgraph run --verbose` of one prompt (this tree, on the last capture);
#   run_before     one of the BEFORE tree;
#   profile / profile_before  scripts/capture_profile.py on this tree / the BEFORE tree (in process;
#                  PROFILE_ARGS: its flags, e.g. --timing-check);  profile_calls  this tree's with --calls
#                  (the long calls inside slow recordings; slows the recordings);  profile_hold  this
#                  tree's with --hold (nothing launched before the last recording);
#   exit_probe     how long a process takes to end (os._exit) holding 120 GiB of device memory, and 1 GiB;
#   inspect        `trtgraph inspect` of the last capture's manifest (this tree);
#   imports        one capture under `python -X importtime`;  probe  scripts/graph_launch_probe.py.
# Without SCHEDULE: PROFILE (both trees' profiles), ROUNDS x VARIANTS (default "before after"),
# IMPORTS, PROBE, RUNS, RUN_BEFORE, in that order. The Triton cache comes back as $OUT/tcache.tgz,
# (not with NO_TCACHE_OUT=1), everything else in $OUT/results.tgz (the device returns 8 files); the
# captures' table is printed last.
O=/tmp/capture_wall; rm -rf $O; mkdir -p $O; A=$PWD; S=$SECONDS; CFG=${CFG:-examples/llama-3.2-1b-synthetic.yaml}; ART=/tmp/b/artifacts
case $CFG in /*) CA=$CFG;; *) CA=$A/$CFG;; esac
ms() { echo $(( $(date +%s%N) / 1000000 )); }
left() { [ $((SECONDS - S + $1)) -lt ${END:-600} ] || { echo "SKIPPED (time): $2"; return 1; }; }
if [ -z "$SCHEDULE" ]; then
  [ -n "$PROFILE" ] && SCHEDULE="profile_before profile"
  for r in $(seq 1 ${ROUNDS:-0}); do for t in ${VARIANTS:-before after}; do SCHEDULE="$SCHEDULE $t:$r"; done; done
  [ -n "$IMPORTS" ] && SCHEDULE="$SCHEDULE imports"; [ -n "$PROBE" ] && SCHEDULE="$SCHEDULE probe"
  SCHEDULE="$SCHEDULE runs"; [ -n "$RUN_BEFORE" ] && SCHEDULE="$SCHEDULE run_before"
fi
echo "schedule:$SCHEDULE"
mkdir -p $ART && { [ -z "$TCACHE" ] || tar xzf $TCACHE -C $ART; } && echo "tcache ok t=$((SECONDS-S))"
for D in $A $BEFORE; do [ -n "$D" ] && python3 -m compileall -q $D/trtgraph > /dev/null; done; echo "bytecode ok t=$((SECONDS-S))"
t0=$(ms); python3 -m trtgraph capture --config $CFG --out $ART --json > $O/warm.json 2> $O/warm.err
echo "warm rc=$? wall_ms=$(( $(ms) - t0 )) t=$((SECONDS-S))"; tail -2 $O/warm.err
python3 scripts/make_prompts.py --n 1 --in ${PIN:-128} --out ${POUT:-128} > /tmp/one.jsonl
summary() { python3 -c "
import json,sys; b=json.load(open(sys.argv[1])); own=b['warmup_seconds']+b['capture_seconds']; p=b['phases']
print(sys.argv[2], 'wall', sys.argv[3], 'own', round(own,3), 'ratio', round(int(sys.argv[3])/1000/own,3), 'phases', round(p['total_seconds'],3), {k: round(v,3) for k,v in p['phases_seconds'].items()}, 'verify_s', b['replay_timing']['verify_seconds'], 'held_back', b['replay_timing'].get('keys_held_back'))" "$@" | tee -a $O/table.txt || tail -3 ${1%.json}.err; }
NOGC="import sys, trtgraph.startup as s; s.defer_gc = lambda: None; from trtgraph.cli import entry; sys.argv[0] = 'trtgraph'; entry()"
run_one() {  # $1 tree dir, $2 name
  t0=$(ms); (cd $1 && PYTHONPATH=$1 python3 -m trtgraph run --prompts /tmp/one.jsonl --manifest $ART --output /tmp/one.out --verbose > $O/$2.txt 2>&1)
  echo "$2 rc=$? wall_ms=$(( $(ms) - t0 )) t=$((SECONDS-S))"; grep -A14 "phases (" $O/$2.txt | grep -v "note:"
}
for step in $SCHEDULE; do
  case $step in
    before:*|after:*|nogc:*)
      t=${step%%:*}; r=${step#*:}
      if [ $t = before ]; then D=$BEFORE; else D=$A; fi
      if [ $t = nogc ]; then P=(-c "$NOGC"); else P=(-m trtgraph); fi
      left 8 "cap $t $r" || continue
      t0=$(ms); (cd $D && PYTHONPATH=$D python3 "${P[@]}" capture --config $CA --out $ART --json > $O/cap_${t}_$r.json 2> $O/cap_${t}_$r.err)
      rc=$?; w=$(( $(ms) - t0 )); echo "cap $t $r rc=$rc t=$((SECONDS-S))"; summary $O/cap_${t}_$r.json "$t$r" $w ;;
    runs) for i in $(seq 1 ${RUNS:-0}); do left 6 "run$i" && run_one $A one$i; done ;;
    run_before) left 6 run_before && run_one $BEFORE one_before ;;
    profile) left 12 profile && { python3 scripts/capture_profile.py $CA $ART $O/prof_after.json $PROFILE_ARGS > /dev/null 2> $O/prof_after.err; echo "prof after rc=$? t=$((SECONDS-S))"; } ;;
    profile_calls) left 14 profile_calls && { python3 scripts/capture_profile.py $CA $ART $O/prof_calls.json --calls > /dev/null 2> $O/prof_calls.err; echo "prof calls rc=$? t=$((SECONDS-S))"; } ;;
    profile_hold) left 12 profile_hold && { python3 scripts/capture_profile.py $CA $ART $O/prof_hold.json --hold > /dev/null 2> $O/prof_hold.err; echo "prof hold rc=$? t=$((SECONDS-S))"; } ;;
    exit_probe) for g in 120 1; do left 5 exit_probe && { python3 -c "import os, sys, time, torch
x = torch.empty($g << 30, dtype=torch.uint8, device='cuda'); x.fill_(1); torch.cuda.synchronize()
print(time.time_ns() // 1000000); sys.stdout.flush(); os._exit(0)" > $O/exit_$g.txt 2>&1; e=$(ms); echo "exit_probe ${g}GiB: exit took $((e - $(tail -1 $O/exit_$g.txt))) ms" | tee -a $O/exit.txt; }; done ;;
    inspect) left 5 inspect && { python3 -m trtgraph inspect $ART > $O/inspect.txt 2>&1; echo "inspect rc=$? t=$((SECONDS-S))"; head -30 $O/inspect.txt; } ;;
    profile_before) left 12 profile_before && { (cd $BEFORE && PYTHONPATH=$BEFORE python3 $A/scripts/capture_profile.py $CA $ART $O/prof_before.json > /dev/null 2> $O/prof_before.err); echo "prof before rc=$? t=$((SECONDS-S))"; } ;;
    imports) left 10 imports && { python3 -X importtime -m trtgraph capture --config $CFG --out $ART --json > $O/imp_cap.json 2> $O/imp.txt; echo "importtime rc=$? t=$((SECONDS-S))"
      sort -t'|' -k2 -n -r $O/imp.txt | awk -F'|' '$3 ~ /^ {1,3}[a-zA-Z_]/' | head -25; } ;;
    probe) left 25 probe && { python3 scripts/graph_launch_probe.py > $O/probe.txt 2>&1; echo "probe rc=$? t=$((SECONDS-S))"; grep "behind a 50 ms" $O/probe.txt; } ;;
    *) echo "unknown step $step" ;;
  esac
done
[ -z "$NO_TCACHE_OUT" ] && (cd $ART && tar czf $OUT/tcache.tgz triton-cache); (cd $O && tar czf $OUT/results.tgz .)
echo "captures (wall ms, own s, ratio):"; [ -f $O/table.txt ] && awk '{print $1, $3, $5, $7}' $O/table.txt; echo "done t=$((SECONDS-S))"
