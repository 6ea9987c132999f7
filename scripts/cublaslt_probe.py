"""Probe (H200): do cuBLASLt algorithms other than the one torch's GEMM picks run the 17-64-row
projections (qkv, o + residual, the down projection's fp32 K-slice partials) faster?

    python3 scripts/cublaslt_probe.py OUT.json [--rows 24,32,48,64] [--top 16]

For each op and row count: torch's call (what the step runs today) against every algorithm
cuBLASLt's heuristic offers (up to --top) and, for each, split-K counts 1/2/4/8 set through the
algorithm's config (validated by cublasLtMatmulAlgoCheck). Sixteen layers' weights (so L2 never
holds them), each variant one CUDA graph of 16 calls, median of 5 x 20 replays, us per call.
Each variant's output is checked against torch's (max abs difference printed). cuBLASLt is
reached through ctypes on the library torch already loaded.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from splitk_probe import graph_of, time_graph  # noqa: E402

CUDA_R_32F, CUDA_R_16BF = 0, 14
COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB = 3, 4
LAYOUT_BATCH_COUNT, LAYOUT_BATCH_OFFSET = 5, 6
PREF_MAX_WORKSPACE = 1
CFG_SPLITK, CFG_REDUCTION = 2, 3
WORKSPACE = 64 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _lib():
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    return ctypes.CDLL(sorted(paths)[0])


LT = _lib()
HANDLE = ctypes.c_void_p()
assert LT.cublasLtCreate(ctypes.byref(HANDLE)) == 0


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


def _layout(dtype, rows, cols, ld, batch=1, offset=0):
    h = ctypes.c_void_p()
    _check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(h), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                         ctypes.c_int64(ld)), "layout")
    if batch > 1:
        b, o = ctypes.c_int32(batch), ctypes.c_int64(offset)
        _check(LT.cublasLtMatrixLayoutSetAttribute(h, LAYOUT_BATCH_COUNT, ctypes.byref(b), ctypes.c_size_t(4)), "batch")
        _check(LT.cublasLtMatrixLayoutSetAttribute(h, LAYOUT_BATCH_OFFSET, ctypes.byref(o), ctypes.c_size_t(8)), "offset")
    return h


class Gemm:
    """D[M, N] (row-major) = alpha * x[M, K] @ W[N, K].T + beta * C, as column-major
    D^T = W (transposed) @ x^T; `batch` K slices of width K / batch (the partials)."""

    def __init__(self, M, N, K, out_dtype, beta, batch=1):
        self.M, self.N, self.K, self.beta, self.batch = M, N, K, beta, batch
        kc = K // batch
        self.desc = ctypes.c_void_p()
        _check(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, CUDA_R_32F), "desc")
        t, n = ctypes.c_int32(1), ctypes.c_int32(0)
        _check(LT.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSA, ctypes.byref(t), ctypes.c_size_t(4)), "transa")
        _check(LT.cublasLtMatmulDescSetAttribute(self.desc, DESC_TRANSB, ctypes.byref(n), ctypes.c_size_t(4)), "transb")
        self.a = _layout(CUDA_R_16BF, kc, N, K, batch, kc)
        self.b = _layout(CUDA_R_16BF, kc, M, K, batch, kc)
        od = CUDA_R_32F if out_dtype == torch.float32 else CUDA_R_16BF
        self.c = _layout(od, N, M, N, batch, M * N)
        self.alpha, self.beta_c = ctypes.c_float(1.0), ctypes.c_float(beta)

    def heuristics(self, top):
        pref = ctypes.c_void_p()
        _check(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        _check(LT.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), ctypes.c_size_t(8)), "ws")
        res = (Heuristic * top)()
        count = ctypes.c_int()
        _check(LT.cublasLtMatmulAlgoGetHeuristic(HANDLE, self.desc, self.a, self.b, self.c, self.c, pref, top,
                                                 res, ctypes.byref(count)), "heuristic")
        return [res[i] for i in range(count.value) if res[i].state == 0]

    def variant(self, algo, splitk):
        """A copy of `algo` with its split-K count set, or None where cuBLASLt refuses it."""
        a = Algo()
        ctypes.memmove(ctypes.byref(a), ctypes.byref(algo), ctypes.sizeof(Algo))
        s = ctypes.c_uint32(splitk)
        if LT.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(a), CFG_SPLITK, ctypes.byref(s), ctypes.c_size_t(4)) != 0:
            return None
        if splitk > 1:
            r = ctypes.c_uint32(1)  # in place; the check below refuses what this algorithm cannot do
            for scheme in (1, 2, 4):
                r.value = scheme
                LT.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(a), CFG_REDUCTION, ctypes.byref(r), ctypes.c_size_t(4))
                h = Heuristic()
                if LT.cublasLtMatmulAlgoCheck(HANDLE, self.desc, self.a, self.b, self.c, self.c, ctypes.byref(a),
                                              ctypes.byref(h)) == 0 and h.workspace <= WORKSPACE:
                    return a
            return None
        h = Heuristic()
        ok = LT.cublasLtMatmulAlgoCheck(HANDLE, self.desc, self.a, self.b, self.c, self.c, ctypes.byref(a),
                                        ctypes.byref(h)) == 0
        return a if ok and h.workspace <= WORKSPACE else None

    def run(self, algo, x, w, d, ws):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(LT.cublasLtMatmul(HANDLE, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
                                 ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta_c),
                                 ctypes.c_void_p(d.data_ptr()), self.c, ctypes.c_void_p(d.data_ptr()), self.c,
                                 ctypes.byref(algo), ctypes.c_void_p(ws.data_ptr()), ctypes.c_size_t(WORKSPACE),
                                 stream), "matmul")


def graph_time(fn, layers):
    """us a call: median of 5 x 20 replays of one graph of the calls (splitk_probe's graph and timer)."""
    g = graph_of(fn, layers)
    return statistics.median(time_graph(g, 20) / len(layers) for _ in range(5))


def torch_op(kind, splits):
    """What the step calls today, writing d where torch has an out= form (the partials allocate)."""
    from trtgraph.kernels.split_residual import partials
    if kind == "qkv":
        return lambda x, w, d: torch.mm(x, w.t(), out=d)
    if kind == "o":
        return lambda x, w, d: d.addmm_(x, w.t())
    return lambda x, w, d: partials(x, w, splits)


def probe(kind, M, top, layers_n=16):
    N, K, splits = {"qkv": (3072, 2048, 1), "o": (2048, 2048, 1), "down": (2048, 8192, 4)}[kind]
    dev = torch.device("cuda")
    out_dtype = torch.float32 if kind == "down" else torch.bfloat16
    g = Gemm(M, N, K, out_dtype, beta=1.0 if kind == "o" else 0.0, batch=splits)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device=dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    ws_w = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(layers_n)]
    shape = (splits, M, N) if kind == "down" else (M, N)
    outs = [torch.zeros(shape, device=dev, dtype=out_dtype) for _ in range(layers_n)]
    ref_fn = torch_op(kind, splits)
    ref = torch.zeros(shape, device=dev, dtype=out_dtype)
    got = ref_fn(x, ws_w[0], ref)
    ref = got if kind == "down" else ref
    rows = [{"variant": "torch", "us": graph_time(ref_fn, [(x, w, d) for w, d in zip(ws_w, outs)])}]
    seen = set()
    for i, h in enumerate(g.heuristics(top)):
        for sk in (None, 1, 2, 4, 8):
            a = h.algo if sk is None else g.variant(h.algo, sk)
            if a is None:
                continue
            key = bytes(a.data)
            if key in seen:
                continue
            seen.add(key)
            d = torch.zeros(shape, device=dev, dtype=out_dtype)
            try:
                g.run(a, x, ws_w[0], d, ws)
                torch.cuda.synchronize()
                err = (d.float() - ref.float()).abs().max().item()
                us = graph_time(lambda x_, w_, d_: g.run(a, x_, w_, d_, ws), [(x, w, o) for w, o in zip(ws_w, outs)])
            except RuntimeError as e:
                rows.append({"variant": f"h{i} sk{sk}", "error": str(e)})
                continue
            rows.append({"variant": f"h{i} sk{sk}", "us": us, "err": err, "waves": h.waves,
                         "algo": [int(v) for v in a.data[:2]]})
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="24,32,48,64")
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--ops", default="qkv,o,down")
    args = p.parse_args()
    result = {}
    for kind in args.ops.split(","):
        for M in (int(r) for r in args.rows.split(",")):
            rows = probe(kind, M, args.top)
            result[f"{kind}@{M}"] = rows
            base = rows[0]["us"]
            best = sorted((r for r in rows[1:] if "us" in r and r["err"] < 0.05), key=lambda r: r["us"])[:5]
            print(f"{kind} M={M}: torch {base:.2f} us; best Lt: "
                  + ", ".join(f"{r['variant']} {r['us']:.2f} (err {r['err']:.1e})" for r in best), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
