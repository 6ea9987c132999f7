# helper A7's second device call: attention PDL-launched with its successor released after its wait, bs 1
O=$OUT; S=$SECONDS
mkdir -p /tmp/b/artifacts && tar xzf ../u5-tcache.tgz -C /tmp/b/artifacts 2>/dev/null && export TRITON_CACHE_DIR=/tmp/b/artifacts/triton-cache
timeout 36 python3 scripts/attention_ab.py $O/ab2.json examples/llama-3.2-1b-synthetic.yaml new pdl-late pdl-late-no-prefetch --batches 1 > $O/ab2.txt 2>&1; echo "ab rc=$? t=$((SECONDS-S))"; grep -v Warn $O/ab2.txt | tail -8
