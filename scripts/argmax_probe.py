"""Probe (H200; run in the tenth session, docs/performance.md "the lead"): where the LM head's greedy argmax epilogue spends its 13-15 us at
33-64 rows (docs/performance.md, tenth session, h/k10: the TMA head 153.4 us with the argmax
against 139.4 with fp32 logits only, the fused GEMV likewise). Two candidates: the ~1,000 atomic
maxima on each row's one address, and each tile's acq_rel arrival on the m-tile counter after a
barrier (its logits store drains before the program ends; one program per SM overlaps nothing).

Variants of kernels/tma_head.py's kernel, each one CUDA graph of 16 calls over two weight copies,
passes interleaved: `plain` (fp32 logits only), `today` (tma_head.linear_argmax: maxima + arrival),
`relaxed` (the relaxed atomic maxima only, then a one-program kernel turning them into tokens and
putting them back to -1: no arrival), `relaxed-noatomic` (the tile's maxima stored per tile, no
atomics, then one program reducing the tiles: the atomics' cost by difference). Tokens checked
against today's. Usage: python3 scripts/argmax_probe.py [--rows 40,64] [--passes 5]
TRITON_INTERPRET=1 python3 scripts/argmax_probe.py --check  (small shapes on the CPU)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from trtgraph.kernels import tma_head
from trtgraph.kernels.sampling_common import _keys


@triton.jit
def _head(x_desc, w_desc, out_ptr, best_ptr, M, N, K, out_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          BLOCK_T: tl.constexpr, STAGES: tl.constexpr, PER_TILE: tl.constexpr, PRECISION: tl.constexpr,
          TILES=0, ROW_MAJOR: tl.constexpr = False):
    """tma_head's GEMM; the packed maxima (value key, then 2**24 - 1 - column) folded by a relaxed
    atomic max into best[row] or (PER_TILE) stored as best[tile, row] (ROW_MAJOR: best[row, tile] of
    TILES tiles a row, scripts/partials_probe.py's layout)."""
    n0 = tl.program_id(1) * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(w_desc.load([n0, k0]), tl.trans(x_desc.load([0, k0])), acc, input_precision=PRECISION)
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < M
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    tl.store(out_ptr + rows[None, :] * out_stride + cols[:, None], acc, mask=col_ok[:, None] & row_ok[None, :])
    key = tl.where(acc != acc, 4294967296, _keys(acc))
    packed = tl.max(tl.where(col_ok[:, None], (key << 24) | (16777215 - cols.to(tl.int64))[:, None], -1), axis=0)
    if ROW_MAJOR:
        tl.store(best_ptr + rows * TILES + tl.program_id(1), packed, mask=row_ok)
    elif PER_TILE:
        tl.store(best_ptr + tl.program_id(1) * BLOCK_T + rows, packed, mask=row_ok)
    else:
        tl.atomic_max(best_ptr + rows, packed, mask=row_ok, sem="relaxed")


@triton.jit
def _tokens(best_ptr, tok_ptr, M, TILES, BLOCK_T: tl.constexpr, PER_TILE: tl.constexpr):
    """One program: the rows' maxima -> tokens; the maxima put back to -1 (atomic form)."""
    rows = tl.arange(0, BLOCK_T)
    ok = rows < M
    if PER_TILE:
        best = tl.full([BLOCK_T], -1, tl.int64)
        for t in range(TILES):
            best = tl.maximum(best, tl.load(best_ptr + t * BLOCK_T + rows, mask=ok, other=-1))
    else:
        best = tl.load(best_ptr + rows, mask=ok, other=-1)
        tl.store(best_ptr + rows, tl.full([BLOCK_T], -1, tl.int64), mask=ok)
    tl.store(tok_ptr + rows, 16777215 - (best & 16777215), mask=ok)


class Split:
    """The GEMM with relaxed (or per-tile) maxima, then the tokens kernel."""

    def __init__(self, x, n_cols, tokens, per_tile, config):
        self.x, self.tok, self.per_tile, self.cfg = x, tokens, per_tile, config
        bn = config[0]
        self.tiles = triton.cdiv(n_cols, bn)
        self.best = torch.full((self.tiles * 64 if per_tile else 64,), -1, dtype=torch.int64, device=x.device)

    def __call__(self, w):
        bn, bk, stages, warps = self.cfg
        T, K = self.x.shape
        out = torch.empty((T, w.shape[0]), dtype=torch.float32, device=self.x.device)
        descs = TensorDescriptor.from_tensor(self.x, [64, bk]), TensorDescriptor.from_tensor(w, [bn, bk])
        _head[(1, self.tiles)](*descs, out, self.best, T, w.shape[0], K, out.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                               BLOCK_T=64, STAGES=stages, PER_TILE=self.per_tile,
                               PRECISION="ieee" if w.dtype == torch.float32 else "tf32", num_warps=warps,
                               num_stages=stages)
        _tokens[(1,)](self.best, self.tok, T, self.tiles, BLOCK_T=64, PER_TILE=self.per_tile, num_warps=4)
        return out


def variants(x, n_cols, config):
    toks = {n: torch.empty(x.shape[0], dtype=torch.int64, device=x.device) for n in ("today", "relaxed", "noatomic")}
    return toks, {
        "plain": lambda w: tma_head.linear(x, w, config=config),
        "today": lambda w: tma_head.linear_argmax(x, w, toks["today"], config=config),
        "relaxed": (lambda s: lambda w: s(w))(Split(x, n_cols, toks["relaxed"], False, config)),
        "relaxed-noatomic": (lambda s: lambda w: s(w))(Split(x, n_cols, toks["noatomic"], True, config))}


def check() -> None:
    g = torch.Generator().manual_seed(0)
    cfg = (64, 64, 2, 4)
    for T in (33, 64):
        x = torch.randn((T, 96), generator=g)
        w = torch.randn((200, 96), generator=g) / 10
        w[150] = w[7]
        toks, fns = variants(x, 200, cfg)
        outs = {n: fn(w) for n, fn in fns.items()}
        assert all(torch.equal(o, outs["plain"]) for o in outs.values())
        assert torch.equal(toks["relaxed"], toks["today"]) and torch.equal(toks["noatomic"], toks["today"]), T
        fns["relaxed"](w)  # the maxima were put back: the same tokens again
        assert torch.equal(toks["relaxed"], toks["today"])
    print("ok: every variant's logits and tokens equal tma_head's")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="40,64")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        return check()
    import sys
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tma_probe import graph_time

    from trtgraph.kernels import decode_tuned
    dev, (v, k) = torch.device("cuda"), (128256, 2048)
    cfg = decode_tuned.TMA_HEAD[(v, k)]
    ws = [torch.empty((v, k), device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5) for _ in range(2)]
    fns, toks = {}, {}
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        toks[m], vs = variants(x, v, cfg)
        for name, fn in vs.items():
            fns[(name, m)] = (lambda fn: lambda i: fn(ws[i % 2]))(fn)
            fn(ws[0])
        torch.cuda.synchronize()
        same = all(torch.equal(toks[m][n], toks[m]["today"]) for n in ("relaxed", "noatomic"))
        print(f"T={m}: tokens of every variant equal today's: {same}", flush=True)
    times = {key: [] for key in fns}
    for _ in range(args.passes):
        for key, fn in fns.items():
            times[key].append(graph_time(fn, 16))
    for (name, m), t in times.items():
        print(f"{name:17s} T={m}: {min(t):7.2f} / {sorted(t)[len(t) // 2]:7.2f} us (min / median of {args.passes})")


if __name__ == "__main__":
    main()
