"""Paged attention for decode (q = 1), verification (q = 1 + k) and prefill chunks: one Triton
kernel of the torch reference's signature (kernels/reference.py), split-KV with the merge done
by the split that finishes last. Capture-safe like triton_ops' kernels: grids and constexprs
depend on the key's shapes only; context lengths are read on the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .triton_ops import arrival_counters, pdl_capable

# ---------------------------------------------------------------------------------------
# Paged attention: one kernel for decode (q=1), verification (q=1+k) and prefill chunks
# ---------------------------------------------------------------------------------------


@triton.jit
def _attend_tiles(q, k_base, bt_row, pos, ctx, start, end, cache_kv_stride, cache_block_stride, cache_slot_stride,
                  scale_log2, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of the rows' queries q [M, D] over KV tiles [start, end) of one sequence
    (block-table row bt_row) and one kv head (k_base): (running max m, sum l, accumulator), in
    log2 units; a query t sees keys 0..pos[t]."""
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile in range(start, end):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < ctx
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0)
        off = page * cache_block_stride + (n % PAGE) * cache_slot_stride
        k = tl.load(k_base + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N], log2 units
        s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(k_base + cache_kv_stride + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attn_kernel(q_ptr, kv_ptr, bt_ptr, pos_ptr, out_ptr, part_acc_ptr, part_ml_ptr, arrivals_ptr,
                       q_stride_t, q_stride_h, cache_kv_stride, cache_block_stride, cache_slot_stride,
                       cache_head_stride, bt_stride, scale_log2,
                       Q_LEN: tl.constexpr, GROUP: tl.constexpr, NUM_Q_BLOCKS: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, SPLIT_TILES: tl.constexpr, MIN_TILES: tl.constexpr,
                       PAGE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:  # a successor launched with programmatic dependent launch (the o GEMV) may start now
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = pid // NUM_Q_BLOCKS
    qb = pid % NUM_Q_BLOCKS
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)

    # Rows of this program: (token, head-in-group) pairs of one sequence and one kv head.
    r = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < Q_LEN * GROUP
    tok = b * Q_LEN + r // GROUP
    head = kvh * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)  # query t sees keys 0..pos[t]
    q = tl.load(q_ptr + tok[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                mask=row_ok[:, None], other=0.0)
    ctx = tl.max(pos, axis=0) + 1

    # Batch-invariant (SPLIT_TILES > 0): split s owns KV tiles [s * SPLIT_TILES, (s + 1) *
    # SPLIT_TILES), so where a row's KV range is cut depends on its own context length only.
    # Adaptive (SPLIT_TILES == 0): the row's tiles are shared out over the key's NUM_SPLITS,
    # at least MIN_TILES each (a short context is one split: no merge).
    tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = SPLIT_TILES if SPLIT_TILES > 0 else tl.maximum(tl.cdiv(tiles, NUM_SPLITS), MIN_TILES)
    start = split * per_split
    end = tl.minimum(start + per_split, tiles) if NUM_SPLITS > 1 else tiles

    m_i, l_i, acc = _attend_tiles(q, kv_ptr + kvh * cache_head_stride, bt_ptr + b * bt_stride, pos, ctx, start, end,
                                  cache_kv_stride, cache_block_stride, cache_slot_stride, scale_log2,
                                  PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION)

    if NUM_SPLITS == 1:
        _store_rows(out_ptr, acc, l_i, tok, head, row_ok, q_stride_t, q_stride_h, HEAD_DIM)
    else:
        # Splits past the row's context (most of them at short contexts) have nothing to add.
        used = tl.maximum(tl.cdiv(tiles, tl.maximum(per_split, 1)), 1)
        if used == 1:
            # The whole context in split 0: it writes the rows itself, no partials, counter or
            # merge (the merge of one split is acc / l, bitwise: its weight is exp2(0) = 1).
            if split == 0:
                _store_rows(out_ptr, acc, l_i, tok, head, row_ok, q_stride_t, q_stride_h, HEAD_DIM)
        elif split < used:
            # partials [programs(0), kv heads, splits, BLOCK_M, (D | 2)]
            base = ((pid * num_kv_heads + kvh) * NUM_SPLITS + split) * BLOCK_M
            rows = base + tl.arange(0, BLOCK_M)
            tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], acc)
            tl.store(part_ml_ptr + rows * 2, m_i)
            tl.store(part_ml_ptr + rows * 2 + 1, l_i)
            # The split that arrives last merges all of them (in split order, whichever it is)
            # and puts the counter back to 0 for the next launch: no second kernel.
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals_ptr + pid * num_kv_heads + kvh, 1, sem="acq_rel")
            if arrived == used - 1:
                _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, pid * num_kv_heads + kvh, used, tok, head, row_ok,
                              q_stride_t, q_stride_h, NUM_SPLITS, HEAD_DIM, BLOCK_M)
                tl.atomic_xchg(arrivals_ptr + pid * num_kv_heads + kvh, 0)


@triton.jit
def _store_rows(out_ptr, acc, l_i, tok, head, row_ok, q_stride_t, q_stride_h, HEAD_DIM: tl.constexpr):
    """out rows = acc / l (0 where a row saw no key)."""
    d = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, program, used, tok, head, row_ok, q_stride_t, q_stride_h,
                  NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """out = the partial softmax sums of splits 0 .. used - 1 merged, in split order."""
    d = tl.arange(0, HEAD_DIM)
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(used):
        rows = (program * NUM_SPLITS + s) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_all = tl.maximum(m_all, tl.load(part_ml_ptr + rows * 2, cache_modifier=".cg"))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(used):
        rows = (program * NUM_SPLITS + s) * BLOCK_M + tl.arange(0, BLOCK_M)
        w = tl.exp2(tl.load(part_ml_ptr + rows * 2, cache_modifier=".cg") - m_safe)
        l_all += w * tl.load(part_ml_ptr + rows * 2 + 1, cache_modifier=".cg")
        acc += w[:, None] * tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg")
    _store_rows(out_ptr, acc, l_all, tok, head, row_ok, q_stride_t, q_stride_h, HEAD_DIM)


_NUM_SMS: dict = {}
# Batch-invariant split-KV (fixed pieces of KV tiles) or the faster adaptive split (as many
# splits as fill the GPU for this key's batch). The executor sets it once at build from the
# config's `deterministic`, before any warm-up or capture.
_INVARIANT_ATTENTION = [True]


def set_attention_invariant(invariant: bool) -> None:
    _INVARIANT_ATTENTION[0] = bool(invariant)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def _piece_tiles(device: torch.device) -> int:
    """KV tiles per split: the fixed piece of the invariant mode, the least of the adaptive one."""
    return 4 if device.type == "cuda" else 2


def attention_launch_shape(batch: int, q_len: int, group: int, num_kv_heads: int, max_len: int,
                           device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, query blocks per sequence, KV splits, KV tiles per split): a pure
    function of the key's shapes, so a recorded graph always launches the same grid.

    Batch-invariant (the default, and `deterministic: true`): decode splits the KV range into
    fixed pieces of `tiles per split` tiles (flash-decoding), so a row's reduction order
    depends on its own context length only: the same in every bucket and whatever else shares
    the step; splits past a row's context do no work. Adaptive (`deterministic: false`):
    tiles per split is 0 and the key gets as many splits as fill the GPU about twice over,
    each row's tiles shared out over them, at least a piece each (a context of one piece is
    one split: no partials to merge) — faster at large batches, but a row's rounding
    then depends on its bucket."""
    rows = q_len * group
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = 64 if device.type == "cuda" else 16
    q_blocks = triton.cdiv(rows, block_m)
    max_tiles = triton.cdiv(max_len, block_n)
    piece = _piece_tiles(device)
    if _INVARIANT_ATTENTION[0]:
        splits = 1 if q_len > 1 else triton.cdiv(max_tiles, piece)
        return block_m, block_n, q_blocks, splits, piece
    programs = batch * q_blocks * num_kv_heads
    splits = 1 if q_len > 1 else max(1, min(triton.cdiv(max_tiles, piece), 2 * _num_sms(device) // programs, 32))
    return block_m, block_n, q_blocks, splits, 0


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    batch = num_tokens // q_len
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    tables = block_tables[:batch]
    block_m, block_n, q_blocks, splits, split_tiles = attention_launch_shape(
        batch, q_len, group, num_kv_heads, tables.shape[1] * page, q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    grid = (batch * q_blocks, num_kv_heads, splits)
    if splits > 1:
        part_acc = torch.empty((batch * q_blocks * num_kv_heads * splits * block_m, head_dim),
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch * q_blocks * num_kv_heads * splits * block_m, 2),
                              dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    assert q.stride(0) == out.stride(0) and q.stride(1) == out.stride(1) and kv_cache.is_contiguous()
    scale_log2 = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    common = dict(Q_LEN=q_len, GROUP=group, NUM_Q_BLOCKS=q_blocks, NUM_SPLITS=splits, SPLIT_TILES=split_tiles,
                  MIN_TILES=_piece_tiles(q.device),
                  HEAD_DIM=head_dim, BLOCK_M=block_m)
    arrivals = arrival_counters(batch * q_blocks * num_kv_heads, q.device) if splits > 1 else out
    _paged_attn_kernel[grid](q, kv_cache, tables, positions, out, part_acc, part_ml, arrivals,
                             q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
                             kv_cache.stride(2), kv_cache.stride(3), tables.stride(0), scale_log2,
                             PAGE=page, BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                             TRIGGER=ATTENTION_TRIGGER and pdl_capable(q.device), **common)
    return out


# The attention kernel lets its successor (the o projection, when launched with programmatic
# dependent launch: decode_linear._PDL_MODES) start from its first instruction. Off with PDL.
ATTENTION_TRIGGER = False
