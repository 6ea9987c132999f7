"""The decode fast path (Executor.advance_decode, then the decode key's own advance at the
start of its graph) leaves exactly the inputs the full path (Executor.prepare) would write for
the same rows, step after step, across block boundaries: positions, input tokens, slots and
block tables (issue 14: the fast path advances slots by one and rewrites only the rows that
entered a new block), with either kernel set's advance."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.errors import ReplayMismatchError
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
    ex.execute(key, eager=True)  # the full-path step the fast path repeats
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
        ex.execute(key, eager=True)  # the graph's closure: the advance, then the model
        fast = {n: getattr(d, n).clone() for n in ("positions", "input_ids", "slot_mapping", "block_tables")}
        after_fast = ex.buffers.ints.clone()
        ex.prepare(key, [StepRow([drawn[i]], s + step, list(t)) for i, (s, t) in enumerate(zip(starts, tables))])
        for name, value in fast.items():
            assert torch.equal(value, getattr(d, name)), f"step {step}: {name} differs from the full path's"
        ex.buffers.ints.copy_(after_fast)  # back to where the fast path left the device, and on from there
    assert crossed == 3  # every row entered a new block once
    assert int(ex.buffers.new_blocks[0]) == 0, "the staged entries are used once"


def test_a_decode_step_executed_again_without_new_inputs_runs_on_the_same_inputs(executor):
    """Timing loops and replay-vs-eager checks execute a key twice after one prepare: the second
    run must see the inputs of the first (AS_IS), not the next position."""
    ex = executor
    key = GraphKey(4, 0, 0, "greedy")
    ex.prepare(key, [StepRow([5 + i], 20 + i, [2, 3]) for i in range(3)])
    first = ex.logits(ex.execute(key, eager=True))[:3].clone()
    d = ex.buffers.dev
    inputs = [getattr(d, n)[:4].clone() for n in ("positions", "input_ids", "slot_mapping")]
    again = ex.logits(ex.execute(key, eager=True))[:3]
    assert torch.equal(first, again)
    assert all(torch.equal(a, getattr(d, n)[:4]) for a, n in zip(inputs, ("positions", "input_ids", "slot_mapping")))


def test_a_gathered_decode_step_takes_the_drawn_tokens_inside_the_step(executor):
    """A decode step launched after a prefill, before its tokens were read: the rows named in
    `gather` take the drawn token of their prefill row from next_tokens when the step runs."""
    ex = executor
    key = GraphKey(4, 0, 0, "greedy")
    ex.buffers.next_tokens[:3] = torch.tensor([41, 42, 43])
    # row 0 keeps its token; rows 1 and 2 take drawn rows 2 and 0
    ex.prepare(key, [StepRow([7], 9, [4]), StepRow([0], 3, [5]), StepRow([0], 12, [6])], [(1, 2), (2, 0)])
    want = torch.tensor([7, 43, 41, 0])
    seen = {}
    model = ex.model
    forward = type(model).forward_normed  # what the step calls

    def spy(self, ids, pos, meta):
        seen["ids"] = ids[:4].clone()
        return forward(self, ids, pos, meta)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(model), "forward_normed", spy)
        ex.execute(key, eager=True)
    assert torch.equal(seen["ids"], want)
    with pytest.raises(ReplayMismatchError, match="gather pairs"):
        ex.prepare(key, [StepRow([7], 9, [4])], [(1, 0)])  # row 1 is not one of the step's rows
