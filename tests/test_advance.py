"""The decode keys' advance (kernels/advance.py): the torch reference against a plain loop, and
the Triton twin (kernels/advance_triton.py, under TRITON_INTERPRET=1 on a CPU) against the
reference, in every mode, with and without staged new blocks, gathered rows and padding."""

from __future__ import annotations

import pytest
import torch

from trtgraph.kernels.advance import ADVANCE, AS_IS, FRESH, advance_reference
from trtgraph.runtime.step.buffers import ADVANCE as BUF_ADVANCE, AS_IS as BUF_AS_IS, FRESH as BUF_FRESH

BS, W = 16, 6  # block size, blocks per sequence


def state(B: int, S: int, mode: int, n: int, entries: list[tuple[int, int, int]], gather: dict[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda hi, *shape: torch.randint(0, hi, shape, generator=g, dtype=torch.int64)  # noqa: E731
    new_blocks = r(50, 1 + 3 * S)  # stale entries past the count must be ignored
    new_blocks[0] = len(entries)
    for i, e in enumerate(entries):
        new_blocks[1 + 3 * i:4 + 3 * i] = torch.tensor(e)
    gather_src = torch.full((B,), -1, dtype=torch.int64)
    for row, src in gather.items():
        gather_src[row] = src
    return dict(control=torch.tensor([mode, n]), new_blocks=new_blocks, input_ids=r(300, B),
                positions=r(200, B), slot_mapping=r(40 * BS, B), block_tables=r(40, B, W),
                gather_src=gather_src, next_tokens=r(300, B + 3))


def by_loop(s: dict) -> dict:
    """What the advance means, one row at a time."""
    s = {k: v.clone() for k, v in s.items()}
    mode, n = s["control"].tolist()
    B = s["input_ids"].shape[0]
    entries = s["new_blocks"][1:1 + 3 * int(s["new_blocks"][0])].view(-1, 3).tolist()
    for r in range(B):
        if mode == FRESH and s["gather_src"][r] >= 0:
            s["input_ids"][r] = s["next_tokens"][s["gather_src"][r]]
        if mode == ADVANCE and r < n:
            s["positions"][r] += 1
            s["input_ids"][r] = s["next_tokens"][r]
            s["slot_mapping"][r] += 1
            for row, col, blk in entries:
                if row == r:
                    s["block_tables"][r, col] = blk
                    s["slot_mapping"][r] = blk * BS
    s["control"][0] = ADVANCE
    s["new_blocks"][0] = 0
    return s


CASES = [  # (batch, mode, real rows, new block entries, gather)
    (4, ADVANCE, 3, [], {}),
    (4, ADVANCE, 3, [(0, 2, 7), (2, 1, 9)], {}),
    (4, ADVANCE, 4, [(3, 5, 11)], {1: 0}),  # gather_src is ignored when advancing
    (70, ADVANCE, 66, [(i, 1 + i % 5, 1 + i) for i in range(0, 66, 2)], {}),  # more rows and entries than a block
    (4, FRESH, 3, [(0, 2, 7)], {1: 2, 2: 0}),  # staged entries are ignored (and dropped) on fresh inputs
    (8, FRESH, 5, [], {}),
    (4, AS_IS, 3, [(0, 2, 7)], {1: 2}),
]


def test_the_modes_agree_with_the_step_buffers():
    assert (FRESH, ADVANCE, AS_IS) == (BUF_FRESH, BUF_ADVANCE, BUF_AS_IS)


@pytest.mark.parametrize("B,mode,n,entries,gather", CASES)
def test_the_reference_advances_as_the_loop_does(B, mode, n, entries, gather):
    s = state(B, max(B, 4), mode, n, entries, gather, seed=B + mode)
    want = by_loop(s)
    advance_reference(**s, block_size=BS)
    for name, value in want.items():
        assert torch.equal(s[name], value), name


@pytest.mark.parametrize("B,mode,n,entries,gather", CASES)
def test_the_triton_advance_equals_the_reference(B, mode, n, entries, gather):
    from trtgraph.kernels.advance_triton import advance_triton

    s = state(B, max(B, 4), mode, n, entries, gather, seed=7 * B + mode)
    t = {k: v.clone() for k, v in s.items()}
    advance_reference(**s, block_size=BS)
    advance_triton(**t, block_size=BS)
    for name in s:
        assert torch.equal(t[name], s[name]), name
