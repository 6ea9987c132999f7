#!/usr/bin/env bash
# Helper K10's second device call (tenth session, issue 12): the TMA-fed LM head at 33-64 rows
# (kernels/tma_head.py) A/B'd in the replayed step (decode_ablation.py light / notma / tma64 at
# bs 1, 32, 40, 64, two passes), a capture + run round trip with it (manifest record, replay ==
# eager), and its GPU tests beside the capture. Everything under /tmp/res, tarred to $OUT/R.tgz.
# Run from the tree's root with PYTHONPATH=$PWD; ../u8-tcache.tgz, where carried, seeds the cache.
O=/tmp/res; mkdir -p $O; S=$SECONDS; END=${END:-200}
left() { [ $((SECONDS - S + $1)) -lt $END ] || { echo "SKIPPED (time): $2" | tee -a $O/skipped.txt; return 1; }; }
A=/tmp/b/artifacts; mkdir -p $A
[ -f ../u8-tcache.tgz ] && tar xzf ../u8-tcache.tgz -C $A && echo tcache-ok
export TRITON_CACHE_DIR=$A/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/env.txt
timeout 110 python3 scripts/decode_ablation.py $O/abl.json examples/llama-3.2-1b-synthetic.yaml light notma tma64 \
  --batches 1,32,40,64 > $O/abl.txt 2>&1; echo "abl rc=$? t=$((SECONDS-S))"; grep -v -i warn $O/abl.txt
(timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tma_head.py > $O/pytest_gpu.log 2>&1;
 echo "pytest rc=$? t=$((SECONDS-S))" >> $O/pytest_gpu.log) &
PT=$!
python3 scripts/make_prompts.py --n 64 --in 128 --out 48 > /tmp/p64.jsonl
# the example with fewer keys (capture's cold compiles): decode 1 / 8 / 40 / 64 rows, chunks of 64 and 256
sed -e 's/batch_sizes: auto$/batch_sizes: [1, 8, 40, 64]/' -e 's/^  batch_sizes: auto/  batch_sizes: [1, 8, 40, 64]/' \
    -e 's/chunk_sizes: \[64, 256, 512\]/chunk_sizes: [64, 256]/' examples/llama-3.2-1b-synthetic.yaml > /tmp/k10.yaml
grep -E "batch_sizes|chunk_sizes" /tmp/k10.yaml
left 40 capture && { timeout $((END - (SECONDS - S) - 15)) python3 -m trtgraph capture \
  --config /tmp/k10.yaml --out $A > $O/capture.txt 2>&1; echo "capture rc=$? t=$((SECONDS-S))"; tail -3 $O/capture.txt
  python3 -c "import json; t=json.load(open('$A/manifest.json'))['totals']; print('fused_ops', t.get('fused_ops'))" | tee $O/fused_ops.txt; }
left 12 run && { for m in replay eager; do timeout 25 python3 -m trtgraph run --prompts /tmp/p64.jsonl --manifest $A \
  --output /tmp/$m.jsonl --summary-json $O/run_$m.json $([ $m = eager ] && echo --eager) > $O/run_$m.txt 2>&1;
  echo "run $m rc=$? t=$((SECONDS-S))"; done; python3 scripts/compare_outputs.py /tmp/replay.jsonl /tmp/eager.jsonl | tee $O/compare.txt | head -4; }
wait $PT; tail -4 $O/pytest_gpu.log
echo "done t=$((SECONDS-S))"; tar czf $OUT/R.tgz -C $O .
