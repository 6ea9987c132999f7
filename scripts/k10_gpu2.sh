#!/usr/bin/env bash
# Helper K10's third device call: the TMA LM head alone against the fused GEMV at 33-64 rows
# (tma_probe.py --head, 5 interleaved passes), the replayed step light / notma three times over
# at bs 40 and 64 (decode_ablation.py: 6 interleaved results per variant and batch), and the GPU
# tests of the touched files. Everything under /tmp/res2, tarred to $OUT/R2.tgz.
O=/tmp/res2; mkdir -p $O; S=$SECONDS; END=${END:-170}
A=/tmp/b/artifacts; mkdir -p $A
[ -f ../u8-tcache.tgz ] && [ ! -d $A/triton-cache ] && tar xzf ../u8-tcache.tgz -C $A && echo tcache-ok
export TRITON_CACHE_DIR=$A/triton-cache
timeout 40 python3 scripts/tma_probe.py $O/head.json --head > $O/head.txt 2>&1; echo "head rc=$? t=$((SECONDS-S))"; grep -v -i warn $O/head.txt
timeout 90 python3 scripts/decode_ablation.py $O/abl.json examples/llama-3.2-1b-synthetic.yaml light notma light notma light notma \
  --batches 40,64 > $O/abl.txt 2>&1; echo "abl rc=$? t=$((SECONDS-S))"; grep -v -i warn $O/abl.txt | grep -v "^choice\|^backends"
timeout $((END - (SECONDS - S))) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tma_head.py tests/test_decode_linear.py \
  tests/test_split_residual.py > $O/pytest_gpu.log 2>&1; echo "pytest rc=$? t=$((SECONDS-S))"; tail -3 $O/pytest_gpu.log
echo "done t=$((SECONDS-S))"; tar czf $OUT/R2.tgz -C $O .
