# helper A7's device call (issue 12: PDL-launched decode attention): GPU tests, then the A/B
O=$OUT; S=$SECONDS; END=${END:-120}
left() { [ $((SECONDS - S + $1)) -lt $END ] || { echo "SKIPPED (time): $2"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p /tmp/b/artifacts && tar xzf ../u5-tcache.tgz -C /tmp/b/artifacts 2>/dev/null && echo tcache-ok
export TRITON_CACHE_DIR=/tmp/b/artifacts/triton-cache
[ -d $TRITON_CACHE_DIR ] || unset TRITON_CACHE_DIR
timeout 75 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_attention_pdl.py "tests/test_kernels.py::test_gpu_kernels" > $O/pytest.log 2>&1; echo "pytest rc=$? t=$((SECONDS-S))"; tail -3 $O/pytest.log; grep -E "^FAILED|^E  " $O/pytest.log | head -8
left 30 ab && { timeout $((END - SECONDS + S)) python3 scripts/attention_ab.py $O/ab.json examples/llama-3.2-1b-synthetic.yaml new pdl pdl-no-prefetch > $O/ab.txt 2>&1; echo "ab rc=$? t=$((SECONDS-S))"; grep -v Warn $O/ab.txt | tail -9; }
echo "done t=$((SECONDS-S))"
