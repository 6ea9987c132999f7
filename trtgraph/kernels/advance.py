"""The decode keys' advance: the first op of a decode key's graph, which turns the inputs the
last replay left into this step's, driven by device state only (issue 14: a fast-path step is
one replay and nothing else between replays but the token copy).

control[0] is the mode (runtime/step/buffers.py: FRESH 0, ADVANCE 1, AS_IS 2), control[1] the
step's real rows n:
- FRESH (the host just uploaded this step's inputs): rows with gather_src[r] >= 0 take their
  input token from next_tokens[gather_src[r]] (a decode step launched after a prefill, before
  its tokens were read); nothing else changes.
- ADVANCE (the same rows as the last replay): for r < n, positions += 1, the input token is
  next_tokens[r] (the token the last replay drew), the slot moves one on, except in a row with
  a staged new block entry (row, column, block): block_tables[row, column] = block and the slot
  is the block's first. Padding rows keep what the last full path wrote.
- AS_IS: nothing.
Whatever the mode, the op leaves control[0] = ADVANCE (the next replay of a decode key advances
unless an upload or the host says otherwise) and new_blocks[0] = 0 (the staged entries are used
once).

`advance_reference` is the torch reference; `kernels/advance_triton.py` the Triton twin of the
same signature, one program. Both are graph-safe: no host reads, no data-dependent shapes.
"""

from __future__ import annotations

from typing import Callable

import torch

FRESH, ADVANCE, AS_IS = 0, 1, 2  # control[0]'s modes (runtime/step/buffers.py imports them)


def advance_reference(control: torch.Tensor, new_blocks: torch.Tensor, input_ids: torch.Tensor,
                      positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      gather_src: torch.Tensor, next_tokens: torch.Tensor, block_size: int) -> None:
    """control [2], new_blocks [1 + 3 S], input_ids / positions / slot_mapping / gather_src [B],
    block_tables [B, W], next_tokens [>= B] (int64 all); updated in place."""
    B, S = input_ids.shape[0], (new_blocks.shape[0] - 1) // 3
    mode, n = control[0], control[1]
    rows = torch.arange(B, device=input_ids.device)  # [B]
    adv = (mode == ADVANCE) & (rows < n)  # [B] rows that move one position on
    gather = (mode == FRESH) & (gather_src >= 0)  # [B]
    gathered = next_tokens.index_select(0, gather_src.clamp(min=0))  # [B]
    ids = torch.where(adv, next_tokens[:B], torch.where(gather, gathered, input_ids))
    entries = new_blocks[1:].view(S, 3)  # [S, 3]: row, column, block
    valid = (torch.arange(S, device=input_ids.device) < new_blocks[0]) & (mode == ADVANCE)  # [S]
    match = (entries[:, 0][None, :] == rows[:, None]) & valid[None, :]  # [B, S]: row r's entry
    has = match.any(dim=1) & adv  # [B]
    col = (match * entries[:, 1][None, :]).sum(dim=1)  # [B] (0 where none: written back unchanged)
    blk = (match * entries[:, 2][None, :]).sum(dim=1)
    slots = torch.where(has, blk * block_size, torch.where(adv, slot_mapping + 1, slot_mapping))
    table_col = block_tables.gather(1, col[:, None]).squeeze(1)  # [B]
    block_tables.scatter_(1, col[:, None], torch.where(has, blk, table_col)[:, None])
    input_ids.copy_(ids)
    positions.add_(adv.to(positions.dtype))
    slot_mapping.copy_(slots)
    control[0:1].fill_(ADVANCE)
    new_blocks[0:1].fill_(0)


def choose(kernels_name: str) -> Callable:
    """The advance for a kernel set: the Triton twin with the Triton set, else the reference."""
    if kernels_name == "triton":
        from .advance_triton import advance_triton

        return advance_triton
    return advance_reference
