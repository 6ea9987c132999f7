"""Tune the batch-invariant linear kernel's launch config per Llama-3.2-1B layer shape (bf16),
one config per shape for every M, and measure it against cuBLAS and the HBM bandwidth.

Prints: measured copy bandwidth; per shape the best configs (us at M = 1, 16, 64, fraction
of bandwidth), cuBLAS alone; prefill M = 2048 against cuBLAS; whether one row's output is
bitwise equal across M for the Triton kernel and for cuBLAS; peak bf16 FLOP/s.
Usage: python scripts/tune_linear.py OUT.json [SHAPE ...]
"""

import itertools
import json
import sys

import torch
import torch.nn.functional as F

from trtgraph.bench import measure_bandwidth
from trtgraph.kernels import linear as lin

DEV = torch.device("cuda")
DT = torch.bfloat16
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}
CONFIGS = [c for c in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4, 5))]
CONFIGS += [(64, bk, 8, st) for bk in (128, 256) for st in (3, 4)] + [(128, 128, 8, 3), (128, 128, 4, 3)]


def graph_time(fn, calls: int, reps: int = 5) -> float:
    """Seconds per call of fn(i) for i in range(calls), replayed from one CUDA graph (the median
    of `reps` replays)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return sorted(times)[reps // 2]


def make_call(n, k, m, ws, use_triton=True):
    """fn(i) multiplying [m, k] rows by weight copy i % len(ws) (the copies defeat L2)."""
    x = torch.randn((m, k), device=DEV, dtype=DT)
    gemm = lin.triton_linear if use_triton else F.linear
    return lambda i: gemm(x, ws[i % len(ws)])


def tune_shape(name, n, k, bw, out):
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5 for _ in range(copies)]
    calls = max(copies, 8)
    nbytes = n * k * 2
    rows = []
    for cfg in CONFIGS:
        bn, bk, warps, stages = cfg
        lin._TUNED[(n, k)] = cfg
        try:
            t = {m: graph_time(make_call(n, k, m, ws), calls) for m in (1, 16, 64)}
        except Exception as e:  # out of shared memory and the like: not a candidate
            print(f"  {name} {cfg}: {type(e).__name__}", file=sys.stderr)
            continue
        rows.append((t[1] + t[64], cfg, t))
    rows.sort(key=lambda r: r[0])
    cub = {m: graph_time(make_call(n, k, m, ws, use_triton=False), calls) for m in (1, 16, 64)}
    print(f"\n{name} N={n} K={k} ({nbytes / 1e6:.1f} MB): cuBLAS " +
          ", ".join(f"M={m} {t * 1e6:.1f} us ({nbytes / t / bw:.0%})" for m, t in cub.items()))
    for _, cfg, t in rows[:5]:
        print(f"  {cfg}: " + ", ".join(f"M={m} {v * 1e6:.1f} us ({nbytes / v / bw:.0%})" for m, v in t.items()))
    best = rows[0][1]
    lin._TUNED[(n, k)] = best
    pre_t = graph_time(make_call(n, k, 2048, ws[:2]), 2)
    pre_c = graph_time(make_call(n, k, 2048, ws[:2], use_triton=False), 2)
    print(f"  prefill M=2048: triton {pre_t * 1e6:.1f} us, cuBLAS {pre_c * 1e6:.1f} us ({pre_t / pre_c:.2f}x)")
    out[name] = {"n": n, "k": k, "config": best, "triton_us": {m: v * 1e6 for m, v in rows[0][2].items()},
                 "cublas_us": {m: v * 1e6 for m, v in cub.items()}, "bw_frac": {m: nbytes / v / bw for m, v in rows[0][2].items()},
                 "prefill2048_us": {"triton": pre_t * 1e6, "cublas": pre_c * 1e6}}
    invariance(name, n, k, ws[0], out)


def invariance(name, n, k, w, out):
    """Row 0 bitwise equal for M in 1..2048, Triton and cuBLAS."""
    x = torch.randn((2048, k), device=DEV, dtype=DT)
    eq_t, eq_c = True, True
    ref_t, ref_c = lin.triton_linear(x[:1], w), F.linear(x[:1], w)
    for m in (2, 3, 8, 17, 32, 64, 65, 256, 2048):
        eq_t &= torch.equal(lin.triton_linear(x[:m], w)[:1], ref_t)
        eq_c &= torch.equal(F.linear(x[:m], w)[:1], ref_c)
    print(f"  row 0 bitwise equal for M in 1..2048: triton {eq_t}, cuBLAS {eq_c}")
    out[name]["invariant"] = {"triton": eq_t, "cublas": eq_c}


def peak_flops(out):
    a = torch.randn((8192, 8192), device=DEV, dtype=DT)
    t = graph_time(lambda i: a @ a, 5)
    out["peak_bf16_tflops"] = 2 * 8192 ** 3 / t / 1e12
    print(f"peak bf16 matmul: {out['peak_bf16_tflops']:.0f} TFLOP/s")


def main():
    bw = measure_bandwidth(DEV)
    out = {"bandwidth_GBps": bw / 1e9}
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    for name in sys.argv[2:] or SHAPES:
        tune_shape(name, *SHAPES[name], bw, out)
    peak_flops(out)
    print("\n_TUNED = " + repr({(v["n"], v["k"]): tuple(v["config"]) for v in out.values() if isinstance(v, dict) and "config" in v}))
    with open(sys.argv[1] if len(sys.argv) > 1 else "tune.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
