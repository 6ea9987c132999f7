# h/h9's one device call (nvidia-h200): run from this tree's root with the before tree (main
# c34c282, this branch's scripts/host_step.py copied in) at ../h9base and the Triton cache at
# ../u8-tcache.tgz. One capture (the after tree; the manifest format is unchanged), then
# host_step.py (--repeats 3) before / after, alternating, greedy and T 0.8 (tokens dumped and
# compared), then mixed_steps_ab.py on the after tree.
O=/tmp/res; mkdir -p $O; S=$SECONDS; END=${END:-195}
left() { [ $((SECONDS - S + $1)) -lt $END ] || { echo "SKIPPED (time): $2"; return 1; }; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $O/env.txt
A=/tmp/b/artifacts; mkdir -p $A && tar xzf ../u8-tcache.tgz -C $A && echo tcache-ok
timeout 75 python3 -m trtgraph capture --config examples/llama-3.2-1b-synthetic.yaml --out $A > $O/capture.txt 2>&1; echo "capture rc=$? t=$((SECONDS-S))"
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/pg.jsonl
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 --temperature 0.8 > /tmp/pt.jsonl
hs() {  # tree label prompts
  left 18 "$2" && { (cd $1 && PYTHONPATH=$PWD timeout 25 python3 scripts/host_step.py --manifest $A --prompts $3 --repeats 3 --dump $O/tok_$2.json) > $O/hs_$2.txt 2>&1; echo "$2 rc=$? t=$((SECONDS-S))"; grep -v -i warn $O/hs_$2.txt | cut -c1-900; }
}
B=$PWD/../h9base
for round in 1 2; do
  hs $B before_g$round /tmp/pg.jsonl; hs $PWD after_g$round /tmp/pg.jsonl
  hs $B before_t$round /tmp/pt.jsonl; hs $PWD after_t$round /tmp/pt.jsonl
  [ $round = 1 ] && left 60 mixed && { timeout 60 python3 scripts/mixed_steps_ab.py $A > $O/mixed_ab.txt 2>&1; echo "mixed_ab rc=$? t=$((SECONDS-S))"; grep -v -i warn $O/mixed_ab.txt | tail -4; }
done
python3 - <<'PY'
import json, glob
for t in ("g", "t"):
    for r in ("1", "2"):
        a, b = f"/tmp/res/tok_before_{t}{r}.json", f"/tmp/res/tok_after_{t}{r}.json"
        try:
            x, y = json.load(open(a)), json.load(open(b))
            print(t + r, "tokens equal before/after:", x == y, len(x), "requests")
        except Exception as e:
            print(t + r, "no comparison:", e)
PY
echo "done t=$((SECONDS-S))"; tar czf $OUT/R.tgz -C $O .
