# The replayed bs 40 / 64 step with cuBLAS free to split K (default) and without a workspace
# (CUBLAS_WORKSPACE_CONFIG=:0:0), alternating processes. Usage: OUT=DIR bash scripts/cublas_workspace_ab.sh
for i in 1 2; do
  timeout 80 python3 scripts/decode_ablation.py $OUT/a$i.json examples/llama-3.2-1b-synthetic.yaml light --batches 40,64 2>&1 | grep -E "^light"
  CUBLAS_WORKSPACE_CONFIG=:0:0 timeout 80 python3 scripts/decode_ablation.py $OUT/b$i.json examples/llama-3.2-1b-synthetic.yaml light --batches 40,64 2>&1 | grep -E "^light" | sed 's/^/nows /'
done
