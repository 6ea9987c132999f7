"""Where a decode step's GPU time goes: kernel count and per-kernel time of one step, from
the eager run of the same kernels a graph replays; the time per kernel family, and the matrix
multiplies' (fused decode GEMVs and cuBLAS / Triton GEMMs) fraction of the measured copy
bandwidth for the weight bytes they read.

Usage: python scripts/profile_step.py ARTIFACTS|CONFIG.yaml [TOP] [--batches B1,B2,...]  (a config
builds the profiled keys only, no capture; TOP kernels listed per key, 12 by default; the keys: greedy
decode at batch 1 and 64 and sampled at 64, or with --batches greedy decode at those batch sizes;
--margin X sets linear.TRITON_MARGIN for a config's timed GEMM choice, over the profiled keys' rows)"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from trtgraph.bench import decode_rows, measure_bandwidth
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.compiler.pipeline import resolve_max_seq_len
from trtgraph.config import Config
from trtgraph.artifacts import load_manifest
from trtgraph.runtime.step.executor import Executor

# kernel families by name fragment, first match wins; "matmul" is what reads the weights
# (`_sum_add_norm`: the split down projection's reduce, which also takes the next norm, counted as
# the matmul's as cuBLAS's own split-K reduce is)
FAMILIES = (("matmul", ("_decode_kernel", "_light_kernel", "_tma_head_kernel", "gemm", "gemv", "nvjet", "cutlass",
                        "_linear_kernel", "splitk", "sm90", "_sum_add_norm")),
            ("attention", ("attn",)), ("norm", ("rms_norm", "embed_norm")), ("rope", ("rope",)), ("silu", ("silu",)),
            ("sampler", ("sample", "gumbel", "argmax", "topk", "process", "logit")))
KEYS = (GraphKey(1, 0, 0, "greedy"), GraphKey(64, 0, 0, "greedy"), GraphKey(64, 0, 0, "sampled"))
if "--batches" in sys.argv:
    KEYS = tuple(GraphKey(int(b), 0, 0, "greedy") for b in sys.argv[sys.argv.index("--batches") + 1].split(","))
    del sys.argv[sys.argv.index("--batches"):sys.argv.index("--batches") + 2]
if "--margin" in sys.argv:  # linear.TRITON_MARGIN for the GEMM backends' timed choice (0: cuBLAS wherever allowed)
    from trtgraph.kernels import linear

    linear.TRITON_MARGIN = float(sys.argv[sys.argv.index("--margin") + 1])
    del sys.argv[sys.argv.index("--margin"):sys.argv.index("--margin") + 2]
TOP = int(sys.argv[2]) if len(sys.argv) > 2 else 12
if sys.argv[1].endswith((".yaml", ".yml")):
    cfg, _ = resolve_max_seq_len(Config.from_yaml(sys.argv[1]), torch.device("cuda"))  # `auto` as capture takes it
    ex = Executor.build(cfg, BucketPlan.from_config(cfg).with_keys(list(KEYS)))
else:
    manifest = load_manifest(sys.argv[1])  # eager only: the executor the manifest describes, no re-recording
    ex = Executor.build(manifest.app_config(), manifest.plan(), from_manifest=True,
                        linear_record=manifest.totals.get("linear_backends"))
if ex.model.ops.name == "triton":
    from trtgraph.kernels.linear import installed_backends, installed_times

    from trtgraph.kernels.linear import _ROW_TIMES

    print("gemm backends", installed_backends(), "times (us over the keys' rows)", installed_times())
    for (n, k), per in _ROW_TIMES.items():  # us a call at each row count
        print(f"gemm {n}x{k}", "; ".join(f"{b} " + " ".join(f"{m}:{us:.1f}" for m, us in t.items())
                                        for b, t in per.items()))
BW = measure_bandwidth(ex.device) / 1e9
LM_HEAD = ex.model.lm_head_weight
WEIGHT_BYTES = LM_HEAD.numel() * LM_HEAD.element_size() + sum(  # every matrix a decode step reads once
    p.numel() * p.element_size() for n, p in ex.model.named_parameters() if p.dim() == 2 and p is not LM_HEAD
    and not n.startswith("embed_tokens"))
for key in (k for k in KEYS if k in ex.plan.keys):
    ex.prepare(key, decode_rows(ex, key.batch_size, 128))
    with torch.inference_mode():
        for _ in range(3):
            ex.execute(key, eager=True)
        torch.cuda.synchronize()
        steps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                ex.execute(key, eager=True)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events) / steps
    count = sum(e.count for e in events) / steps
    print(f"\n{key}: {count:.0f} kernels per step, {total / 1e3:.3f} ms of kernel time per step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:TOP]:
        print(f"  {e.device_time_total / steps / 1e3:7.3f} ms  x{e.count // steps:<4} {e.key[:90]}")
    fam: dict[str, list[float]] = {}
    for e in events:
        name = next((f for f, frags in FAMILIES if any(x in e.key.lower() for x in frags)), "other")
        t = fam.setdefault(name, [0.0, 0.0])
        t[0] += e.device_time_total / steps / 1e3
        t[1] += e.count / steps
    by_time = sorted(fam.items(), key=lambda i: -i[1][0])
    print("  by family: " + ", ".join(f"{f} {t[0]:.3f} ms x{t[1]:.0f}" for f, t in by_time))
    if "matmul" in fam:
        gbps = WEIGHT_BYTES / (fam["matmul"][0] / 1e3) / 1e9
        print(f"  matmuls: {WEIGHT_BYTES / 1e6:.0f} MB of weights in {fam['matmul'][0]:.3f} ms = {gbps:.0f} GB/s, "
              f"{gbps / BW:.0%} of the copy bandwidth ({BW:.0f} GB/s)")
