#!/usr/bin/env bash
# The thirteenth session's device calls (issue 12: why replays slow once a process has recorded a
# few graphs, and the driver-recorded graphs that avoid it). Every figure goes to a file under $OUT.
# Usage: OUT=... CALL=N bash scripts/s13_gpu.sh
#  1 (one H200): driver stream ids made per capture and a 100-kernel graph's replay after 12 more
#    captures per method (scripts/stream_probe.py), then the driver's stream constructors' callers
#    under cuda-gdb (scripts/gdb/stream_create.gdb) for the probe's captures and the runtime's
#    (scripts/replay_drift.py DRIFT=7);
#  2 (one H200): what in graph_count_probe.py's further graphs brings the slow state on (ONESTREAM=1);
#  3, 4, 5 (one H200): stream_probe.py's captures against graph_count_probe.py's, one difference at a
#    time; then torch's capture against a raw (driver) one, one difference at a time;
#  6 (one H200): the driver-recorded graphs in the runtime: the recording's GPU tests and the bs-64
#    key captured six times, recorded by the driver and by torch.cuda.CUDAGraph (TORCH_CAPTURE=1);
#  7 (nvidia-h200-x2): the tree's figures: the GPU suite on GPU 1 (CPUs 16-31) while GPU 0 runs the
#    bench and the step profile, then the same bench with torch-recorded graphs (torch_capture.py);
#  8 (one H200): the recording's GPU tests again (after a change to its failure path) and the step
#    profile of the example config's three profiled keys (call 7's did not come back);
#  9 (one H200): the example config captured, then 256 greedy prompts (128 in, 128 out) run replayed
#    and --eager, compared token for token (scripts/compare_outputs.py);
#  10 (one H200): the bs-1 and bs-64 keys each captured six times (replay_drift.py DRIFT=7 BS=N),
#    recorded by the driver and by torch, alternating;
#  11 (one H200): the recording's GPU tests and the capture / replay tests of tests/test_gpu.py after
#    record() made the device current.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt; T0=$(date +%s); END=${END:-560}
note() { echo "$(( $(date +%s) - T0 ))s $*" >> "$LOG"; }
probe() { echo "## $*" >> "$OUT/probe.txt"; env "$@" timeout 90 python3 "$SCRIPT" $ARGS >> "$OUT/probe.txt" 2>&1; }
GDB="cuda-gdb -batch -x scripts/gdb/stream_create.gdb --args python3"
case ${CALL:?CALL=1..11} in
1) for m in torch raw torchmm rawmm; do
     MODE=ids METHOD=$m timeout 60 python3 scripts/stream_probe.py > "$OUT/ids_$m.txt" 2>&1; note "ids $m rc=$?"
   done
   MODE=gdb METHOD=torchmm timeout 120 $GDB scripts/stream_probe.py > "$OUT/gdb_probe.txt" 2>&1; note "gdb probe rc=$?"
   DRIFT=7 timeout 240 $GDB scripts/replay_drift.py > "$OUT/gdb_drift.txt" 2>&1; note "gdb drift rc=$?" ;;
2) SCRIPT=scripts/graph_count_probe.py ARGS="100 16"
   for v in "CHAIN=params" "CHAIN=params DESTROY=1" "CHAIN=params EXTRA_KERNELS=25" "CHAIN=params EXTRA_KERNELS=400" \
            "CHAIN=triton EXTRA_KERNELS=400" "CHAIN=add EXTRA_KERNELS=400" "CHAIN=mm EXTRA_KERNELS=100"; do
     probe ONESTREAM=1 $v
   done ;;
3) SCRIPT=scripts/stream_probe.py ARGS=
   for v in "METHOD=torch EXTRA_KERNELS=100" "METHOD=raw EXTRA_KERNELS=100" "METHOD=torch ALLOC=1" "METHOD=torch WARM=1" \
            "METHOD=torch ALLOC=1 WARM=1" "METHOD=torch EXTRA_KERNELS=25 ALLOC=1 WARM=1" \
            "METHOD=raw EXTRA_KERNELS=25 ALLOC=1 WARM=1"; do probe $v; done ;;
4) SCRIPT=scripts/stream_probe.py ARGS=
   for v in "METHOD=torch ALLOC=1 NOGRAPHS=1" "METHOD=torch ALLOC=empty" "METHOD=torch UPFRONT=1" \
            "METHOD=torch SCALARS=1" "METHOD=raw UPFRONT=1"; do probe $v; done ;;
5) SCRIPT=scripts/stream_probe.py ARGS=
   for m in torch torch-relaxed torch-flags0 torch-nowait raw raw-global raw-flags9 raw-pool raw-wait; do
     probe METHOD=$m UPFRONT=1
   done
   for m in torch torch-nowait raw raw-wait torch-flags0; do probe METHOD=$m ALLOC=1; done ;;
6) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_gpu.py \
     -k "cuda_graph or capture_parity or replay_equals_eager or bitwise or crowds" > "$OUT/pytest.txt" 2>&1
   note "pytest rc=$?"
   DRIFT=7 timeout 150 python3 scripts/replay_drift.py > "$OUT/drift_driver.txt" 2>&1; note "drift driver rc=$?"
   TORCH_CAPTURE=1 DRIFT=7 timeout 150 python3 scripts/replay_drift.py > "$OUT/drift_torch.txt" 2>&1
   note "drift torch rc=$?" ;;
7) { nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv
     python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
   ( CUDA_VISIBLE_DEVICES=1 timeout $(( END - 10 )) taskset -c 16-31 \
       python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest_gpu.log" 2>&1
     note "pytest rc=$?" ) &
   SUITE=$!
   export CUDA_VISIBLE_DEVICES=0
   P="taskset -c 0-15"
   BENCH="bench --config examples/llama-3.2-1b-synthetic.yaml --prompts 64 --no-hf"
   $P python3 -m trtgraph $BENCH --out /tmp/b > "$OUT/bench.md" 2> "$OUT/bench.err"; note "bench rc=$?"
   cp /tmp/b/bench.json "$OUT/" 2>/dev/null
   $P timeout 90 python3 scripts/profile_step.py /tmp/b/artifacts 25 > "$OUT/profile.txt" 2>&1; note "profile rc=$?"
   LEFT=$(( END - 20 - $(date +%s) + T0 ))
   if [ $LEFT -gt 60 ]; then
     $P timeout $LEFT python3 scripts/torch_capture.py $BENCH --out /tmp/b0 > "$OUT/bench_torch.md" 2> "$OUT/bench_torch.err"
     note "bench torch rc=$?"; cp /tmp/b0/bench.json "$OUT/bench_torch.json" 2>/dev/null
   fi
   wait $SUITE
   tail -3 "$OUT/pytest_gpu.log" >> "$LOG" ;;
8) timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_graph.py > "$OUT/pytest.txt" 2>&1
   note "pytest rc=$?"
   timeout 240 python3 scripts/profile_step.py examples/llama-3.2-1b-synthetic.yaml 25 > "$OUT/profile.txt" 2>&1
   note "profile rc=$?" ;;
9) python3 -m trtgraph capture --config examples/llama-3.2-1b-synthetic.yaml --out /tmp/art > "$OUT/capture.txt" 2>&1
   note "capture rc=$?"
   python3 scripts/make_prompts.py --n 256 --in 128 --out 128 > /tmp/p256.jsonl
   for m in replay eager; do
     python3 -m trtgraph run --prompts /tmp/p256.jsonl --manifest /tmp/art --output /tmp/$m.jsonl \
       --summary-json "$OUT/run_$m.json" $([ $m = eager ] && echo --eager) > "$OUT/run_$m.txt" 2>&1; note "run $m rc=$?"
   done
   python3 scripts/compare_outputs.py /tmp/replay.jsonl /tmp/eager.jsonl > "$OUT/compare.txt" 2>&1; note "compare rc=$?" ;;
10) for bs in 1 64; do
      for t in "" 1 "" 1; do
        echo "## BS=$bs TORCH_CAPTURE=$t" >> "$OUT/drift.txt"
        BS=$bs TORCH_CAPTURE=$t DRIFT=7 timeout 100 python3 scripts/replay_drift.py 2>&1 | grep -E "recorded|ms \(" >> "$OUT/drift.txt"
        note "bs $bs torch=$t rc=$?"
      done
    done ;;
11) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_gpu.py \
      -k "cuda_graph or capture_parity or replay_equals_eager or out_of_memory" > "$OUT/pytest.txt" 2>&1
    note "pytest rc=$?" ;;
esac
