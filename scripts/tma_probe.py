"""Probe (H200, issue 12): a TMA-fed skinny GEMM for the decode step's projections at 33-64 rows.

Every Triton decode kernel of the tree loads its weight tiles with pointer arithmetic (`tl.load`
of a [BLOCK_N, BLOCK_K] tile, which Triton pipelines as cp.async: an address per 16 bytes, LSU
issue, few bytes in flight per program). Here the weight (and optionally x) comes through a host
built tensor descriptor (`triton.tools.tensor_descriptor.TensorDescriptor`, `desc.load([n0, k0])`),
which Triton 3.6 pipelines on sm_90 as TMA copies with mbarriers over `num_stages` buffers.

    y[M, N] = x[M, K] @ W[N, K]^T  (swap-AB: acc [BLOCK_N, BLOCK_T], fp32; bf16 out, fp32 for the LM head)

Variants: tile N 32 / 64 / 128, K step 64 / 128, stages up to 8 (within shared memory), warps 4 / 8,
split-K with fp32 partials summed by the last arriving program (split order fixed: deterministic;
atomics are not tried: their order varies, so replay == eager would not hold bitwise), x through
a descriptor or plain loads, a persistent grid, Triton's warp specialization. MODE 0 plain store,
1 residual add (o, down), 2 paired gate / up rows with RMSNorm in the prologue and SiLU-and-mul in
the epilogue (gate_up, as today's fused kernel). Each timed alone in a CUDA graph over weight
copies (L2 defeated), against today's op at that row count: cuBLAS (qkv F.linear, o addmm_), the
fused Triton kernel (gate_up, LM head; every shape at 8 / 32 rows), the split down projection.

    python3 scripts/tma_probe.py OUT.json [--shapes qkv,o,gate_up,down,lm_head] [--quick]
    TRITON_INTERPRET=1 python3 scripts/tma_probe.py --check   # the kernel (scripts/tma_gemm.py) on the CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tune_linear  # noqa: E402
from tma_gemm import PLAIN, RESIDUAL, SILU, TmaGemm, cpu_check, reference  # noqa: E402


# ---------------------------------------------------------------- the device probe

SHAPES = {"qkv": (3072, 2048, PLAIN), "o": (2048, 2048, RESIDUAL), "gate_up": (16384, 2048, SILU),
          "down": (2048, 8192, RESIDUAL), "lm_head": (128256, 2048, PLAIN)}
SMEM = 200 << 10  # of the 227 KB a program may take: room for the epilogue's layout conversions


def variants(name: str, quick: bool = False) -> list[dict]:
    n, k, mode = SHAPES[name]
    pairs = 2 if mode == SILU else 1
    cols = n // pairs
    out = []
    for bn in (32, 64, 128):
        tiles = cols // bn
        s0 = next((s for s in (1, 2, 4, 8, 16) if tiles * s >= 120), 16)
        for bk in (64, 128):
            splits = sorted({s for s in (s0, 2 * s0) if k // s >= 2 * bk and k % (s * bk) == 0})
            per_stage = (pairs * bn + 64) * bk * 2
            deep = min(8, SMEM // per_stage)
            if deep < 2:
                continue
            for s in splits:
                for st in sorted({min(3, deep), deep}):
                    out.append(dict(bn=bn, bk=bk, split=s, stages=st, warps=4))
    if quick:
        out = out[:4]
    # around the likely best (64-wide tiles, the first split that fills the SMs, deepest pipeline)
    base = [v for v in out if v["bn"] == 64 and v["bk"] == 128] or out
    b = max(base, key=lambda v: (-v["split"], v["stages"]))
    out += [dict(b, warps=8), dict(b, x_tma=False), dict(b, persist=True), dict(b, persist=True, per_sm=2),
            dict(b, ws=True)]
    if name == "lm_head":
        b64 = dict(b, bk=64, stages=min(8, SMEM // ((b["bn"] + 64) * 64 * 2)))
        out += [dict(b64, persist=True), dict(b64, warps=8)]
    return [dict(v) for v in {json.dumps(v, sort_keys=True): v for v in out}.values()]


def make_inputs(name: str, m: int, copies: int, dev, dt=torch.bfloat16):
    n, k, mode = SHAPES[name]
    g = torch.Generator().manual_seed(0)  # row 0 the same at every m
    x = torch.randn((64, k), generator=g)[:m].contiguous().to(dev, dt)
    gd = torch.Generator(device=dev).manual_seed(1)  # the same first weight at every m
    ws = [torch.empty((n, k), device=dev, dtype=dt).normal_(0, k ** -0.5, generator=gd if i == 0 else None)
          for i in range(copies)]
    res = (torch.randn((64, n if mode != SILU else n // 2), generator=g)[:m].contiguous().to(dev, dt)
           if mode == RESIDUAL else None)
    nw = (torch.rand(k, generator=g) + 0.5).to(dev, dt) if mode == SILU else None
    cols = n // 2 if mode == SILU else n
    out = torch.empty((m, cols), device=dev, dtype=torch.float32 if name == "lm_head" else dt)
    return x, ws, res, nw, out


def build(name, cfg, x, ws, res, nw, out):
    n, k, mode = SHAPES[name]
    return TmaGemm(cfg, mode, x, ws, out, residual=res, norm_weight=nw)


def _compile(name, cfg, rows):
    """Compile a variant (cfg None: today's op) at each row count, in a worker process."""
    dev = torch.device("cuda")
    try:
        for m in rows:
            x, ws, res, nw, out = make_inputs(name, m, 1, dev)
            fn = today_call(name, m, x, ws, res, nw, out) if cfg is None else build(name, cfg, x, ws, res, nw, out)
            fn(0)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def today_call(name, m, x, ws, res, nw, out):
    """Today's op at m rows (the tree's dispatch at 33-64 rows; the fused kernel at <= 32)."""
    import torch.nn.functional as F

    from trtgraph.kernels import decode_linear as dl
    from trtgraph.kernels.split_residual import split_linear_residual_norm
    n, k, mode = SHAPES[name]
    ones = torch.ones(k, device=x.device, dtype=x.dtype)
    if m <= 32 or name in ("gate_up", "lm_head"):
        if name == "qkv":  # the fused op with its RoPE tables and cache (its own x)
            from tune_decode_linear import make_call
            return make_call("norm_qkv_rope", n, k, m, ws, True)
        if mode == RESIDUAL:
            return lambda i: dl.FUSED_OPS.linear_residual(x, ws[i % len(ws)], res)
        if mode == SILU:
            return lambda i: dl.FUSED_OPS.norm_gate_up_silu(x, nw, 1e-5, ws[i % len(ws)])
        return lambda i: dl.FUSED_OPS.norm_linear(x, ones, 1e-5, ws[i % len(ws)], None, torch.float32)
    if name == "down":
        nwd = torch.ones(n, device=x.device, dtype=x.dtype)
        return lambda i: split_linear_residual_norm(x, ws[i % len(ws)], res, nwd, 1e-5, splits=4)
    if name == "o":
        return lambda i: res.addmm_(x, ws[i % len(ws)].t())
    return lambda i: F.linear(x, ws[i % len(ws)])


def cublas_call(name, x, ws, res):
    import torch.nn.functional as F
    if SHAPES[name][2] == RESIDUAL:
        return lambda i: res.addmm_(x, ws[i % len(ws)].t())
    return lambda i: F.linear(x, ws[i % len(ws)])


def graph_time(fn, calls: int, reps: int = 7) -> float:
    """Microseconds per call of fn(i), replayed from one CUDA graph (tune_linear's, median of 7)."""
    return tune_linear.graph_time(fn, calls, reps) * 1e6


def check_gpu(name, cfg, dev):
    """Accuracy at 64 rows against fp32, the rows at 33 / 40 bitwise those at 64, and a graph
    replay bitwise its eager run -> (rel err, invariant, replay == eager)."""
    n, k, mode = SHAPES[name]
    outs = {}
    for m in (33, 40, 64):
        x, ws, res, nw, out = make_inputs(name, m, 1, dev)
        r0 = res.clone() if res is not None else None
        outs[m] = build(name, cfg, x, ws, res, nw, out)(0).clone()
        if m == 64:
            ref = reference(mode, x, ws[0], r0, nw)
            err = ((outs[m].float() - ref).norm() / ref.norm()).item()
            if res is not None:
                res.copy_(r0)
            op = build(name, cfg, x, ws, res, nw, out)
            g = torch.cuda.CUDAGraph()
            op(0)
            if res is not None:
                res.copy_(r0)
            with torch.cuda.graph(g):
                op(0)
            out.fill_(float("nan"))
            if res is not None:
                res.copy_(r0)
            g.replay()
            torch.cuda.synchronize()
            replay = torch.equal(out, outs[64])
    inv = all(torch.equal(outs[m], outs[64][:m]) for m in (33, 40))
    return err, inv, replay


def time_rows(nm, m, keys, copies, dev, row, errors):
    """Today's op, cuBLAS and the variants `keys` at m rows -> row {label: us}."""
    n, k, mode = SHAPES[nm]
    calls = max(copies, 16)
    x, ws, r, nw, out = make_inputs(nm, m, copies, dev)
    fn = today_call(nm, m, x, ws, r, nw, out)
    if fn is not None:
        row["today"] = graph_time(fn, calls)
    if mode != SILU:
        row["cublas"] = graph_time(cublas_call(nm, x, ws, r), calls)
    for key in keys:
        try:
            row[key] = graph_time(build(nm, json.loads(key), x, ws, r, nw, out), calls)
        except Exception as e:  # noqa: BLE001
            errors[f"{nm} {key} m={m}"] = f"{type(e).__name__}: {str(e)[:160]}"
    del x, ws
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dest", nargs="?")
    ap.add_argument("--shapes", default="gate_up,down,qkv,o,lm_head")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--check", action="store_true", help="the kernel against torch (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: skip the 8 / 32-row round past it")
    ap.add_argument("--head", action="store_true", help="the shipped TMA LM head against the fused GEMV, alone")
    args = ap.parse_args()
    if args.check:
        return cpu_check()
    if args.head:
        return head_ab(args.dest)
    from trtgraph.bench import measure_bandwidth
    t_start = time.time()
    dev = torch.device("cuda")
    names = args.shapes.split(",")
    jobs = [(nm, v) for nm in names for v in variants(nm, args.quick)]
    pool = cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn"))
    first = [(nm, v, (64,)) for nm, v in jobs] + [(nm, None, (64, 32, 8)) for nm in names]
    errs = list(pool.map(_compile, *zip(*first)))[:len(jobs)]
    bw = measure_bandwidth(dev)
    print(f"triton {triton.__version__}, torch {torch.__version__}; compiled {len(jobs)} variants in "
          f"{time.time() - t_start:.0f} s; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    out = {"bandwidth_GBps": bw / 1e9, "errors": {}, "shapes": {}}
    for (nm, v), e in zip(jobs, errs):
        if e:
            out["errors"][f"{nm} {json.dumps(v, sort_keys=True)}"] = e
    best = {}
    for nm in names:  # every variant at 64 and 40 rows
        n, k, mode = SHAPES[nm]
        copies = max(2, min(16, -(-(512 << 20) // (n * k * 2))))
        rec = out["shapes"][nm] = {"MB": n * k * 2 / 1e6, "copies": copies, "rows": {}}
        keys = [json.dumps(v, sort_keys=True) for (j, v), e in zip(jobs, errs) if j == nm and not e]
        for m in (64, 40):
            time_rows(nm, m, keys, copies, dev, rec["rows"].setdefault(m, {}), out["errors"])
        best[nm] = sorted(keys, key=lambda k_: rec["rows"][64].get(k_, 1e9))[:2]
        print(f"{nm}: {len(keys)} variants timed, t={time.time() - t_start:.0f} s", flush=True)
        dump(args.dest, out)
    if time.time() - t_start < args.budget:  # the best two at the fused kernel's row counts (8, 32) too
        second = [(nm, json.loads(key), (32, 8)) for nm in names for key in best[nm]]
        list(pool.map(_compile, *zip(*second)))
        for nm in names:
            rec = out["shapes"][nm]
            for m in (32, 8):
                time_rows(nm, m, best[nm], rec["copies"], dev, rec["rows"].setdefault(m, {}), out["errors"])
    pool.shutdown()
    for nm in names:
        rec = out["shapes"][nm]
        rec["checks"] = {key: check_gpu(nm, json.loads(key), dev) for key in best[nm]}
        dump(args.dest, out)
        report(nm, rec, bw)
    print(f"\nerrors: {len(out['errors'])}; wall {time.time() - t_start:.0f} s")
    for k_, e in list(out["errors"].items())[:12]:
        print(f"  {k_}: {e}")


def dump(dest, out):
    if dest:
        with open(dest, "w") as f:
            json.dump(out, f, indent=1)


def report(nm, rec, bw):
    n, k, mode = SHAPES[nm]
    nbytes = n * k * 2
    print(f"\n{nm} N={n} K={k} ({nbytes / 1e6:.1f} MB)")
    for m, row in rec["rows"].items():
        top = sorted(row.items(), key=lambda kv: kv[1])
        print(f"  T={m}: " + "; ".join(f"{k_} {t:.2f} us ({nbytes / (t * 1e-6) / bw:.0%})" for k_, t in top[:3])
              + "".join(f"; {lab} {row[lab]:.2f}" for lab in ("today", "cublas")
                        if lab in row and lab not in dict(top[:3])), flush=True)
    for key, (err, inv, rep) in rec["checks"].items():
        print(f"  check {key}: rel err {err:.2e}, rows invariant 33/40/64 {inv}, replay == eager {rep}")


def head_ab(dest, passes: int = 5) -> None:
    """kernels/tma_head.py (decode_tuned.TMA_HEAD's config) against the fused GEMV as the 33-64-row
    step runs it (the norm hoisted: no norm, no row pass), greedy (argmax in the epilogue) and plain
    fp32 logits, at 33-64 rows: one CUDA graph of 16 calls over two weight copies per (op, rows),
    passes interleaved; us per call, min / median over the passes."""
    from trtgraph.bench import measure_bandwidth
    from trtgraph.kernels import decode_linear as dl
    from trtgraph.kernels import tma_head
    dev, (v, k) = torch.device("cuda"), (128256, 2048)
    ws = [torch.empty((v, k), device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5) for _ in range(2)]
    ops = {"fused argmax": lambda x, w, t: dl.norm_linear_argmax(x, None, 1e-5, w, t),
           "tma argmax": lambda x, w, t: tma_head.linear_argmax(x, w, t, config=decode_tuned_head()),
           "fused plain": lambda x, w, t: dl.norm_linear(x, None, 1e-5, w, None, torch.float32),
           "tma plain": lambda x, w, t: tma_head.linear(x, w, config=decode_tuned_head())}
    graphs = {}
    for m in (33, 40, 48, 56, 64):
        x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        tok = torch.empty(m, dtype=torch.int64, device=dev)
        for name, fn in ops.items():
            graphs[(name, m)] = (lambda fn, x, tok: lambda i: fn(x, ws[i % 2], tok))(fn, x, tok)
    bw = measure_bandwidth(dev)
    times = {key: [] for key in graphs}
    for _ in range(passes):
        for key, fn in graphs.items():
            times[key].append(graph_time(fn, 16))
    out = {f"{name} {m}": t for (name, m), t in times.items()}
    for (name, m), t in times.items():
        print(f"{name:13s} T={m}: {min(t):7.2f} / {sorted(t)[len(t) // 2]:7.2f} us "
              f"({v * k * 2 / (min(t) * 1e-6) / bw:.0%} of {bw / 1e9:.0f} GB/s)", flush=True)
    dump(dest, {"bandwidth_GBps": bw / 1e9, "us": out})


def decode_tuned_head():
    from trtgraph.kernels import decode_tuned
    return decode_tuned.TMA_HEAD[(128256, 2048)]


if __name__ == "__main__":
    main()
