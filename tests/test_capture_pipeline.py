"""The capture loop's overlap of host and device (issue 14: capture's wall against its own
work): the step inputs' host staging is a ring of slots while the capture queues verifications
and timings LAG_KEYS keys ahead (`StepBuffers.stage_slots`), and it holds exactly what one slot
would; a timing that needs more runs is queued and read later. (The lag itself:
tests/test_warmup.py.)"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from trtgraph.compiler import pipeline
from trtgraph.compiler.verify import StepTiming
from trtgraph.runtime.step.buffers import FIELDS, StepBuffers


def _buffers() -> StepBuffers:
    return StepBuffers(max_tokens=16, max_seqs=4, max_rows=4, max_blocks_per_seq=3, device=torch.device("cpu"),
                       vocab_size=8, num_slots=4)


def test_a_staging_ring_holds_what_one_slot_would():
    """Every upload from a ring of 3 slots carries the same values as from one slot, over
    writes that cover the staging only in part (what the verify path's repacking does); each
    write lands in the next slot, which starts as the last one's copy."""
    one, ring = _buffers(), _buffers()
    ring.stage_slots(3)
    rng = np.random.default_rng(0)
    seen = set()
    for step in range(8):
        for b in (one, ring):
            b.staging_ready()
        seen.add(ring.ints_host.data_ptr())
        assert ring.host.input_ids.ctypes.data == ring.ints_host.data_ptr()  # the views follow the slot
        assert np.array_equal(one.ints_host.numpy(), ring.ints_host.numpy())  # the last slot's values, copied in
        names = [n for n, _, _ in FIELDS]
        for name in rng.choice(names, size=3, replace=False):  # a part of the fields, a part of each
            value = rng.integers(0, 100)
            for b in (one, ring):
                view = getattr(b.host, name).reshape(-1)
                view[:max(1, view.size // (step + 1))] = value
        for b in (one, ring):
            b.upload()
        assert torch.equal(one.ints, ring.ints) and torch.equal(one.floats, ring.floats), step
    assert len(seen) == 3
    ring.stage_slots(1)  # back to one slot: the current one
    ring.staging_ready()
    assert ring.ints_host.data_ptr() in seen and ring.host.input_ids.ctypes.data == ring.ints_host.data_ptr()


class _Timing:
    """A launched timing whose first runs differ by too much once (`more` further runs)."""

    def __init__(self, more: bool):
        self.more, self.asked = more, 0

    def queue_more(self) -> bool:
        self.asked += 1
        return self.more

    def timing(self) -> StepTiming:
        return StepTiming(1.0, 1.0, 1.0, 3 if self.more else 2)


@pytest.mark.parametrize("lag", [0, 2])
def test_a_timing_that_needs_more_runs_is_queued_and_read_later(monkeypatch, lag):
    """With a lag, a key whose first timing runs need more is put back (its further runs
    queued, not waited for) and read after the keys behind it; asked once. At lag 0 (the
    loop's end) everything is read at once."""
    read = []
    monkeypatch.setattr(pipeline, "_read_verify_and_time",
                        lambda launched, stats: (read.append(launched[0]) or launched[0], launched[3].timing()))
    timings = {k: _Timing(more=k == "b") for k in "abcd"}
    pending = deque(((k, 0, None, timings[k]), False) for k in "abcd")
    records, out = [], []
    pipeline._read_due(pending, lag, {k: None for k in "abcd"}, records, out)
    if lag:
        assert read == ["a", "c"] and [e[0][0] for e in pending] == ["d", "b"]
        pipeline._read_due(pending, 0, {k: None for k in "abcd"}, records, out)
        assert read == ["a", "c", "d", "b"]
    else:
        assert read == ["a", "b", "c", "d"]
    assert timings["b"].asked == (1 if lag else 0) and len(records) == 4
