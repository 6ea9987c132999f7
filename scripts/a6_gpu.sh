# Helper A6's GPU check of branch h/a6 in one device call (the call its budget did not cover).
# From the repository root with PYTHONPATH=$PWD; needs trtgraph/kernels/attention_old.py (main
# 09b623b's attention.py, copied in beside: `git show 09b623b:trtgraph/kernels/attention.py`)
# for the old kernel of the A/B, and the Triton cache ../u5-tcache.tgz where present.
O=${OUT:-/tmp/a6out}; mkdir -p $O; S=$SECONDS
mkdir -p /tmp/b/artifacts && { tar xzf ../u5-tcache.tgz -C /tmp/b/artifacts 2>/dev/null && echo tcache-ok; }
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels.py tests/test_decode_linear.py \
  tests/test_gpu.py -k "kernels or decode_linear or replay_equals_eager or bitwise_equal_in_every or alone_in_crowds or hf_parity" \
  > $O/pytest_gpu.log 2>&1; echo "pytest rc=$? t=$((SECONDS-S))"; tail -3 $O/pytest_gpu.log; grep -E "^FAILED|^ERROR" $O/pytest_gpu.log
timeout 120 python3 scripts/attention_sweep.py $O/sweep.json > $O/sweep.txt 2>&1; echo "sweep rc=$? t=$((SECONDS-S))"; cat $O/sweep.txt
timeout 150 python3 scripts/attention_ab.py $O/ab.json > $O/ab.txt 2>&1; echo "ab rc=$? t=$((SECONDS-S))"; grep -v Warn $O/ab.txt | tail -12
timeout 90 python3 scripts/profile_step.py examples/llama-3.2-1b-synthetic.yaml 25 > $O/profile.txt 2>&1; echo "profile rc=$? t=$((SECONDS-S))"; grep -E "kernels per step|by family|attn|rope" $O/profile.txt
echo "done t=$((SECONDS-S))"; cd $O && tar czf a6.tgz *.log *.txt *.json 2>/dev/null
