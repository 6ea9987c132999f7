#!/bin/bash
# Helper H5's device call (issue 14 item 1): host_step.py before (BEFORE: a tree at main, default
# the tree two levels up) and after (this tree) on one small capture of the Llama-3.2-1B
# synthetic shapes: decode and chunk-64 prefill keys of 64 rows only, greedy and sampled (the
# 256 x 128/128 workload uses no other key). Run from this tree's root with PYTHONPATH=$PWD.
O=${OUT:-/tmp/h5out}; S=$SECONDS; END=${END:-185}; BEFORE=${BEFORE:-../..}; ME=$PWD
mkdir -p $O
left() { [ $((SECONDS - S + $1)) -lt $END ] || { echo "SKIPPED (time): $2"; return 1; }; }
python3 - <<'PY'
import yaml
c = yaml.safe_load(open("examples/llama-3.2-1b-synthetic.yaml"))
c["buckets"].update(batch_sizes=[64], context_batch_sizes=[64], chunk_sizes=[64], sampling=["greedy", "sampled"])
c["output"] = "/tmp/art"
yaml.safe_dump(c, open("/tmp/h5.yaml", "w"))
PY
timeout 110 python3 -m trtgraph capture --config /tmp/h5.yaml --out /tmp/art --json > $O/capture.json 2> $O/capture.err
echo "capture rc=$? t=$((SECONDS-S))"; tail -2 $O/capture.err
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/p.jsonl
python3 scripts/make_prompts.py --n 256 --in 128 --out 128 --temperature 0.8 > /tmp/pt.jsonl
run() {  # tree name prompts repeats
  left 20 "$2" || return
  (cd $1 && PYTHONPATH=$PWD timeout 45 python3 scripts/host_step.py --manifest /tmp/art --prompts $3 --repeats $4 \
     --dump $O/$2.json > $O/$2.txt 2>&1); echo "$2 rc=$? t=$((SECONDS-S))"; grep -v Warning $O/$2.txt | head -20
}
run $BEFORE before /tmp/p.jsonl 2
run $ME after /tmp/p.jsonl 2
run $ME after_t08 /tmp/pt.jsonl 1
run $BEFORE before_t08 /tmp/pt.jsonl 1
python3 - $O <<'PY'
import json, sys, os
o = sys.argv[1]
for a, b in (("before", "after"), ("before_t08", "after_t08")):
    pa, pb = f"{o}/{a}.json", f"{o}/{b}.json"
    if os.path.exists(pa) and os.path.exists(pb):
        x, y = json.load(open(pa)), json.load(open(pb))
        print(f"tokens {a} == {b}: {x == y} ({len(x)} requests, {sum(map(len, x.values()))} tokens)")
PY
cd $O && tar czf h5.tgz *.txt capture.err && rm -f *.txt capture.err
echo "done t=$((SECONDS-S))"
