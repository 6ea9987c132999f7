"""The light decode GEMV: the fused decode ops (kernels/decode_linear.py) for steps of one row
(T <= LIGHT_MAX_ROWS = 1: batch-1 decode) as CUDA-core dot products instead of tensor-core tiles.

Why: at one row the tensor-core kernel (kernels/decode_kernel.py) pads the row to a 16-row MMA
and stages its weight tiles in most of an SM's shared memory, one or two programs per SM; each
op then pays a launch, a ramp until the SMs stream at full bandwidth, and the split-K tail:
3.8 us per boundary on the o shape on the H200 (scripts/decode_boundary.py; docs/performance.md,
sixth session). This kernel holds no shared memory for weights: each program loads a
[BLOCK_N, BLOCK_K] weight tile into registers with 16-byte vector loads, the next tile's loads
in flight while it multiplies the current one by the row into an elementwise accumulator
(reduced over K once, at the end), so several programs share an SM. Launched with
programmatic dependent launch (decode_tuned.LIGHT_PDL), a program loads its first weight tile
before it waits for the previous kernel, so the next op's weights stream while the previous op
drains: that overlap is the gain (without PDL the light kernels were no faster in the step).
Two rows (tried: an accumulator per row) doubled the registers and lost: the step at bs 2 was
0.18 ms slower, so steps of 2+ rows keep the tensor-core kernel.

Reduction order: fixed (the K tiles in order into the accumulator, one sum over its layout,
then the splits in split order), with no atomics on floats. It rounds otherwise than the
tensor-core kernel, so a plan that also runs steps of more rows for a shape (which take the
tensor-core kernel or the composition) gets the light kernel there only with
`deterministic: false` (decode_linear.choose_fused).

The epilogues, the RMSNorm prologue's rounding and the split-K tail are the tensor-core
kernel's (`_finish`, `_epilogue`); the launch is decode_linear._launch's.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .decode_kernel import _finish, _tile_index

LIGHT_MAX_ROWS = 1


@triton.jit
def _row_fma(x_ptr, M, kk, k_ok, nw, w1, w2, e1, e2, sq,
             MODE: tl.constexpr, HAS_NORM: tl.constexpr, MASK_K: tl.constexpr, WDT: tl.constexpr):
    """The row's elementwise products with the weight tile(s), added to the accumulators e1 (e2)
    [BLOCK_N, BLOCK_K] (no reduction in the K loop); under HAS_NORM sq [BLOCK_K] += x^2, and x
    scaled by the norm weight nw and rounded to the weights' dtype (as the tensor-core kernel
    rounds its x tile)."""
    r_ok = tl.zeros_like(kk) < M  # a splat: the loads stay 16-byte vectors
    if MASK_K:
        xr = tl.load(x_ptr + kk, mask=k_ok & r_ok, other=0.0).to(tl.float32)
    else:
        xr = tl.load(x_ptr + kk, mask=r_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        sq += xr * xr
        xr = (xr * nw).to(WDT).to(tl.float32)
    e1 += w1 * xr[None, :]
    if MODE >= 2:
        e2 += w2 * xr[None, :]
    return e1, e2, sq


@triton.jit
def _light_kernel(x_ptr, nw_ptr, rs_ptr, w_ptr, b_ptr, out_ptr, res_ptr, cs_ptr, pos_ptr, slot_ptr, kv_ptr, ws_ptr,
                  cnt_ptr, M, N, K, k_per_split, x_stride, w_stride, out_stride, res_stride, eps, pair_offset,
                  cache_kv_stride, cache_slot_stride, cache_head_stride, num_q_heads, num_kv_heads,
                  MODE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, NACC: tl.constexpr,
                  BLOCK_T: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, PRENORM: tl.constexpr,
                  TRIGGER: tl.constexpr = False):
    """The arguments of decode_kernel._decode_kernel (BLOCK_T 1, M <= 1); grid (1, N-tiles,
    SPLIT_K). EVEN: every split a whole number of BLOCK_K and every N-tile full (unmasked weight
    loads, the next tile's loads issued before the current tile's arithmetic). TRIGGER: as the
    tensor-core kernel's (a PDL-launched successor may launch from the start)."""
    tl.static_assert(BLOCK_T == 1)
    if PDL or TRIGGER:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows, row_ok, cols, col_ok, w_rows1, w_rows2, k_lo, k_hi = _tile_index(
        pid_m, pid_n, split, M, N, K, k_per_split, pair_offset, MODE, HALF, BLOCK_N, BLOCK_T)
    ko = tl.arange(0, BLOCK_K)
    p1 = w_ptr + w_rows1[:, None] * w_stride + ko[None, :]
    p2 = w_ptr + w_rows2[:, None] * w_stride + ko[None, :]
    e1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    e2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
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
            e1, e2, sq = _row_fma(x_ptr, M, kk, kk < k_hi, nw, w1.to(tl.float32), w2.to(tl.float32), e1, e2, sq,
                                  MODE, HAS_NORM, False, WDT)
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
            e1, e2, sq = _row_fma(x_ptr, M, kk, k_ok, nw, w1, w2, e1, e2, sq, MODE, HAS_NORM, True, WDT)
    # one reduction over K per accumulator: [BLOCK_N, BLOCK_T = 1]
    acc1 = tl.sum(e1, axis=1)[:, None]
    acc2 = tl.sum(e2, axis=1)[:, None]
    ss = tl.zeros([BLOCK_T], tl.float32) + tl.sum(sq, axis=0)
    _finish(acc1, acc2, ss, rows, row_ok, cols, col_ok, w_rows1, w_rows2, K, eps, rs_ptr, b_ptr, out_ptr, out_stride,
            res_ptr, res_stride, cs_ptr, pos_ptr, slot_ptr, kv_ptr, cache_kv_stride, cache_slot_stride,
            cache_head_stride, num_q_heads, num_kv_heads, ws_ptr, cnt_ptr, pid_m, pid_n, split,
            MODE, HAS_NORM, HAS_BIAS, HALF, PRENORM, BLOCK_N, SPLIT_K, NACC, BLOCK_T)
