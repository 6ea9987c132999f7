# helper H7's device call (issue 14 item 1, rows-changing steps formed ahead): one capture of the
# example config, then host_step.py's mixed workload with and without forming ahead (same tree,
# Engine.pipeline_changes), and the 256 x 128/128 greedy / T 0.8 host loop. Results under $OUT.
O=$OUT; S=$SECONDS; END=${END:-140}
left() { [ $((SECONDS - S + $1)) -lt $END ] || { echo "SKIPPED (time): $2"; return 1; }; }
A=${ART:-/tmp/b/artifacts}; mkdir -p $A && tar xzf ../u5-tcache.tgz -C $A && echo tcache-ok
timeout 70 python3 -m trtgraph capture --config examples/llama-3.2-1b-synthetic.yaml --out $A > $O/capture.txt 2>&1; echo "capture rc=$? t=$((SECONDS-S))"; tail -2 $O/capture.txt
for mode in pipe nopipe; do
  flag=""; [ $mode = nopipe ] && flag=--no-pipeline
  left 20 mixed-$mode && { timeout 40 python3 scripts/host_step.py --manifest $A --mixed 512 --repeats 1 $flag --dump $O/mixed-$mode.json > $O/mixed-$mode.txt 2>&1; echo "mixed-$mode rc=$? t=$((SECONDS-S))"; grep -v Warning $O/mixed-$mode.txt | head -12; }
done
python3 -c "
import json,sys
a=json.load(open('$O/mixed-pipe.json')); b=json.load(open('$O/mixed-nopipe.json'))
print('mixed tokens equal:', a==b, 'requests', len(a), 'differing', sum(a[k]!=b.get(k) for k in a))" 2>&1
[ -n "$MIXED_ONLY" ] && { echo "done t=$((SECONDS-S))"; exit 0; }
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/p.jsonl; [ -n "$MIXED_ONLY" ] && { echo "done t=$((SECONDS-S))"; exit 0; }
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 --temperature 0.8 > /tmp/pt.jsonl
left 12 host && { timeout 30 python3 scripts/host_step.py --manifest $A --prompts /tmp/p.jsonl --repeats 2 > $O/host.txt 2>&1; echo "host rc=$? t=$((SECONDS-S))"; grep -v Warning $O/host.txt | head -8; }
left 12 hostT && { timeout 30 python3 scripts/host_step.py --manifest $A --prompts /tmp/pt.jsonl --repeats 2 > $O/hostT.txt 2>&1; echo "hostT rc=$? t=$((SECONDS-S))"; grep -v Warning $O/hostT.txt | head -8; }
echo "done t=$((SECONDS-S))"; cd $O && tar czf H7.tgz *.txt 2>/dev/null
