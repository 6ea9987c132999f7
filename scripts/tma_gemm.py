"""A TMA-fed skinny GEMM for scripts/tma_probe.py: y[M, N] = x[M, K] @ W[N, K]^T with the weight (and
optionally x) through host-built tensor descriptors (`TensorDescriptor.from_tensor`, `desc.load`),
which Triton pipelines on sm_90 as TMA copies with mbarriers; swap-AB (acc [BLOCK_N, BLOCK_T], fp32).
MODE 0 plain store, 1 residual add, 2 paired gate / up rows with RMSNorm in the prologue and
SiLU-and-mul in the epilogue; split-K with fp32 partials summed by the last arriving program (no
norm, no pairs: MODE 2 runs unsplit); a persistent grid; Triton's warp specialization.

    TRITON_INTERPRET=1 python3 scripts/tma_gemm.py   # the kernel against torch, on the CPU
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

PLAIN, RESIDUAL, SILU = 0, 1, 2


@triton.jit
def _step(acc1, acc2, ss, x_desc, x_ptr, nw_ptr, w_desc, n0, n2, k0, M, x_stride, MODE: tl.constexpr,
          HAS_NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, X_TMA: tl.constexpr):
    """One K step: the weight tile (and its partner rows) by TMA, x by TMA or plain loads."""
    rows = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    w1 = w_desc.load([n0, k0])
    if X_TMA:
        xt = x_desc.load([0, k0])
    else:
        xt = tl.load(x_ptr + rows[:, None] * x_stride + (k0 + kk)[None, :], mask=(rows < M)[:, None], other=0.0)
    if HAS_NORM:
        xf = xt.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        xt = (xf * tl.load(nw_ptr + k0 + kk).to(tl.float32)[None, :]).to(w1.dtype)
    xb = tl.trans(xt)
    acc1 = tl.dot(w1, xb, acc1)
    if MODE == 2:
        w2 = w_desc.load([n2, k0])
        acc2 = tl.dot(w2, xb, acc2)
    return acc1, acc2, ss


@triton.jit
def _k_loop(x_desc, x_ptr, nw_ptr, w_desc, n0, n2, k_lo, k_hi, M, x_stride,
            MODE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_T: tl.constexpr, STAGES: tl.constexpr, X_TMA: tl.constexpr, WS: tl.constexpr):
    acc1 = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    if WS:  # Triton's warp specialization (a producer warp issuing the TMA copies); its own loop
        acc1, acc2, ss = _k_loop_ws(acc1, acc2, ss, x_desc, x_ptr, nw_ptr, w_desc, n0, n2, k_lo, k_hi, M, x_stride,
                                    MODE, HAS_NORM, BLOCK_K, BLOCK_T, STAGES, X_TMA)
    else:
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            acc1, acc2, ss = _step(acc1, acc2, ss, x_desc, x_ptr, nw_ptr, w_desc, n0, n2, k0, M, x_stride,
                                   MODE, HAS_NORM, BLOCK_K, BLOCK_T, X_TMA)
    return acc1, acc2, ss


@triton.jit
def _k_loop_ws(acc1, acc2, ss, x_desc, x_ptr, nw_ptr, w_desc, n0, n2, k_lo, k_hi, M, x_stride,
               MODE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
               STAGES: tl.constexpr, X_TMA: tl.constexpr):
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES, warp_specialize=True):
        acc1, acc2, ss = _step(acc1, acc2, ss, x_desc, x_ptr, nw_ptr, w_desc, n0, n2, k0, M, x_stride,
                               MODE, HAS_NORM, BLOCK_K, BLOCK_T, X_TMA)
    return acc1, acc2, ss


@triton.jit
def _epilogue(acc1, acc2, ss, cols, K, M, eps, out_ptr, res_ptr, out_stride,
              MODE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.arange(0, BLOCK_T)
    mask = (rows < M)[None, :]
    dst = rows[None, :] * out_stride + cols[:, None]
    if HAS_NORM:
        rstd = tl.rsqrt(ss / K + eps)
        acc1 = acc1 * rstd[None, :]
        acc2 = acc2 * rstd[None, :]
    if MODE == 0:
        tl.store(out_ptr + dst, acc1.to(out_ptr.dtype.element_ty), mask=mask)
    elif MODE == 1:
        r = tl.load(res_ptr + dst, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + dst, (r + acc1).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + dst, (acc1 / (1.0 + tl.exp(-acc1)) * acc2).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile(x_desc, x_ptr, nw_ptr, w_desc, out_ptr, res_ptr, ws_ptr, cnt_ptr, t, n_tiles, M, N, K, k_per_split,
          x_stride, out_stride, eps, MODE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
          X_TMA: tl.constexpr, WS: tl.constexpr):
    pid_n = t % n_tiles
    split = t // n_tiles
    n0 = pid_n * BLOCK_N
    k_lo = split * k_per_split
    acc1, acc2, ss = _k_loop(x_desc, x_ptr, nw_ptr, w_desc, n0, N + n0, k_lo, k_lo + k_per_split, M, x_stride,
                             MODE, HAS_NORM, BLOCK_N, BLOCK_K, BLOCK_T, STAGES, X_TMA, WS)
    cols = n0 + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:
        _epilogue(acc1, acc2, ss, cols, K, M, eps, out_ptr, res_ptr, out_stride, MODE, HAS_NORM, BLOCK_T)
    else:  # fp32 partials [n_tiles, SPLIT_K, BLOCK_N, BLOCK_T]; the last to arrive sums them in split order
        SLOT: tl.constexpr = BLOCK_N * BLOCK_T
        idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        tl.store(ws_ptr + (pid_n * SPLIT_K + split).to(tl.int64) * SLOT + idx, acc1)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            acc1 = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            for s in range(SPLIT_K):
                acc1 += tl.load(ws_ptr + (pid_n * SPLIT_K + s).to(tl.int64) * SLOT + idx, cache_modifier=".cg")
            _epilogue(acc1, acc2, ss, cols, K, M, eps, out_ptr, res_ptr, out_stride, MODE, HAS_NORM, BLOCK_T)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _tma_kernel(x_desc, x_ptr, nw_ptr, w_desc, out_ptr, res_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split,
                x_stride, out_stride, eps, MODE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                X_TMA: tl.constexpr, PERSIST: tl.constexpr, WS: tl.constexpr):
    """N output columns (gate / up pairs for MODE 2: weight rows n and N + n); grid: the tiles
    (n-tile fastest, then the split) or, PERSIST, one program per SM looping over them."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    if PERSIST:
        for t in range(tl.program_id(0), n_tiles * SPLIT_K, tl.num_programs(0)):
            _tile(x_desc, x_ptr, nw_ptr, w_desc, out_ptr, res_ptr, ws_ptr, cnt_ptr, t, n_tiles, M, N, K, k_per_split,
                  x_stride, out_stride, eps, MODE, HAS_NORM, BLOCK_N, BLOCK_K, BLOCK_T, SPLIT_K, STAGES, X_TMA, WS)
    else:
        _tile(x_desc, x_ptr, nw_ptr, w_desc, out_ptr, res_ptr, ws_ptr, cnt_ptr, tl.program_id(0), n_tiles, M, N, K,
              k_per_split, x_stride, out_stride, eps, MODE, HAS_NORM, BLOCK_N, BLOCK_K, BLOCK_T, SPLIT_K, STAGES,
              X_TMA, WS)


def row_tile(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


class TmaGemm:
    """One variant bound to its weight copies: descriptors, scratch and the launch, built once
    (so a CUDA graph captures the descriptors' bytes once, as capture would)."""

    def __init__(self, cfg: dict, mode: int, x: torch.Tensor, ws: list[torch.Tensor], out: torch.Tensor,
                 residual=None, norm_weight=None, eps=1e-5):
        self.cfg, self.mode, self.x, self.out, self.res = cfg, mode, x, out, residual
        self.nw, self.eps = norm_weight, eps
        M, K = x.shape
        bt, bn, bk = row_tile(M), cfg["bn"], cfg["bk"]
        self.n = out.shape[1]
        split = cfg["split"]
        self.kps = triton.cdiv(triton.cdiv(K, split), bk) * bk
        assert K % self.kps == 0 and self.n % bn == 0, (K, self.kps, self.n, bn)
        self.split = K // self.kps
        self.bt = bt
        self.x_desc = TensorDescriptor.from_tensor(x, [bt, bk])
        self.w_descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
        n_tiles = self.n // bn
        tiles = n_tiles * self.split
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 4
        self.grid = (min(tiles, sms * cfg.get("per_sm", 1)),) if cfg.get("persist") else (tiles,)
        if self.split > 1:
            self.scratch = torch.empty(tiles * bn * bt, dtype=torch.float32, device=x.device)
            self.cnt = torch.zeros(n_tiles, dtype=torch.int32, device=x.device)
        else:
            self.scratch = self.cnt = out

    def __call__(self, i: int = 0):
        c, M, K = self.cfg, self.x.shape[0], self.x.shape[1]
        _tma_kernel[self.grid](
            self.x_desc, self.x, self.nw if self.nw is not None else self.x, self.w_descs[i % len(self.w_descs)],
            self.out, self.res if self.res is not None else self.out, self.scratch, self.cnt,
            M, self.n, K, self.kps, self.x.stride(0), self.out.stride(0), self.eps,
            MODE=self.mode, HAS_NORM=self.nw is not None, BLOCK_N=c["bn"], BLOCK_K=c["bk"], BLOCK_T=self.bt,
            SPLIT_K=self.split, STAGES=c["stages"], X_TMA=c.get("x_tma", True), PERSIST=bool(c.get("persist")),
            WS=bool(c.get("ws")), num_warps=c["warps"], num_stages=c["stages"])
        return self.out


def reference(mode, x, w, residual=None, norm_weight=None, eps=1e-5):
    """The op in fp32 (MODE 2: w [2 I, K], gate rows then up rows)."""
    xf = x.float()
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = xf @ w.float().t()
    if mode == RESIDUAL:
        return residual.float() + y
    if mode == SILU:
        g, u = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u
    return y


def cpu_check() -> None:
    """Small shapes under the interpreter: every mode, split-K, x by descriptor or plain loads,
    the persistent grid, against reference(); and a row's result independent of its neighbours."""
    dev = torch.device("cpu")
    torch.manual_seed(0)
    K, N = 256, 128
    cases = [(PLAIN, dict(bn=32, bk=64, split=1, stages=2, warps=4, ws=True)),
             (PLAIN, dict(bn=32, bk=64, split=2, stages=2, warps=4, x_tma=False)),
             (RESIDUAL, dict(bn=64, bk=64, split=2, stages=3, warps=4, persist=True)),
             (SILU, dict(bn=32, bk=64, split=1, stages=2, warps=4)),
             (SILU, dict(bn=32, bk=128, split=1, stages=2, warps=4, x_tma=False, persist=True))]
    for mode, cfg in cases:
        w = torch.randn((2 * N if mode == SILU else N, K)) / K ** 0.5
        x64 = torch.randn((64, K))
        nw = torch.rand(K) + 0.5 if mode == SILU else None
        r64 = torch.randn((64, N)) if mode == RESIDUAL else None
        outs = {}
        for m in (5, 33, 64):
            x = x64[:m].contiguous()
            res = r64[:m].clone() if r64 is not None else None
            out = torch.empty((m, N))
            outs[m] = TmaGemm(cfg, mode, x, [w], out, residual=res, norm_weight=nw)(0).clone()
            ref = reference(mode, x, w, r64[:m] if r64 is not None else None, nw)
            err = ((outs[m] - ref).norm() / ref.norm()).item()
            assert err < 2e-3, (mode, cfg, m, err)
        assert torch.equal(outs[33], outs[64][:33]), (mode, cfg)
        print(f"mode {mode} {cfg}: ok (rel err {err:.1e})")


if __name__ == "__main__":
    cpu_check()
