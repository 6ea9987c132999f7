"""The decode fast path (Executor.advance_decode) leaves exactly the inputs the full path
(Executor.prepare) would write for the same rows, step after step, across block boundaries:
positions, input tokens, slots and block tables (issue 14: the fast path advances slots by
one and rewrites only the rows that entered a new block)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.runtime.step.executor import Executor, StepRow


@pytest.fixture(scope="module")
def executor():
    cfg = tiny_config(kv_cache={"num_blocks": 40})
    return Executor.build(cfg, BucketPlan.from_config(cfg), torch.device("cpu"))


def test_the_fast_path_writes_what_the_full_path_would(executor):
    ex, bs = executor, executor.block_size
    key = GraphKey(4, 0, 0, "greedy")
    # three rows at different offsets in their blocks: each crosses a boundary at a different step
    starts, tables = [bs - 3, 2 * bs - 1, 5], [[3], [7, 8], [11]]
    spare = {0: [5], 1: [9], 2: [12]}  # the block each row gets when it enters a new one
    ex.prepare(key, [StepRow([10 + i], s, list(t)) for i, (s, t) in enumerate(zip(starts, tables))])
    d = ex.buffers.dev
    crossed = 0
    for step in range(1, bs + 1):
        drawn = [100 + 3 * step + i for i in range(3)]
        ex.buffers.next_tokens[:3] = torch.tensor(drawn)
        new_blocks = []
        for i, s in enumerate(starts):
            pos = s + step
            if pos % bs == 0:
                tables[i] = tables[i] + spare[i]
                new_blocks.append((i, pos // bs, tables[i][pos // bs]))
        crossed += len(new_blocks)
        ex.advance_decode(3, new_blocks)
        fast = {n: getattr(d, n).clone() for n in ("positions", "input_ids", "slot_mapping", "block_tables")}
        ex.prepare(key, [StepRow([drawn[i]], s + step, list(t)) for i, (s, t) in enumerate(zip(starts, tables))])
        for name, value in fast.items():
            assert torch.equal(value, getattr(d, name)), f"step {step}: {name} differs from the full path's"
    assert crossed == 3  # every row entered a new block once
