"""Probe (H200): the row-parallel projections at 33-64 rows as cuBLAS partial products over K
slices (one strided-batched GEMM writing fp32 partials) and one Triton kernel that sums them, adds
the residual and applies the next consumer's RMSNorm — against today's cuBLAS `addmm_` (its own
split-K GEMM and reduce) followed by the RMSNorm kernel.

    python3 scripts/splitk_probe.py [--rows 40,48,56,64] [--splits 2,4,8]

Sixteen layers' weights (so L2 never holds them), each variant recorded as one CUDA graph of 16
(projection + norm) pairs, replayed 200 times between events, passes interleaved. Prints µs per
layer, whether each variant's rows are bitwise the same at every row count (a row's result must not
depend on its neighbours) and the largest difference from the fp32 reference.
"""

from __future__ import annotations

import argparse

import torch
import triton

from trtgraph.kernels import triton_ops
from trtgraph.kernels.split_residual import _sum_add_norm_kernel, partials


def split_linear_residual_norm(x, weight, residual, norm_w, eps, splits, norm=True):
    """split_residual's two kernels (norm=False: the sum and the residual only)."""
    M, N = residual.shape
    parts = partials(x, weight, splits)
    out = torch.empty_like(residual) if norm else residual
    _sum_add_norm_kernel[(M,)](parts, residual, norm_w, out, M, N, eps, S=splits, NORM=norm,
                               BLOCK=triton.next_power_of_2(N), num_warps=4)
    return residual, out


def today(x, weight, residual, norm_w, eps, norm=True):
    residual.addmm_(x, weight.t())
    return residual, (triton_ops.rms_norm(residual, norm_w, eps) if norm else residual)


def graph_of(fn, layers):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for args in layers:
                fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for args in layers:
            fn(*args)
    return g


def time_graph(g, n=200):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    e0.record()
    for _ in range(n):
        g.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1000 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="40,48,56,64")
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    dev, dt, L, H, I = torch.device("cuda"), torch.bfloat16, 16, 2048, 8192
    torch.manual_seed(0)
    shapes = {"down": (H, I), "o": (H, H)}
    for name, (N, K) in shapes.items():
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5 for _ in range(L)]
        gs = [torch.rand(N, device=dev, dtype=dt) + 0.5 for _ in range(L)]
        xs = torch.randn(max(rows), K, device=dev, dtype=dt)
        r0 = torch.randn(max(rows), N, device=dev, dtype=dt)
        # invariance and accuracy, one layer
        ref = (r0.float() + xs.float() @ ws[0].float().t())
        variants = {"today": lambda x, w, r, g: today(x, w, r, g, 1e-5, norm=name == "down")}
        for s in splits:
            variants[f"bmm{s}"] = (lambda s: lambda x, w, r, g: split_linear_residual_norm(
                x, w, r, g, 1e-5, s, norm=name == "down"))(s)
        for vname, fn in variants.items():
            outs = {m: fn(xs[:m].contiguous(), ws[0], r0[:m].clone(), gs[0])[0] for m in rows + [1, 8, 32]}
            big = outs[max(rows)]
            inv = all(torch.equal(outs[m], big[:m]) for m in outs)
            err = (big.float() - ref).abs().max().item()
            print(f"{name} {vname}: rows bitwise equal at every count: {inv}; max |diff| vs fp32 {err:.4f}")
        for m in rows:
            res = {v: [] for v in variants}
            layers = {v: [(xs[:m].contiguous(), ws[l], r0[:m].clone(), gs[l]) for l in range(L)] for v in variants}
            graphs = {v: graph_of(fn, layers[v]) for v, fn in variants.items()}
            for _ in range(args.passes):
                for v, g in graphs.items():
                    res[v].append(time_graph(g) / L)
            print(f"{name} rows {m}: " + ", ".join(f"{v} {min(t):.2f}/{sorted(t)[len(t)//2]:.2f}" for v, t in res.items())
                  + " us per layer (min/median)")
            del graphs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
