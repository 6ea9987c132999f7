#!/bin/bash
# Helper S9's device call (ninth session, issue 14 item 2), from the tree's root with PYTHONPATH set:
# spec_bench's 12 cells (3 paired runs each), then the batch-64 cells of random, code-like and copy
# twice more on the same captured plan (engines started afresh each time). Results under $OUT/R.tgz.
O=/tmp/s9res; mkdir -p $O; S=$SECONDS; END=${END:-245}
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee $O/env.txt
mkdir -p /tmp/spec/artifacts && tar xzf ../u8-tcache.tgz -C /tmp/spec/artifacts && echo tcache-ok
timeout $((END - 5)) python3 scripts/spec_bench.py /tmp/spec --repeats 3 > $O/spec.txt 2>&1
echo "spec rc=$? t=$((SECONDS - S))"
grep -v -i warn $O/spec.txt | tail -17; cp /tmp/spec/spec_bench.json $O/ 2>/dev/null
for i in 1 2; do
  left=$((END - (SECONDS - S)))
  [ $left -gt 45 ] || { echo "SKIPPED (time): batch-64 run $i"; break; }
  timeout $left python3 scripts/spec_bench.py /tmp/spec64_$i --repeats 3 --sets random,code-like,copy --batches 64 \
    --artifacts /tmp/spec/artifacts > $O/spec64_$i.txt 2>&1
  echo "spec64_$i rc=$? t=$((SECONDS - S))"
  grep -v -i warn $O/spec64_$i.txt | tail -5; cp /tmp/spec64_$i/spec_bench.json $O/spec64_$i.json 2>/dev/null
done
tar czf $OUT/R.tgz -C $O . && echo "done t=$((SECONDS - S))"
