"""The light decode GEMV: the fused decode ops (kernels/decode_linear.py) for steps of very few
rows (T <= LIGHT_MAX_ROWS = 2) as CUDA-core dot products instead of tensor-core tiles.

Why: at 1-2 rows the tensor-core kernel (kernels/decode_kernel.py) pads the rows to a 16-row
MMA and stages its weight tiles in most of an SM's shared memory, one or two programs per SM;
each op then pays a launch, a ramp until the SMs stream at full bandwidth, and the split-K
tail, about 4-6 us per op on the 1B shapes (docs/performance.md, sixth session). This kernel
holds no shared memory for weights and few registers: each program loads a [BLOCK_N, BLOCK_K]
weight tile into registers with 16-byte vector loads, the next tile's loads in flight while
it multiplies the current one by the step's rows (one or two; each row has its own
elementwise accumulator, reduced over K once at the end), so that many programs share an SM. With programmatic dependent launch (`PDL`), a program loads
its first weight tile before it waits for the previous kernel, so that the next op's weights
stream while the previous op drains.

Reduction order: a row's elementwise accumulator adds the K tiles in order, then one sum over
its [BLOCK_N, BLOCK_K] layout (the same whatever the step's row count: rows never mix), then
the splits in split order: a row's result does not depend on the row beside it.
But its rounding differs from the tensor-core kernel's, so where the plan also runs steps of
more rows (which take the tensor-core kernel or the composition), the light kernel serves a
shape only with `deterministic: false` (decode_linear.choose_fused).

The epilogues, the RMSNorm prologue and the split-K tail are the tensor-core kernel's
(`_finish`, `_epilogue`); the launch is decode_linear._launch's.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .decode_kernel import _finish

LIGHT_MAX_ROWS = 2


@triton.jit
def _row_fma(x_ptr, r, M, x_stride, kk, k_ok, nw, w1, w2, e1, e2, sq,
             MODE: tl.constexpr, HAS_NORM: tl.constexpr, MASK_K: tl.constexpr, WDT: tl.constexpr):
    """Row r's elementwise products with the weight tile(s), added to its accumulators e1 (e2)
    [BLOCK_N, BLOCK_K] (no reduction in the K loop: one at the end); under HAS_NORM sq [BLOCK_K]
    += x^2, and x scaled by the norm weight nw and rounded to the weights' dtype (as the
    tensor-core kernel rounds its x tile)."""
    r_ok = (tl.zeros_like(kk) + r) < M  # a splat: the loads stay 16-byte vectors
    if MASK_K:
        xr = tl.load(x_ptr + r * x_stride + kk, mask=k_ok & r_ok, other=0.0).to(tl.float32)
    else:
        xr = tl.load(x_ptr + r * x_stride + kk, mask=r_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        sq += xr * xr
        xr = (xr * nw).to(WDT).to(tl.float32)
    e1 += w1 * xr[None, :]
    if MODE >= 2:
        e2 += w2 * xr[None, :]
    return e1, e2, sq


@triton.jit
def _tile_fma(x_ptr, row0, M, x_stride, kk, k_ok, nw, w1, w2, e10, e20, sq0, e11, e21, sq1,
              MODE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr, MASK_K: tl.constexpr,
              WDT: tl.constexpr):
    """One K tile for the tile's rows (row0, and row0 + 1 when BLOCK_T is 2), each row alone."""
    e10, e20, sq0 = _row_fma(x_ptr, row0, M, x_stride, kk, k_ok, nw, w1, w2, e10, e20, sq0, MODE, HAS_NORM,
                             MASK_K, WDT)
    if BLOCK_T == 2:
        e11, e21, sq1 = _row_fma(x_ptr, row0 + 1, M, x_stride, kk, k_ok, nw, w1, w2, e11, e21, sq1, MODE,
                                 HAS_NORM, MASK_K, WDT)
    return e10, e20, sq0, e11, e21, sq1


@triton.jit
def _light_kernel(x_ptr, nw_ptr, rs_ptr, w_ptr, b_ptr, out_ptr, res_ptr, cs_ptr, pos_ptr, slot_ptr, kv_ptr, ws_ptr,
                  cnt_ptr, M, N, K, k_per_split, x_stride, w_stride, out_stride, res_stride, eps, pair_offset,
                  cache_kv_stride, cache_slot_stride, cache_head_stride, num_q_heads, num_kv_heads,
                  MODE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, NACC: tl.constexpr,
                  BLOCK_T: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, PRENORM: tl.constexpr):
    """The arguments of decode_kernel._decode_kernel; grid (m-tiles of BLOCK_T (1 or 2) rows,
    N-tiles, SPLIT_K). EVEN: every split a whole number of BLOCK_K and every N-tile full
    (unmasked weight loads, the next tile's loads issued before the current tile's arithmetic)."""
    if PDL:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    row0 = pid_m * BLOCK_T
    rows = row0 + tl.arange(0, BLOCK_T)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if MODE == 3:
        w_rows1 = (cols // HALF) * (2 * HALF) + cols % HALF
        w_rows2 = w_rows1 + HALF
    else:
        w_rows1 = cols
        w_rows2 = cols + pair_offset
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    ko = tl.arange(0, BLOCK_K)
    p1 = w_ptr + w_rows1[:, None] * w_stride + ko[None, :]
    p2 = w_ptr + w_rows2[:, None] * w_stride + ko[None, :]
    e10 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    e20 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    e11 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    e21 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sq0 = tl.zeros([BLOCK_K], tl.float32)
    sq1 = tl.zeros([BLOCK_K], tl.float32)
    nw = tl.zeros([BLOCK_K], tl.float32)
    WDT: tl.constexpr = w_ptr.dtype.element_ty
    if EVEN:
        # the first weight tile before the wait: weights never depend on the previous kernel
        w1 = tl.load(p1 + k_lo)
        w2 = w1
        if MODE >= 2:
            w2 = tl.load(p2 + k_lo)
        if PDL:
            gdc_wait()
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kn = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)  # the last step reloads its own tile
            w1n = tl.load(p1 + kn)
            w2n = w1n
            if MODE >= 2:
                w2n = tl.load(p2 + kn)
            kk = k0 + ko
            if HAS_NORM:
                nw = tl.load(nw_ptr + kk).to(tl.float32)
            e10, e20, sq0, e11, e21, sq1 = _tile_fma(x_ptr, row0, M, x_stride, kk, kk < k_hi, nw, w1.to(tl.float32),
                                                     w2.to(tl.float32), e10, e20, sq0, e11, e21, sq1, MODE,
                                                     HAS_NORM, BLOCK_T, False, WDT)
            w1 = w1n
            w2 = w2n
    else:
        if PDL:
            gdc_wait()
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + ko
            k_ok = kk < k_hi
            wm = col_ok[:, None] & k_ok[None, :]
            w1 = tl.load(p1 + k0, mask=wm, other=0.0).to(tl.float32)
            w2 = w1
            if MODE >= 2:
                w2 = tl.load(p2 + k0, mask=wm, other=0.0).to(tl.float32)
            if HAS_NORM:
                nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            e10, e20, sq0, e11, e21, sq1 = _tile_fma(x_ptr, row0, M, x_stride, kk, k_ok, nw, w1, w2, e10, e20, sq0,
                                                     e11, e21, sq1, MODE, HAS_NORM, BLOCK_T, True, WDT)
    # one reduction over K per row and accumulator, then the rows side by side: [BLOCK_N, BLOCK_T]
    tcol = tl.arange(0, BLOCK_T)
    acc1 = tl.where(tcol[None, :] == 0, tl.sum(e10, axis=1)[:, None], 0.0)
    acc2 = tl.where(tcol[None, :] == 0, tl.sum(e20, axis=1)[:, None], 0.0)
    ss = tl.where(tcol == 0, tl.sum(sq0, axis=0), 0.0)
    if BLOCK_T == 2:
        acc1 = tl.where(tcol[None, :] == 1, tl.sum(e11, axis=1)[:, None], acc1)
        acc2 = tl.where(tcol[None, :] == 1, tl.sum(e21, axis=1)[:, None], acc2)
        ss = tl.where(tcol == 1, tl.sum(sq1, axis=0), ss)
    _finish(acc1, acc2, ss, rows, row_ok, cols, col_ok, w_rows1, w_rows2, K, eps, rs_ptr, b_ptr, out_ptr, out_stride,
            res_ptr, res_stride, cs_ptr, pos_ptr, slot_ptr, kv_ptr, cache_kv_stride, cache_slot_stride,
            cache_head_stride, num_q_heads, num_kv_heads, ws_ptr, cnt_ptr, pid_m, pid_n, split,
            MODE, HAS_NORM, HAS_BIAS, HALF, PRENORM, BLOCK_N, SPLIT_K, NACC, BLOCK_T)
