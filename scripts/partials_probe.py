"""Probe (H200, issue 12, eleventh session): where the 33-64-row decode step could still shed time
(docs/performance.md, eleventh session, has the figures and what was kept).

- `qkv`, `o`, `down` (--only): each projection alone at 40 / 64 rows, today's cuBLAS op (qkv
  `F.linear`, o `addmm_` with the residual, down 4 K-slice partials by `bmm`) against K-slice fp32
  partial products [S, T, N] by cuBLAS `bmm` (S = 2, 4, 8) and by a TMA-fed Triton kernel, one
  program per (N tile, slice), no reduce (`_partials_kernel`): what writing partials for the next
  kernel to sum would save before that kernel's extra reads.
- `layout`: cuBLAS by weight layout, today's [N, K] (x @ W^T) against a transposed copy [K, N],
  under both `torch.backends.cuda.preferred_blas_library` choices.
- `seg`: o -> norm + gate_up + SiLU over 16 layers as the step runs it (cuBLAS `addmm_`, then the
  fused kernel norming x in its K loop) against o as split_residual's partials + sum + norm kernel,
  gate_up then streaming normed x; and gate_up alone with / without its norm.
- `head`: the TMA LM head (kernels/tma_head.py) per config, fp32 logits alone (`plain`), with the
  shipped argmax epilogue (`today`: atomic row maxima + the m-tile's arrival), and with the tile's
  row maxima stored per tile and reduced by a second kernel of one program per row (`tiles`).
- `nostore` (twelfth session): the greedy head with its fp32 logits stored and with the tokens
  alone (no logits written): the TMA head at 33-64 rows, the fused GEMV (norm row pass) below.

Each variant is one CUDA graph of 16 calls over weight copies (L2 defeated), passes interleaved;
us per call, min / median. Partial sums and tokens are checked against the shipped ops first.

    python3 scripts/partials_probe.py [--rows 40,64] [--passes 5] [--only qkv,o,down,layout,seg,head,nostore]
        [--head-configs 128x64x4x4,...]   (BLOCK_N x BLOCK_K x stages x warps)
    TRITON_INTERPRET=1 python3 scripts/partials_probe.py --check   # the kernels on the CPU
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trtgraph.kernels import tma_head  # noqa: E402
from trtgraph.kernels.split_residual import partials  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from argmax_probe import _head  # noqa: E402  (tma_head's GEMM with per-tile maxima; ROW_MAJOR: best[row, tile])


@triton.jit
def _partials_kernel(x_desc, w_desc, out_ptr, M, N, KS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_T: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """Program (n tile, slice s): out[s, rows, cols] = x[:, slice] @ W[cols, slice]^T in fp32."""
    n0 = tl.program_id(0) * BLOCK_N
    s = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in tl.range(s * KS, s * KS + KS, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(w_desc.load([n0, k0]), tl.trans(x_desc.load([0, k0])), acc, input_precision=PRECISION)
    rows = tl.arange(0, BLOCK_T)
    cols = n0 + tl.arange(0, BLOCK_N)
    dst = out_ptr + (s * M + rows[None, :]) * N + cols[:, None]
    tl.store(dst, acc, mask=(rows < M)[None, :] & (cols < N)[:, None])


def triton_partials(x, w, splits, cfg, out=None):
    bn, bk, stages, warps = cfg
    (T, K), N = x.shape, w.shape[0]
    out = torch.empty((splits, T, N), dtype=torch.float32, device=x.device) if out is None else out
    _partials_kernel[(triton.cdiv(N, bn), splits)](
        TensorDescriptor.from_tensor(x, [64, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), out, T, N, K // splits,
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=64, STAGES=stages,
        PRECISION="ieee" if w.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _row_tokens(best_ptr, tok_ptr, TILES, BLOCK: tl.constexpr):
    """One program per row: the maximum of its tiles' packed maxima -> the token."""
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK)
    best = tl.max(tl.load(best_ptr + row * TILES + t, mask=t < TILES, other=-1), axis=0)
    tl.store(tok_ptr + row, 16777215 - (best & 16777215))


class TileHead:
    def __init__(self, x, n_cols, tokens, cfg):
        self.x, self.tok, self.cfg = x, tokens, cfg
        self.tiles = triton.cdiv(n_cols, cfg[0])
        self.best = torch.empty((x.shape[0], self.tiles), dtype=torch.int64, device=x.device)

    def __call__(self, w):
        bn, bk, stages, warps = self.cfg
        T, K = self.x.shape
        out = torch.empty((T, w.shape[0]), dtype=torch.float32, device=self.x.device)
        _head[(1, self.tiles)](
            TensorDescriptor.from_tensor(self.x, [64, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), out, self.best,
            T, w.shape[0], K, out.stride(0), BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=64, STAGES=stages, PER_TILE=True,
            PRECISION="ieee" if w.dtype == torch.float32 else "tf32", TILES=self.tiles, ROW_MAJOR=True,
            num_warps=warps, num_stages=stages)
        _row_tokens[(T,)](self.best, self.tok, self.tiles, BLOCK=triton.next_power_of_2(self.tiles), num_warps=4)
        return out


def head_variants(x, n_cols, configs):
    out, toks = {}, {}
    for cfg in configs:
        c = "x".join(map(str, cfg))
        toks[f"today {c}"] = t1 = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        toks[f"tiles {c}"] = t2 = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        out[f"plain {c}"] = (lambda cfg: lambda w: tma_head.linear(x, w, config=cfg))(cfg)
        out[f"today {c}"] = (lambda cfg, t: lambda w: tma_head.linear_argmax(x, w, t, config=cfg))(cfg, t1)
        out[f"tiles {c}"] = (lambda h: lambda w: h(w))(TileHead(x, n_cols, t2, cfg))
    return toks, out


def check() -> None:
    g = torch.Generator().manual_seed(0)
    for T in (33, 64):
        x = torch.randn((T, 256), generator=g)
        w = torch.randn((200, 256), generator=g) / 10
        w[150] = w[7]
        ref = x @ w.t()
        for s, cfg in ((2, (64, 64, 2, 4)), (4, (32, 64, 1, 4))):
            p = triton_partials(x, w, s, cfg)
            torch.testing.assert_close(p.sum(0), ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(p, partials(x, w, s), atol=1e-4, rtol=1e-4)
        toks, fns = head_variants(x, 200, [(64, 64, 2, 4)])
        outs = {n: fn(w) for n, fn in fns.items()}
        assert all(torch.equal(o, outs["plain 64x64x2x4"]) for o in outs.values())
        assert torch.equal(toks["tiles 64x64x2x4"], toks["today 64x64x2x4"]), T
        assert torch.equal(toks["tiles 64x64x2x4"], ref.argmax(1)), T
    print("ok: partials sum to x @ W^T; the per-tile argmax equals the shipped epilogue's")


def timed(fns, passes, graph_time):
    times = {key: [] for key in fns}
    for _ in range(passes):
        for key, fn in fns.items():
            times[key].append(graph_time(fn, 16))
    for key, t in times.items():
        print(f"{key:32s} {min(t):7.2f} / {sorted(t)[len(t) // 2]:7.2f} us (min / median of {passes})", flush=True)


def layer_fns(name, n, k, m, dev):
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.empty((n, k), device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5) for _ in range(copies)]
    x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
    res = torch.randn((m, n), device=dev, dtype=torch.bfloat16)
    fns = {}
    if name == "o":
        fns[f"{name} T={m} addmm_"] = lambda i: res.addmm_(x, ws[i % copies].t())
    else:
        fns[f"{name} T={m} F.linear"] = lambda i: F.linear(x, ws[i % copies])
    for s in (2, 4, 8):
        fns[f"{name} T={m} bmm{s}"] = (lambda s: lambda i: partials(x, ws[i % copies], s))(s)
    bufs = {s: torch.empty((s, m, n), dtype=torch.float32, device=dev) for s in (2, 4, 8)}
    for s in (2, 4, 8):
        for bn in (32, 64, 128):
            for bk, stages in ((64, 4), (128, 2), (128, 3)):
                if k // s < bk * 2 or (n // bn) * s < 96:
                    continue
                cfg = (bn, bk, stages, 4)
                ref = partials(x, ws[0], s)
                got = triton_partials(x, ws[0], s, cfg, bufs[s])
                err = (got - ref).abs().max().item()
                tag = f"{name} T={m} tri{s} {bn}x{bk}x{stages}"
                if err > 1e-2:
                    print(f"{tag}: max |diff| against bmm {err:.4f}: skipped")
                    continue
                fns[tag] = (lambda s, cfg: lambda i: triton_partials(x, ws[i % copies], s, cfg, bufs[s]))(s, cfg)
    return fns


def layout_fns(m, dev, lib):
    """cuBLAS at 33-64 rows by weight layout: today's [N, K] weight (x @ W^T, cuBLAS 'TN') against a
    transposed copy [K, N] (x @ Wt, 'NN'), for qkv (mm), o (addmm_ with the residual) and down
    (4 K-slice partials, bmm); `lib`: torch.backends.cuda.preferred_blas_library."""
    torch.backends.cuda.preferred_blas_library(lib)
    fns = {}
    for name, n, k in (("qkv", 3072, 2048), ("o", 2048, 2048), ("down", 2048, 8192)):
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.empty((n, k), device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5) for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        res = torch.randn((m, n), device=dev, dtype=torch.bfloat16)
        tag = f"{lib} {name} T={m}"
        if name == "qkv":
            fns[f"{tag} TN"] = (lambda x, ws, c: lambda i: torch.mm(x, ws[i % c].t()))(x, ws, copies)
            fns[f"{tag} NN"] = (lambda x, ws, c: lambda i: torch.mm(x, ws[i % c]))(x, wts, copies)
        elif name == "o":
            fns[f"{tag} TN"] = (lambda x, ws, c, r: lambda i: r.addmm_(x, ws[i % c].t()))(x, ws, copies, res)
            fns[f"{tag} NN"] = (lambda x, ws, c, r: lambda i: r.addmm_(x, ws[i % c]))(x, wts, copies, res)
        else:
            xs = x.view(m, 4, k // 4).transpose(0, 1)
            fns[f"{tag} TN"] = (lambda ws, c: lambda i: torch.bmm(xs, ws[i % c].view(n, 4, k // 4).permute(1, 2, 0),
                                                                   out_dtype=torch.float32))(ws, copies)
            fns[f"{tag} NN"] = (lambda ws, c: lambda i: torch.bmm(xs, ws[i % c].view(4, k // 4, n),
                                                                   out_dtype=torch.float32))(wts, copies)
        a = fns[f"{tag} TN"](0).float() if name != "o" else None
        if a is not None:
            b = fns[f"{tag} NN"](0).float()
            print(f"{tag}: NN against TN max |diff| {(a - b).abs().max().item():.5f}", flush=True)
    return fns


def segment_fns(m, dev, layers=16, hidden=2048, inter=8192):
    """o -> norm + gate_up + SiLU over 16 layers' weights, as the 33-64-row step runs it (today:
    cuBLAS `addmm_` with the residual, then the fused kernel norming x in its K loop) against o as
    K-slice partials summed with the residual and normed by split_residual's kernel, the fused
    gate_up then streaming the normed x (no norm in its loop); and gate_up alone with / without."""
    from trtgraph.kernels import decode_linear
    from trtgraph.kernels.split_residual import split_linear_residual_norm

    def w(n, k):
        return torch.empty((n, k), device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5)

    o_ws = [w(hidden, hidden) for _ in range(layers)]
    gu_ws = [w(2 * inter, hidden) for _ in range(layers)]
    g = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
    x = torch.randn((m, hidden), device=dev, dtype=torch.bfloat16)
    res = torch.randn((m, hidden), device=dev, dtype=torch.bfloat16)
    ref = decode_linear.norm_gate_up_silu(res.addmm(x, o_ws[0].t()), g, 1e-5, gu_ws[0])
    h, normed = split_linear_residual_norm(x, o_ws[0], res.clone(), g, 1e-5, splits=4)
    got = decode_linear.norm_gate_up_silu(normed, None, 1e-5, gu_ws[0])
    print(f"seg T={m}: split + normed gate_up against today's: max |diff| {(got.float() - ref.float()).abs().max().item():.4f}",
          flush=True)

    def today(i):
        l = i % layers
        return decode_linear.norm_gate_up_silu(res.addmm_(x, o_ws[l].t()), g, 1e-5, gu_ws[l])

    def split(s):
        def f(i):
            l = i % layers
            return decode_linear.norm_gate_up_silu(split_linear_residual_norm(x, o_ws[l], res, g, 1e-5, splits=s)[1],
                                                   None, 1e-5, gu_ws[l])
        return f

    return {f"seg T={m} today": today, f"seg T={m} split4": split(4), f"seg T={m} split2": split(2),
            f"seg T={m} gate_up norm": lambda i: decode_linear.norm_gate_up_silu(x, g, 1e-5, gu_ws[i % layers]),
            f"seg T={m} gate_up normed": lambda i: decode_linear.norm_gate_up_silu(x, None, 1e-5, gu_ws[i % layers]),
            f"seg T={m} o addmm_": lambda i: res.addmm_(x, o_ws[i % layers].t()),
            f"seg T={m} o split4+norm": lambda i: split_linear_residual_norm(x, o_ws[i % layers], res, g, 1e-5, splits=4)}


def nostore(rows, passes, graph_time, dev):
    """The greedy LM head with and without its fp32 logits stored: the TMA head at 33-64 rows,
    the fused GEMV (its norm in a row pass, PRENORM) at fewer."""
    from trtgraph.kernels import decode_linear as dl

    v, k = 128256, 2048
    ws = [torch.empty((v, k), device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5) for _ in range(2)]
    nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
    cfg = tuple(dl.decode_tuned.TMA_HEAD[(v, k)])
    for m in rows:
        x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        toks = {s: torch.empty(m, dtype=torch.int64, device=dev) for s in ("store", "tokens only")}
        out = torch.empty((m, v), dtype=torch.float32, device=dev)
        if m >= tma_head.TMA_MIN_ROWS:
            fns = {f"tma T={m} {s}": (lambda s: lambda i: tma_head.linear_argmax(
                x, ws[i % 2], toks[s], config=cfg, store=s == "store"))(s) for s in toks}
        else:
            fns = {f"fused T={m} {s}": (lambda s: lambda i: dl._launch(
                dl._ARGMAX if s == "store" else dl._ARGMAX_ONLY, x, ws[i % 2], out, v, norm_weight=nw, eps=1e-5,
                tokens=toks[s]))(s) for s in toks}
        for fn in fns.values():
            fn(0)
        torch.cuda.synchronize()
        print(f"T={m}: tokens equal: {torch.equal(toks['store'], toks['tokens only'])}", flush=True)
        timed(fns, passes, graph_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="40,64")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--only", default="qkv,o,down,head")
    ap.add_argument("--head-configs", default="128x128x4x4,128x128x2x4,128x64x4x4,64x128x3x4,128x128x3x8")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        return check()
    from tma_probe import graph_time

    dev = torch.device("cuda")
    only = args.only.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    for name, (n, k) in (("qkv", (3072, 2048)), ("o", (2048, 2048)), ("down", (2048, 8192))):
        if name in only:
            for m in rows:
                timed(layer_fns(name, n, k, m, dev), args.passes, graph_time)
    if "layout" in only:
        for lib in ("cublas", "cublaslt"):
            for m in rows:
                timed(layout_fns(m, dev, lib), args.passes, graph_time)
        torch.backends.cuda.preferred_blas_library("cublas")
    if "seg" in only:
        for m in rows:
            timed(segment_fns(m, dev), args.passes, graph_time)
    if "nostore" in only:
        nostore(rows, args.passes, graph_time, dev)
    if "head" in only:
        v, k = 128256, 2048
        ws = [torch.empty((v, k), device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5) for _ in range(2)]
        configs = [tuple(int(c) for c in cfg.split("x")) for cfg in args.head_configs.split(",")]
        for m in rows:
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
            toks, vs = head_variants(x, v, configs)
            fns = {}
            for key, fn in vs.items():
                fns[f"head T={m} {key}"] = (lambda fn: lambda i: fn(ws[i % 2]))(fn)
                fn(ws[0])
            torch.cuda.synchronize()
            ref = toks[f"today {'x'.join(map(str, configs[0]))}"]
            print(f"head T={m}: every variant's tokens equal the shipped head's: "
                  f"{all(torch.equal(t, ref) for t in toks.values())}", flush=True)
            timed(fns, args.passes, graph_time)


if __name__ == "__main__":
    main()
