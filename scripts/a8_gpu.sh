# helper A8's device calls (issue 12: decode attention at 33-64 rows). Call 1: the attention sweep
# (scripts/attention_sweep.py: plain and RoPE-inside variants, kernels compiled in parallel first),
# then the attention GPU tests. Call 2 (`bash scripts/a8_gpu.sh 2 VARIANT ...`): the replayed
# step's A/B (scripts/attention_ab.py) at bs 1, 8, 32, 64, then profile_step.py at bs 64.
# Run from the tree's root with PYTHONPATH=$PWD; the Triton cache of ../u5-tcache.tgz if carried.
O=$OUT; S=$SECONDS; END=${END:-120}
left() { [ $((SECONDS - S + $1)) -lt $END ] || { echo "SKIPPED (time): $2"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
mkdir -p /tmp/b/artifacts && tar xzf ../u5-tcache.tgz -C /tmp/b/artifacts 2>/dev/null && echo tcache-ok
export TRITON_CACHE_DIR=/tmp/b/artifacts/triton-cache
mkdir -p $TRITON_CACHE_DIR
if [ "${1:-1}" = 1 ]; then
  timeout $((END - 35)) python3 scripts/attention_sweep.py $O/sweep.json > $O/sweep.txt 2>&1; echo "sweep rc=$? t=$((SECONDS-S))"
  grep -v Warn $O/sweep.txt | grep -v "^new {\|^old {" | tail -40
  left 10 tests && { timeout $((END - SECONDS + S)) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_attention_fold.py tests/test_attention_pdl.py > $O/pytest.log 2>&1; echo "pytest rc=$? t=$((SECONDS-S))"; tail -3 $O/pytest.log; grep -E "^FAILED|^E  " $O/pytest.log | head -8; }
else
  shift
  timeout $((END - 40)) python3 scripts/attention_ab.py $O/ab.json examples/llama-3.2-1b-synthetic.yaml "$@" > $O/ab.txt 2>&1; echo "ab rc=$? t=$((SECONDS-S))"; grep -v Warn $O/ab.txt | tail -14
  left 20 profile && { timeout $((END - SECONDS + S)) python3 scripts/profile_step.py examples/llama-3.2-1b-synthetic.yaml 14 > $O/profile.txt 2>&1; echo "profile rc=$? t=$((SECONDS-S))"; grep -v Warn $O/profile.txt | tail -45; }
fi
echo "done t=$((SECONDS-S))"
