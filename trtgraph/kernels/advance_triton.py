"""Triton twin of `kernels/advance.py: advance_reference` (same signature, same result): one
program walks the rows in blocks and, for each block, the staged new-block entries in blocks
(a [rows, entries] match per pair); a barrier, then the mode and the entry count are reset.
One program, so the resets come after every read of them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .advance import ADVANCE, FRESH

BLOCK_R = 64  # rows per block
BLOCK_E = 32  # staged entries per block


@triton.jit
def _advance_kernel(control, new_blocks, ids, pos, slots, tables, table_stride, gather_src, next_tokens, B,
                    block_size, FRESH_MODE: tl.constexpr, ADVANCE_MODE: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    mode = tl.load(control)
    n = tl.load(control + 1)
    count = tl.load(new_blocks)
    num_entries = tl.where(mode == ADVANCE_MODE, count, 0)
    for r0 in range(0, B, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        inside = r < B
        modes = tl.zeros([BLOCK_R], dtype=tl.int64) + mode  # a vector: a scalar bool would not broadcast
        adv = inside & (r < n) & (modes == ADVANCE_MODE)
        src = tl.load(gather_src + r, mask=inside, other=-1)
        gather = inside & (src >= 0) & (modes == FRESH_MODE)
        drawn = tl.load(next_tokens + r, mask=adv, other=0)
        gathered = tl.load(next_tokens + tl.maximum(src, 0), mask=gather, other=0)
        tl.store(ids + r, tl.where(adv, drawn, gathered), mask=adv | gather)
        p = tl.load(pos + r, mask=adv, other=0)
        tl.store(pos + r, p + 1, mask=adv)
        has = tl.zeros([BLOCK_R], dtype=tl.int32)
        col = tl.zeros([BLOCK_R], dtype=tl.int64)
        blk = tl.zeros([BLOCK_R], dtype=tl.int64)
        for e0 in range(0, num_entries, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)  # [BLOCK_E]
            valid = e < num_entries
            e_row = tl.load(new_blocks + 1 + 3 * e, mask=valid, other=-1)
            e_col = tl.load(new_blocks + 2 + 3 * e, mask=valid, other=0)
            e_blk = tl.load(new_blocks + 3 + 3 * e, mask=valid, other=0)
            match = e_row[None, :] == r[:, None]  # [BLOCK_R, BLOCK_E]
            has += tl.sum(match.to(tl.int32), axis=1)
            col += tl.sum(tl.where(match, e_col[None, :], 0), axis=1)
            blk += tl.sum(tl.where(match, e_blk[None, :], 0), axis=1)
        entered = adv & (has > 0)
        s = tl.load(slots + r, mask=adv, other=0)
        tl.store(slots + r, tl.where(entered, blk * block_size, s + 1), mask=adv)
        tl.store(tables + r * table_stride + col, blk, mask=entered)
    tl.debug_barrier()  # every thread has read the mode and the count before they are reset
    tl.store(control, mode * 0 + ADVANCE_MODE)
    tl.store(new_blocks, count * 0)


def advance_triton(control: torch.Tensor, new_blocks: torch.Tensor, input_ids: torch.Tensor,
                   positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   gather_src: torch.Tensor, next_tokens: torch.Tensor, block_size: int) -> None:
    """See `kernels/advance.py: advance_reference`."""
    B = input_ids.shape[0]
    _advance_kernel[(1,)](control, new_blocks, input_ids, positions, slot_mapping, block_tables,
                          block_tables.stride(0), gather_src, next_tokens, B, block_size,
                          FRESH_MODE=FRESH, ADVANCE_MODE=ADVANCE, BLOCK_R=BLOCK_R, BLOCK_E=BLOCK_E)
