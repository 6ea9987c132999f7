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
else  # call 2: the whole-config sweep, the pick, the A/B of the step before / picked, the profile with the pick
  SWEEP_SET=2 timeout 45 python3 scripts/attention_sweep.py $O/sweep2.json > $O/sweep2.txt 2>&1; echo "sweep rc=$? t=$((SECONDS-S))"
  grep -v Warn $O/sweep2.txt | grep "#\|compiled\|empty"
  python3 scripts/attention_pick.py $O/sweep2.json $O/pick.json && export A8_PICK=$O/pick.json
  timeout $((END - SECONDS + S - 22)) python3 scripts/attention_ab.py $O/ab.json examples/llama-3.2-1b-synthetic.yaml ${AB:-before-configs picked} > $O/ab.txt 2>&1; echo "ab rc=$? t=$((SECONDS-S))"; grep -v Warn $O/ab.txt | tail -8
  left 8 profile && { timeout $((END - SECONDS + S)) python3 -c "
import json, os, runpy, sys
from trtgraph.kernels import attention_config as a
if os.environ.get('A8_PICK'):
    a.DECODE_ADAPTIVE = tuple((m, c) for m, c in json.load(open(os.environ['A8_PICK']))['adaptive'])
sys.argv = ['profile_step.py', 'examples/llama-3.2-1b-synthetic.yaml', '14']
runpy.run_path('scripts/profile_step.py', run_name='__main__')" > $O/profile.txt 2>&1; echo "profile rc=$? t=$((SECONDS-S))"; grep -v Warn $O/profile.txt | tail -40; }
fi
echo "done t=$((SECONDS-S))"
