"""Paged attention for decode (q = 1), verification (q = 1 + k) and prefill chunks: one Triton
kernel of the torch reference's signature (kernels/reference.py), split-KV with the merge done
by the piece that finishes last. Capture-safe like triton_ops' kernels: grids and constexprs
depend on the key's shapes only; context lengths are read on the device.

`rope_paged_attention` is the same kernel with RoPE and the KV-cache write folded in (decode
keys whose qkv projection is not a fused kernel): every program rotates its q rows, and the
program that owns a row's last KV piece rotates the step's k and writes k and v to the cache;
then either (the adaptive mode's `fold`) every program of the row takes them into its softmax
from registers, the last piece after its cached tiles, or (the invariant mode) that program
reads them back with the rest of its piece after a barrier. Decode launches of few sequences are
PDL-launched: block table read before they wait for the qkv. The host-side choices (config per
mode and key shape, launch shape, the PDL / prefetch / trigger knobs) are attention_config.py's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import attention_config as cfg
from .attention_config import set_attention_invariant  # noqa: F401  (the executor's import)
from .triton_ops import arrival_counters, pdl_capable

# ---------------------------------------------------------------------------------------
# Paged attention: one kernel for decode (q=1), verification (q=1+k) and prefill chunks
# ---------------------------------------------------------------------------------------


@triton.jit
def _load_kv(k_base, page, n, n_ok, cache_kv_stride, cache_block_stride, cache_slot_stride, PAGE: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    """K and V rows n (those n_ok; 0 elsewhere) of one kv head, their pages given: [N, D] each."""
    d = tl.arange(0, HEAD_DIM)
    off = page * cache_block_stride + (n % PAGE) * cache_slot_stride
    k = tl.load(k_base + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(k_base + cache_kv_stride + off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _tile_update(q, k, v, n, pos, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr):
    """One KV tile (keys n, K and V [N, D]) into the rows' online softmax; a query t sees keys
    0..pos[t]."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N], log2 units
    s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tiles(q, k_base, bt_row, pos, ctx, start, end, cache_kv_stride, cache_block_stride, cache_slot_stride,
                  scale_log2, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of the rows' queries q [M, D] over KV tiles [start, end) of one sequence
    (block-table row bt_row) and one kv head (k_base): (running max m, sum l, accumulator), in
    log2 units; a query t sees keys 0..pos[t]. K and V of a tile are loaded together."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile in range(start, end):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < ctx
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0)
        k, v = _load_kv(k_base, page, n, n_ok, cache_kv_stride, cache_block_stride, cache_slot_stride, PAGE, HEAD_DIM)
        m_i, l_i, acc = _tile_update(q, k, v, n, pos, m_i, l_i, acc, scale_log2, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _rotate(x_ptr, rows, stride, pos, cs_ptr, mask, HEAD_DIM: tl.constexpr):
    """Rotate-half RoPE of rows [M, D] at x_ptr + rows * stride in fp32 (rounded by the caller),
    as triton_ops._rope_kv_kernel: first half x1 cos - x2 sin, second half x2 cos + x1 sin."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + rows[:, None] * stride + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    other = tl.load(x_ptr + rows[:, None] * stride + ((d + HALF) % HEAD_DIM)[None, :], mask=mask[:, None],
                    other=0.0).to(tl.float32)
    cs = cs_ptr + pos[:, None] * HEAD_DIM + (d % HALF)[None, :]
    cos = tl.load(cs, mask=mask[:, None], other=0.0)
    sin = tl.load(cs + HALF, mask=mask[:, None], other=0.0)
    return tl.where(d[None, :] < HALF, x * cos - other * sin, x * cos + other * sin)


@triton.jit
def _new_kv(k_ptr, v_ptr, tok, kvh, k_stride_t, k_stride_h, v_stride_t, v_stride_h, pos, cs_ptr, slot_ptr,
            kv_ptr, HEAD_DIM: tl.constexpr):
    """The step's token tok of kv head kvh: k rotated and v, as the cache holds them, [1, D] each,
    and its cache slot [1] (read here, early: a store at the end must not wait for it)."""
    d = tl.arange(0, HEAD_DIM)
    one = tl.arange(0, 1)
    toks = tok + one
    slot = tl.load(slot_ptr + toks)
    k = _rotate(k_ptr + kvh * k_stride_h, toks, k_stride_t, pos + one, cs_ptr, one == 0, HEAD_DIM)
    v = tl.load(v_ptr + toks[:, None] * v_stride_t + kvh * v_stride_h + d[None, :])
    return k.to(kv_ptr.dtype.element_ty), v, slot


@triton.jit
def _store_new_kv(k, v, slot, kvh, kv_ptr, cache_kv_stride, cache_slot_stride, cache_head_stride, write,
                  HEAD_DIM: tl.constexpr):
    """k and v [1, D] of the step's token, kv head kvh, stored at its cache slot [1] where `write`."""
    d = tl.arange(0, HEAD_DIM)
    dst = kv_ptr + slot[:, None] * cache_slot_stride + kvh * cache_head_stride + d[None, :]
    write = d[None, :] < tl.where(write, HEAD_DIM, 0)  # [1, D]: all or none
    tl.store(dst, k, mask=write)
    tl.store(dst + cache_kv_stride, v, mask=write)


@triton.jit
def _fold_new_key(q, k, v, m_i, l_i, acc, live, scale_log2, PRECISION: tl.constexpr, MODE: tl.constexpr):
    """One more key (k, v: [1, D], the step's own, from registers) into the online softmax of the
    rows `live` (others unchanged: their score is -inf). MODE 1: element-wise, the score in log2
    units, p rounded to v's dtype for the product, as a tile takes it; MODE 2: as a 16-key tile
    through the tile's own dots, the key in its first row (the others masked)."""
    if MODE == 2:
        j = tl.arange(0, 16)
        kt = tl.where(j[:, None] == 0, k, 0.0).to(k.dtype)  # [16, D]
        vt = tl.where(j[:, None] == 0, v, 0.0).to(v.dtype)
        return _tile_update(q, kt, vt, j, tl.where(live, 0, -1), m_i, l_i, acc, scale_log2, PRECISION)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale_log2  # [M]
    s = tl.where(live, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _prefetch_kv(k_base, bt_row, lo, hi, num_blocks, cache_kv_stride, cache_block_stride, cache_slot_stride,
                 PAGE: tl.constexpr, ROWS: tl.constexpr, NBYTES: tl.constexpr):
    """cp.async.bulk.prefetch.L2 of one kv head's K and V rows lo .. min(lo + ROWS, hi) - 1 of a
    sequence (NBYTES each: a head's row; a multiple of 16, 16-byte aligned), their pages read
    from the block-table row; the page index clamped into the cache, so no address leaves it."""
    n = lo + tl.arange(0, ROWS)
    ok = n < hi
    n = tl.where(ok, n, lo)
    page = tl.load(bt_row + n // PAGE, mask=ok, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
    ptrs = k_base + page * cache_block_stride + (n % PAGE) * cache_slot_stride
    size = tl.full([ROWS], NBYTES, tl.int32)
    on = ok.to(tl.int32)
    for kv in tl.static_range(2):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptrs + kv * cache_kv_stride, size, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _paged_attn_kernel(q_ptr, kv_ptr, bt_ptr, pos_ptr, out_ptr, part_acc_ptr, part_ml_ptr, arrivals_ptr,
                       k_ptr, v_ptr, cs_ptr, slot_ptr,
                       q_stride_t, q_stride_h, out_stride_t, out_stride_h, k_stride_t, k_stride_h,
                       v_stride_t, v_stride_h, cache_kv_stride, cache_block_stride, cache_slot_stride,
                       cache_head_stride, bt_stride, bt_width, scale_log2, num_pieces, num_blocks,
                       Q_LEN: tl.constexpr, GROUP: tl.constexpr, NUM_Q_BLOCKS: tl.constexpr,
                       SPLIT: tl.constexpr, PIECE_TILES: tl.constexpr, MIN_TILES: tl.constexpr,
                       PAGE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, TRIGGER: tl.constexpr, ROPE: tl.constexpr,
                       PDL: tl.constexpr, PREFETCH_ROWS: tl.constexpr, PREFETCH_BYTES: tl.constexpr,
                       FOLD: tl.constexpr, EARLY: tl.constexpr):
    """TRIGGER: 0 none, 1 a PDL-launched successor may launch from this kernel's start, 2 from
    its start or, if this launch is PDL, once it has waited (ATTENTION_TRIGGER).
    PDL (launched with programmatic dependent launch, decode keys): everything up to
    `gdc_wait()` reads only what no kernel of the step's chain writes, and puts the program's
    first KV rows on their way to L2; q, the step's k / v and the KV loads come after the wait
    (docs/design.md, "Paged attention", says why that is safe).
    FOLD (1 or 2, with ROPE; 0: off): the tiles cover the row's cached keys only (ctx - 1), and the
    program of the last piece folds the step's key and value in from registers after them (its
    cache write is off the critical path: nothing in this launch reads it back, so it comes last).
    EARLY (adaptive): the pages of a row's first tile are read with the context lengths, its K and
    V loaded before q; a context of one piece takes that tile after the others (one round trip
    fewer before the first KV bytes move)."""
    if TRIGGER == 1 or (TRIGGER == 2 and not PDL):  # a PDL-launched successor (the o GEMV) may start now
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = pid // NUM_Q_BLOCKS
    qb = pid % NUM_Q_BLOCKS
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_split_programs = tl.num_programs(2)

    # Rows of this program: (token, head-in-group) pairs of one sequence and one kv head.
    r = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < Q_LEN * GROUP
    tok = b * Q_LEN + r // GROUP
    head = kvh * GROUP + r % GROUP
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)  # query t sees keys 0..pos[t]
    bt_row = bt_ptr + b * bt_stride
    if EARLY:  # the first tile's pages, read beside the positions (within the table: any entry is readable)
        n0 = tl.arange(0, BLOCK_N)
        page0 = tl.load(bt_row + n0 // PAGE, mask=n0 // PAGE < bt_width, other=0)
    ctx = tl.max(pos, axis=0) + 1
    kv_len = ctx - 1 if FOLD else ctx  # the keys the tiles cover
    seen = pos - 1 if FOLD else pos  # the last of them a query sees
    # The row's KV tiles are cut into pieces of `per_split` tiles. Batch-invariant (PIECE_TILES
    # > 0): a fixed number of tiles, so where a row's KV range is cut depends on its own context
    # length only. Adaptive (PIECE_TILES == 0): the row's tiles shared out over the key's
    # num_pieces, at least MIN_TILES each (a short context is one piece: no merge). The
    # grid's third axis strides over the pieces; pieces past the row's context do no work.
    tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = PIECE_TILES if PIECE_TILES > 0 else tl.maximum(tl.cdiv(tiles, num_pieces), MIN_TILES)
    if SPLIT:
        used = tl.maximum(tl.cdiv(tiles, tl.maximum(per_split, 1)), 1)
        owner = (used - 1) % num_split_programs
    else:
        used = 1
        owner = 0
    k_base = kv_ptr + kvh * cache_head_stride
    if PDL:
        if PREFETCH_BYTES > 0:
            if split < used:  # the first rows of this program's first piece, K and V, towards L2
                lo = split * per_split * BLOCK_N
                _prefetch_kv(k_base, bt_row, lo, tl.minimum(lo + per_split * BLOCK_N, kv_len), num_blocks,
                             cache_kv_stride, cache_block_stride, cache_slot_stride, PAGE, PREFETCH_ROWS,
                             PREFETCH_BYTES)
        gdc_wait()  # the predecessors' writes (q, the step's k and v or the cache rows) visible from here
        if TRIGGER == 2:  # the successor launches now, not while the predecessor still runs
            gdc_launch_dependents()
    if EARLY:  # the first tile's K and V on their way before q (rows past the context: 0, never read)
        lim0 = tl.where((used == 1) & (split == 0), kv_len, 0) if SPLIT else kv_len  # the one-piece program's only
        k0, v0 = _load_kv(k_base, page0, n0, n0 < lim0, cache_kv_stride, cache_block_stride, cache_slot_stride, PAGE,
                          HEAD_DIM)
    if ROPE:  # q rows rotated here, rounded to q's dtype as triton_ops.rope_write_kv rounds them
        q = _rotate(q_ptr + head[:, None] * q_stride_h, tok, q_stride_t, pos, cs_ptr, row_ok,
                    HEAD_DIM).to(q_ptr.dtype.element_ty)
    else:
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + tok[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                    mask=row_ok[:, None], other=0.0)
    if FOLD:  # every program of the row has the step's k and v in registers (the last piece's stores them, last)
        k_new, v_new, slot = _new_kv(k_ptr, v_ptr, b, kvh, k_stride_t, k_stride_h, v_stride_t, v_stride_h, ctx - 1,
                                     cs_ptr, slot_ptr, kv_ptr, HEAD_DIM)
    elif ROPE:  # Q_LEN == 1: the program of the last piece writes the step's k and v, then reads them back
        if split == owner:
            k_new, v_new, slot = _new_kv(k_ptr, v_ptr, b, kvh, k_stride_t, k_stride_h, v_stride_t, v_stride_h, ctx - 1,
                                         cs_ptr, slot_ptr, kv_ptr, HEAD_DIM)
            _store_new_kv(k_new, v_new, slot, kvh, kv_ptr, cache_kv_stride, cache_slot_stride, cache_head_stride,
                          split == owner, HEAD_DIM)
            tl.debug_barrier()
    if used == 1:
        # The whole context in one piece: its program writes the rows itself, no partials,
        # counter or merge (the merge of one piece is acc / l, bitwise: its weight is exp2(0) = 1).
        if split == 0:
            m_i, l_i, acc = _attend_tiles(q, k_base, bt_row, seen, kv_len, 1 if EARLY else 0, tiles, cache_kv_stride,
                                          cache_block_stride, cache_slot_stride, scale_log2,
                                          PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION)
            if EARLY:  # the first tile last (a context of no cached key: all masked, no change)
                m_i, l_i, acc = _tile_update(q, k0, v0, n0, seen, m_i, l_i, acc, scale_log2, PRECISION)
            if FOLD:
                m_i, l_i, acc = _fold_new_key(q, k_new, v_new, m_i, l_i, acc, row_ok, scale_log2, PRECISION, FOLD)
            _store_rows(out_ptr, acc, l_i, tok, head, row_ok, out_stride_t, out_stride_h, HEAD_DIM)
    else:
        row_pieces = (pid * num_kv_heads + kvh) * num_pieces
        for piece in range(split, used, num_split_programs):
            start = piece * per_split
            m_i, l_i, acc = _attend_tiles(q, k_base, bt_row, seen, kv_len, start,
                                          tl.minimum(start + per_split, tiles), cache_kv_stride, cache_block_stride,
                                          cache_slot_stride, scale_log2, PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION)
            if FOLD:  # the last piece takes the step's key after its tiles
                m_i, l_i, acc = _fold_new_key(q, k_new, v_new, m_i, l_i, acc, row_ok & (piece == used - 1),
                                              scale_log2, PRECISION, FOLD)
            # partials [programs(0), kv heads, pieces, BLOCK_M, (D | 2)]
            rows = (row_pieces + piece) * BLOCK_M + tl.arange(0, BLOCK_M)
            d = tl.arange(0, HEAD_DIM)
            tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], acc)
            tl.store(part_ml_ptr + rows * 2, m_i)
            tl.store(part_ml_ptr + rows * 2 + 1, l_i)
            # The piece that arrives last merges all of them (in piece order, whichever it is)
            # and puts the counter back to 0 for the next launch: no second kernel.
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals_ptr + pid * num_kv_heads + kvh, 1, sem="acq_rel")
            if arrived == used - 1:
                _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, pid * num_kv_heads + kvh, used, tok, head, row_ok,
                              out_stride_t, out_stride_h, num_pieces, HEAD_DIM, BLOCK_M)
                tl.atomic_xchg(arrivals_ptr + pid * num_kv_heads + kvh, 0)
    if FOLD:  # the step's k and v into the cache, by the last piece's program: nothing here reads them
        _store_new_kv(k_new, v_new, slot, kvh, kv_ptr, cache_kv_stride, cache_slot_stride, cache_head_stride,
                      split == owner, HEAD_DIM)


@triton.jit
def _store_rows(out_ptr, acc, l_i, tok, head, row_ok, out_stride_t, out_stride_h, HEAD_DIM: tl.constexpr):
    """out rows = acc / l (0 where a row saw no key)."""
    d = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * out_stride_t + head[:, None] * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, program, used, tok, head, row_ok, out_stride_t, out_stride_h,
                  num_pieces, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """out = the partial softmax sums of pieces 0 .. used - 1 merged, in piece order."""
    d = tl.arange(0, HEAD_DIM)
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(used):
        rows = (program * num_pieces + s) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_all = tl.maximum(m_all, tl.load(part_ml_ptr + rows * 2, cache_modifier=".cg"))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(used):
        rows = (program * num_pieces + s) * BLOCK_M + tl.arange(0, BLOCK_M)
        w = tl.exp2(tl.load(part_ml_ptr + rows * 2, cache_modifier=".cg") - m_safe)
        l_all += w * tl.load(part_ml_ptr + rows * 2 + 1, cache_modifier=".cg")
        acc += w[:, None] * tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg")
    _store_rows(out_ptr, acc, l_all, tok, head, row_ok, out_stride_t, out_stride_h, HEAD_DIM)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    return _launch(q, kv_cache, block_tables, positions, q_len, scale)


def rope_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                         positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         block_tables: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    """reference.rope_paged_attention: q [T, Hq, D], k and v [T, Hkv, D] not yet rotated
    (strided views are fine). Decode keys (q_len 1) run one kernel; others the two ops."""
    if q_len != 1:
        from .triton_ops import rope_write_kv
        return _launch(rope_write_kv(q, k, v, cos_sin, positions, kv_cache, slot_mapping), kv_cache, block_tables,
                       positions, q_len, scale)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    return _launch(q, kv_cache, block_tables, positions, q_len, scale, (k, v, cos_sin, slot_mapping))


def _launch(q, kv_cache, block_tables, positions, q_len, scale, rope=None):
    num_tokens, num_heads, head_dim = q.shape
    batch = num_tokens // q_len
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    tables = block_tables[:batch]
    block_m, block_n, q_blocks, pieces, piece_tiles, programs, warps, stages = cfg.attention_launch_shape(
        batch, q_len, group, num_kv_heads, tables.shape[1] * page, q.device)
    min_tiles = cfg.decode_config(batch * q_blocks * num_kv_heads, q.device)["piece_tiles"]
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    grid = (batch * q_blocks, num_kv_heads, programs)
    if pieces > 1:
        part_acc = torch.empty((batch * q_blocks * num_kv_heads * pieces * block_m, head_dim),
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch * q_blocks * num_kv_heads * pieces * block_m, 2),
                              dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    assert kv_cache.is_contiguous()
    k, v, cos_sin, slots = rope if rope is not None else (q, q, q, positions)
    scale_log2 = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    arrivals = arrival_counters(batch * q_blocks * num_kv_heads, q.device)
    pdl = cfg.launches_with_pdl(q_len, rope is not None, batch, q.device)
    fold = cfg.fold_mode(batch * q_blocks * num_kv_heads, q.device) if rope is not None else 0
    # the early tile is loaded before the write-then-read path would write the step's k and v: folded only
    early = q_len == 1 and (rope is None or fold > 0) and cfg.loads_first_tile_early(batch * q_blocks * num_kv_heads,
                                                                                q.device)
    row_bytes = head_dim * kv_cache.element_size()
    prefetch = row_bytes if pdl and cfg.PREFETCH_KV and row_bytes % 16 == 0 else 0
    extra = {"launch_pdl": True} if pdl else {}
    # the first rows of a piece (the least piece, adaptive mode), at most PREFETCH_ROWS: a power of 2
    pf_rows = min(cfg.PREFETCH_ROWS, triton.next_power_of_2(block_n * (piece_tiles or min_tiles))) if prefetch else 0
    _paged_attn_kernel[grid](q, kv_cache, tables, positions, out, part_acc, part_ml, arrivals, k, v, cos_sin, slots,
                             q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1),
                             v.stride(0), v.stride(1), kv_cache.stride(0), kv_cache.stride(1),
                             kv_cache.stride(2), kv_cache.stride(3), tables.stride(0), tables.shape[1], scale_log2,
                             pieces, kv_cache.shape[1],
                             Q_LEN=q_len, GROUP=group, NUM_Q_BLOCKS=q_blocks, SPLIT=pieces > 1,
                             PIECE_TILES=piece_tiles, MIN_TILES=min_tiles, PAGE=page,
                             HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                             PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                             TRIGGER=cfg.ATTENTION_TRIGGER if pdl_capable(q.device) else 0, ROPE=rope is not None,
                             PDL=pdl, PREFETCH_ROWS=pf_rows, PREFETCH_BYTES=prefetch, FOLD=fold, EARLY=early,
                             num_warps=warps,
                             num_stages=stages, **extra)
    return out
