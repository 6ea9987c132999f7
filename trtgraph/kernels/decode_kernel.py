"""The fused decode GEMV's Triton kernel (kernels/decode_linear.py launches it and describes
it): the swap-AB K loops (paired rows in two tiles or stacked in one), RMSNorm's sum of
squares alongside, split-K merged by the last arriving program, the four epilogues, and the
programmatic-dependent-launch prologue (an L2 prefetch of the weights before the wait); and
the row pass that norms x ahead of the GEMV for PRENORM shapes (`_prenorm_kernel`).
MODE: 0 plain store, 1 residual add, 2 SiLU-and-mul, 3 RoPE + KV write, -1 plain store and the
greedy argmax (`_argmax_epilogue`: the LM head of a greedy step), -2 the argmax alone (a greedy
step's head: its logits are not needed, so none are written)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .sampling_common import _keys


@triton.jit
def _epilogue(acc1, acc2, ss, rows, row_ok, cols, col_ok, w_rows1, w_rows2, K, eps, rs_ptr, b_ptr, out_ptr, out_stride,
              res_ptr, res_stride, cs_ptr, pos_ptr, slot_ptr, kv_ptr, cache_kv_stride, cache_slot_stride,
              cache_head_stride, num_q_heads, num_kv_heads,
              MODE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
              PRENORM: tl.constexpr):
    """acc [BLOCK_N (output columns), BLOCK_T (rows)] -> the op's outputs. PRENORM: x came normed
    but for its rstd, which rs_ptr holds per row. MODE -1 reads three pointers the plain store
    leaves free: res_ptr the rows' packed running maxima, slot_ptr the tokens, kv_ptr the m-tiles'
    arrival counters (_argmax_epilogue)."""
    if HAS_NORM or PRENORM:
        if PRENORM:
            rstd = tl.load(rs_ptr + rows, mask=row_ok, other=0.0)
        else:
            rstd = tl.rsqrt(ss / K + eps)
        acc1 = acc1 * rstd[None, :]
        if MODE >= 2:
            acc2 = acc2 * rstd[None, :]
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + w_rows1, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        if MODE >= 2:
            acc2 += tl.load(b_ptr + w_rows2, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    mask = col_ok[:, None] & row_ok[None, :]
    dst = out_ptr + rows[None, :] * out_stride + cols[:, None]
    if MODE <= 0:
        if MODE != -2:
            tl.store(dst, acc1.to(out_ptr.dtype.element_ty), mask=mask)
        if MODE < 0:
            _argmax_epilogue(acc1, rows, row_ok, cols, col_ok, res_ptr, slot_ptr, kv_ptr)
    elif MODE == 1:
        r = tl.load(res_ptr + rows[None, :] * res_stride + cols[:, None], mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, (r + acc1).to(out_ptr.dtype.element_ty), mask=mask)
    elif MODE == 2:
        tl.store(dst, (acc1 / (1.0 + tl.exp(-acc1)) * acc2).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # cols index (head, d) for d < D/2; acc1 the first halves, acc2 their partners
        head = cols // HALF
        d = cols % HALF
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
        cs = cs_ptr + pos[None, :] * (2 * HALF) + d[:, None]
        cos = tl.load(cs, mask=mask, other=0.0)
        sin = tl.load(cs + HALF, mask=mask, other=0.0)
        is_v = head >= num_q_heads + num_kv_heads
        r1 = tl.where(is_v[:, None], acc1, acc1 * cos - acc2 * sin)
        r2 = tl.where(is_v[:, None], acc2, acc2 * cos + acc1 * sin)
        is_q = head < num_q_heads
        qd = out_ptr + rows[None, :] * out_stride + (head * 2 * HALF + d)[:, None]
        qm = mask & is_q[:, None]
        tl.store(qd, r1.to(out_ptr.dtype.element_ty), mask=qm)
        tl.store(qd + HALF, r2.to(out_ptr.dtype.element_ty), mask=qm)
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=0)
        kvh = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
        kd = (kv_ptr + tl.where(is_v, cache_kv_stride, 0)[:, None] + slot[None, :] * cache_slot_stride
              + (kvh * cache_head_stride + d)[:, None])
        km = mask & (~is_q)[:, None]
        tl.store(kd, r1.to(kv_ptr.dtype.element_ty), mask=km)
        tl.store(kd + HALF, r2.to(kv_ptr.dtype.element_ty), mask=km)


@triton.jit
def _argmax_epilogue(acc, rows, row_ok, cols, col_ok, best_ptr, tok_ptr, cnt_ptr):
    """The greedy argmax of fp32 logits in the GEMV's epilogue (sampler_reference.greedy's: the
    first maximal column, NaN above every number, -0.0 == +0.0). Each tile folds its columns into
    its rows' running maxima, one atomic max per row of a packed key (the value's order key, then
    2**24 - 1 - column: ties go to the first column); the last of an m-tile's N-tiles to arrive
    takes its rows' maxima (resetting them to -1 in the same exchange), writes their columns as the
    tokens and puts its counter back to 0, so graph replays need no reset. Columns < 2**24."""
    key = tl.where(acc != acc, 4294967296, _keys(acc))
    packed = tl.where(col_ok[:, None], (key << 24) | (16777215 - cols.to(tl.int64))[:, None], -1)
    tl.atomic_max(best_ptr + rows, tl.max(packed, axis=0), mask=row_ok, sem="relaxed")
    tl.debug_barrier()
    m = tl.program_id(0)
    if tl.atomic_add(cnt_ptr + m, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        best = tl.atomic_xchg(best_ptr + rows, tl.full(rows.shape, -1, tl.int64), mask=row_ok, sem="acq_rel")
        tl.store(tok_ptr + rows, 16777215 - (best & 16777215), mask=row_ok)
        tl.atomic_xchg(cnt_ptr + m, 0)


@triton.jit
def _prenorm_kernel(x_ptr, nw_ptr, xs_ptr, rs_ptr, K, x_stride, eps, BLOCK_K: tl.constexpr):
    """One row of x per program: xs = x * norm_weight (fp32 product, rounded to xs's dtype, as the
    K loop's HAS_NORM tile is) and rs = rsqrt(mean(x^2) + eps), for a GEMV that streams xs
    straight into shared memory instead of norming its x tile in every program (PRENORM)."""
    row = tl.program_id(0)
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        ok = kk < K
        xt = tl.load(x_ptr + row * x_stride + kk, mask=ok, other=0.0).to(tl.float32)
        ss += xt * xt
        nw = tl.load(nw_ptr + kk, mask=ok, other=0.0).to(tl.float32)
        tl.store(xs_ptr + row * K + kk, (xt * nw).to(xs_ptr.dtype.element_ty), mask=ok)
    tl.store(rs_ptr + row, tl.rsqrt(tl.sum(ss, axis=0) / K + eps))


@triton.jit
def _x_tile(x_ptr, nw_ptr, rows, row_ok, kk, k_hi, x_stride, ss, HAS_NORM: tl.constexpr, EVEN: tl.constexpr):
    """x[rows, kk] in fp32, times the norm weight (RMSNorm's scale comes in the epilogue), and
    the sum of squares so far -> (x tile [BLOCK_T, BLOCK_K], ss)."""
    if EVEN:
        xt = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_ok[:, None], other=0.0)
        xt = xt.to(tl.float32)
        if HAS_NORM:
            ss += tl.sum(xt * xt, axis=1)
            xt = xt * tl.load(nw_ptr + kk).to(tl.float32)[None, :]
    else:
        k_ok = kk < k_hi
        xt = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        if HAS_NORM:
            ss += tl.sum(xt * xt, axis=1)
            xt = xt * tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return xt, ss


@triton.jit
def _k_loop(x_ptr, nw_ptr, w_ptr, rows, row_ok, w_rows1, w_rows2, col_ok, k_lo, k_hi, x_stride, w_stride,
            MODE: tl.constexpr, HAS_NORM: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, EVEN: tl.constexpr):
    """The K loop: the x tile times the weight rows w_rows1 (and their partners w_rows2 for
    MODE 2 / 3) -> (acc1, acc2, ss). EVEN: every split a whole number of BLOCK_K and every
    N-tile full, so the weight loads are unmasked."""
    acc1 = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xt, ss = _x_tile(x_ptr, nw_ptr, rows, row_ok, kk, k_hi, x_stride, ss, HAS_NORM, EVEN)
        xb = tl.trans(xt.to(w_ptr.dtype.element_ty))
        wm = col_ok[:, None] & (kk < k_hi)[None, :]
        if EVEN:
            w1 = tl.load(w_ptr + w_rows1[:, None] * w_stride + kk[None, :])
        else:
            w1 = tl.load(w_ptr + w_rows1[:, None] * w_stride + kk[None, :], mask=wm, other=0.0)
        acc1 = tl.dot(w1, xb, acc1, input_precision=PRECISION)
        if MODE >= 2:
            if EVEN:
                w2 = tl.load(w_ptr + w_rows2[:, None] * w_stride + kk[None, :])
            else:
                w2 = tl.load(w_ptr + w_rows2[:, None] * w_stride + kk[None, :], mask=wm, other=0.0)
            acc2 = tl.dot(w2, xb, acc2, input_precision=PRECISION)
    return acc1, acc2, ss


@triton.jit
def _stacked_k_loop(x_ptr, nw_ptr, w_ptr, rows, row_ok, w_rows, ok, k_lo, k_hi, x_stride, w_stride,
                    HAS_NORM: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_T: tl.constexpr, EVEN: tl.constexpr):
    """The paired-row K loop with both halves in one tile (w_rows, ok: [2 * BLOCK_N], the first
    rows then their partners) -> (acc of the first rows, acc of the partners, ss)."""
    acc = tl.zeros([2 * BLOCK_N, BLOCK_T], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xt, ss = _x_tile(x_ptr, nw_ptr, rows, row_ok, kk, k_hi, x_stride, ss, HAS_NORM, EVEN)
        if EVEN:
            w = tl.load(w_ptr + w_rows[:, None] * w_stride + kk[None, :])
        else:
            w = tl.load(w_ptr + w_rows[:, None] * w_stride + kk[None, :], mask=ok[:, None] & (kk < k_hi)[None, :],
                        other=0.0)
        acc = tl.dot(w, tl.trans(xt.to(w_ptr.dtype.element_ty)), acc, input_precision=PRECISION)
    acc1, acc2 = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_T)), (1, 2, 0)))
    return acc1, acc2, ss


@triton.jit
def _prefetch_l2(ptrs, NBYTES: tl.constexpr):
    """cp.async.bulk.prefetch.L2 of NBYTES (a multiple of 16, 16-byte aligned) from each pointer."""
    size = tl.full(ptrs.shape, NBYTES, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                              [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decode_kernel(x_ptr, nw_ptr, rs_ptr, w_ptr, b_ptr, out_ptr, res_ptr, cs_ptr, pos_ptr, slot_ptr, kv_ptr, ws_ptr,
                   cnt_ptr, M, N, K, k_per_split, x_stride, w_stride, out_stride, res_stride, eps, pair_offset,
                   cache_kv_stride, cache_slot_stride, cache_head_stride, num_q_heads, num_kv_heads,
                   MODE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, NACC: tl.constexpr, BLOCK_T: tl.constexpr, EVEN: tl.constexpr,
                   STACK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, PRENORM: tl.constexpr,
                   TRIGGER: tl.constexpr = False):
    """N: output columns (pairs for MODE 2 / 3); grid (m-tiles of BLOCK_T rows, N-tiles, SPLIT_K).
    PDL (launched with programmatic dependent launch): let the next kernel launch now, put the
    first PREFETCH bytes of each of this program's weight rows on their way to L2 (the weights
    do not depend on the previous kernel), then wait for the previous kernel's writes.
    TRIGGER: let a PDL-launched successor (attention) launch from the start, PDL or not."""
    if PDL or TRIGGER:
        gdc_launch_dependents()
    _tile(x_ptr, nw_ptr, rs_ptr, w_ptr, b_ptr, out_ptr, res_ptr, cs_ptr, pos_ptr, slot_ptr, kv_ptr, ws_ptr, cnt_ptr,
          tl.program_id(0), tl.program_id(1), tl.program_id(2), M, N, K, k_per_split, x_stride, w_stride, out_stride,
          res_stride, eps, pair_offset, cache_kv_stride, cache_slot_stride, cache_head_stride, num_q_heads,
          num_kv_heads, MODE, HAS_NORM, HAS_BIAS, HALF, PRECISION, BLOCK_N, BLOCK_K, SPLIT_K, NACC, BLOCK_T, EVEN,
          STACK, PDL, PREFETCH, PRENORM)


@triton.jit
def _tile_index(pid_m, pid_n, split, M, N, K, k_per_split, pair_offset, MODE: tl.constexpr, HALF: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """A work item's rows and output columns (with their masks), the weight rows its columns
    pair (RoPE, MODE 3: a head's first-half row and its partner HALF rows on; otherwise the
    column and the column pair_offset rows on) and its split's K range [k_lo, k_hi)."""
    rows = pid_m * BLOCK_T + tl.arange(0, BLOCK_T)
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
    return rows, row_ok, cols, col_ok, w_rows1, w_rows2, k_lo, k_hi


@triton.jit
def _tile(x_ptr, nw_ptr, rs_ptr, w_ptr, b_ptr, out_ptr, res_ptr, cs_ptr, pos_ptr, slot_ptr, kv_ptr, ws_ptr, cnt_ptr,
          pid_m, pid_n, split, M, N, K, k_per_split, x_stride, w_stride, out_stride, res_stride, eps, pair_offset,
          cache_kv_stride, cache_slot_stride, cache_head_stride, num_q_heads, num_kv_heads,
          MODE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
          PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
          NACC: tl.constexpr, BLOCK_T: tl.constexpr, EVEN: tl.constexpr, STACK: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr, PRENORM: tl.constexpr):
    """One work item of the kernel: the output tile (pid_m, pid_n)'s split `split` (the
    tensor-core kernel's program; the persistent layer tail, kernels/decode_persistent.py, runs
    several per program). PDL: the weight prefetch, then the wait for the previous kernel."""
    rows, row_ok, cols, col_ok, w_rows1, w_rows2, k_lo, k_hi = _tile_index(
        pid_m, pid_n, split, M, N, K, k_per_split, pair_offset, MODE, HALF, BLOCK_N, BLOCK_T)
    if STACK:  # paired rows as one [2 * BLOCK_N, BLOCK_K] tile: one MMA twice as tall per K step
        jj = tl.arange(0, 2 * BLOCK_N)
        cc = pid_n * BLOCK_N + jj % BLOCK_N
        if MODE == 3:
            w_rows = (cc // HALF) * (2 * HALF) + cc % HALF + tl.where(jj >= BLOCK_N, HALF, 0)
        else:
            w_rows = cc + tl.where(jj >= BLOCK_N, pair_offset, 0)
        if PDL:
            if PREFETCH > 0:
                _prefetch_l2(w_ptr + w_rows.to(tl.int64) * w_stride + k_lo, PREFETCH)
            gdc_wait()
        acc1, acc2, ss = _stacked_k_loop(x_ptr, nw_ptr, w_ptr, rows, row_ok, w_rows, cc < N, k_lo, k_hi,
                                         x_stride, w_stride, HAS_NORM, PRECISION, BLOCK_N, BLOCK_K, BLOCK_T, EVEN)
    else:
        if PDL:
            if PREFETCH > 0:
                _prefetch_l2(w_ptr + w_rows1.to(tl.int64) * w_stride + k_lo, PREFETCH)
                if MODE >= 2:
                    _prefetch_l2(w_ptr + w_rows2.to(tl.int64) * w_stride + k_lo, PREFETCH)
            gdc_wait()
        acc1, acc2, ss = _k_loop(x_ptr, nw_ptr, w_ptr, rows, row_ok, w_rows1, w_rows2, col_ok, k_lo, k_hi,
                                 x_stride, w_stride, MODE, HAS_NORM, PRECISION, BLOCK_N, BLOCK_K, BLOCK_T, EVEN)
    _finish(acc1, acc2, ss, rows, row_ok, cols, col_ok, w_rows1, w_rows2, K, eps, rs_ptr, b_ptr, out_ptr, out_stride,
            res_ptr, res_stride, cs_ptr, pos_ptr, slot_ptr, kv_ptr, cache_kv_stride, cache_slot_stride,
            cache_head_stride, num_q_heads, num_kv_heads, ws_ptr, cnt_ptr, pid_m, pid_n, split,
            MODE, HAS_NORM, HAS_BIAS, HALF, PRENORM, BLOCK_N, SPLIT_K, NACC, BLOCK_T)


@triton.jit
def _finish(acc1, acc2, ss, rows, row_ok, cols, col_ok, w_rows1, w_rows2, K, eps, rs_ptr, b_ptr, out_ptr, out_stride,
            res_ptr, res_stride, cs_ptr, pos_ptr, slot_ptr, kv_ptr, cache_kv_stride, cache_slot_stride,
            cache_head_stride, num_q_heads, num_kv_heads, ws_ptr, cnt_ptr, pid_m, pid_n, split,
            MODE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
            PRENORM: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, NACC: tl.constexpr,
            BLOCK_T: tl.constexpr):
    """A program's partial sums -> the op's outputs: the epilogue at once without split-K, else the
    partials to the workspace, the arrival, and the last arriving split's sum (in split order) and
    epilogue (shared by the tensor-core kernel and decode_light's CUDA-core one)."""
    if SPLIT_K == 1:
        _epilogue(acc1, acc2, ss, rows, row_ok, cols, col_ok, w_rows1, w_rows2, K, eps, rs_ptr, b_ptr, out_ptr,
                  out_stride,
                  res_ptr, res_stride, cs_ptr, pos_ptr, slot_ptr, kv_ptr, cache_kv_stride, cache_slot_stride,
                  cache_head_stride, num_q_heads, num_kv_heads, MODE, HAS_NORM, HAS_BIAS, HALF, PRENORM)
    else:
        # workspace [tiles, SPLIT_K, (acc1 | acc2 | ss)]: acc as [BLOCK_N, BLOCK_T], ss as [BLOCK_T]
        SLOT: tl.constexpr = (NACC * BLOCK_N + 1) * BLOCK_T
        tile = pid_m * tl.num_programs(1) + pid_n
        idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        base = ws_ptr + (tile * SPLIT_K + split).to(tl.int64) * SLOT
        tl.store(base + idx, acc1)
        if MODE >= 2:
            tl.store(base + BLOCK_N * BLOCK_T + idx, acc2)
        tl.store(base + NACC * BLOCK_N * BLOCK_T + tl.arange(0, BLOCK_T), ss)
        # the split that arrives last sums all of them, in split order, and resets the counter
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc1 = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            acc2 = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            ss = tl.zeros([BLOCK_T], tl.float32)
            for s in range(SPLIT_K):
                b = ws_ptr + (tile * SPLIT_K + s).to(tl.int64) * SLOT
                acc1 += tl.load(b + idx, cache_modifier=".cg")
                if MODE >= 2:
                    acc2 += tl.load(b + BLOCK_N * BLOCK_T + idx, cache_modifier=".cg")
                ss += tl.load(b + NACC * BLOCK_N * BLOCK_T + tl.arange(0, BLOCK_T), cache_modifier=".cg")
            _epilogue(acc1, acc2, ss, rows, row_ok, cols, col_ok, w_rows1, w_rows2, K, eps, rs_ptr, b_ptr, out_ptr,
                      out_stride, res_ptr, res_stride, cs_ptr, pos_ptr, slot_ptr, kv_ptr, cache_kv_stride,
                      cache_slot_stride, cache_head_stride, num_q_heads, num_kv_heads, MODE, HAS_NORM, HAS_BIAS,
                      HALF, PRENORM)
            tl.atomic_xchg(cnt_ptr + tile, 0)
