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
from torch.utils._python_dispatch import TorchDispatchMode

from trtgraph.compiler import pipeline
from trtgraph.compiler.timing import StepTiming
from trtgraph.runtime.step.buffers import FIELDS, StepBuffers

from conftest import tiny_config


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

    def __init__(self, more: bool, done: bool = False):
        self.more, self.asked, self.done = more, 0, done

    def ready(self) -> bool:  # its device work done (both the parity's and the timing's here)
        return self.done

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
    pending = deque(((k, 0, timings[k], timings[k]), False) for k in "abcd")
    records, out = [], []
    pipeline._read_due(pending, lag, {k: None for k in "abcd"}, records, out)
    if lag:
        assert read == ["a", "c"] and [e[0][0] for e in pending] == ["d", "b"]
        pipeline._read_due(pending, 0, {k: None for k in "abcd"}, records, out)
        assert read == ["a", "c", "d", "b"]
    else:
        assert read == ["a", "b", "c", "d"]
    assert timings["b"].asked == (1 if lag else 0) and len(records) == 4


def test_a_key_whose_work_is_done_is_read_before_the_lag(monkeypatch):
    """On CUDA the capture reads a key as soon as its verification and timing are done (their
    events passed, asked without waiting), in launch order: at lag 3 of 6 keys, the 3 past
    the lag are read (done or not), then d (done); e, not done, stops the reads (f, done, waits
    behind it)."""
    read = []
    monkeypatch.setattr(pipeline, "_read_verify_and_time",
                        lambda launched, stats: (read.append(launched[0]) or launched[0], launched[3].timing()))
    timings = {k: _Timing(more=False, done=k in "adf") for k in "abcdef"}
    pending = deque(((k, 0, timings[k], timings[k]), False) for k in "abcdef")
    records, out = [], []
    pipeline._read_due(pending, 3, {k: None for k in "abcdef"}, records, out)
    assert read == ["a", "b", "c", "d"] and [e[0][0] for e in pending] == ["e", "f"]


class _CountOps(TorchDispatchMode):
    """The tensor ops dispatched while active (views aside: they launch nothing), but not
    those inside a replay (the static backend's replay runs the step's ops; on CUDA it is one
    graph launch): each replay counts as one op, "replay"."""

    def __init__(self):
        super().__init__()
        self.ops, self.replaying = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.replaying and not func.is_view and func not in _NOT_LAUNCHES:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


_NOT_LAUNCHES = {torch.ops.aten.lift_fresh.default, torch.ops.aten.detach.default, torch.ops.aten.detach_.default}


def test_a_keys_verification_and_timing_queue_few_ops(monkeypatch):
    """Issue 14 (capture's wall): what the capture loop queues per key beside its graph
    launches. A verification copies the key's KV blocks of every layer out and back in one op
    each (the caches are views of one allocation), uploads each step's inputs in one copy and
    compares the replay with its reference in one short chain; the timing adds its upload and
    its replays (decode keys only: a prefill key's time is its verification replay's). Counted
    on the static backend (each op is one kernel or copy on CUDA), on 4 layers: at most 16 ops
    per key (before: 21 here, 45 on 16 layers), and 3 replays per decode key, 1 per prefill key
    (before: 3 for every key)."""
    from trtgraph.runtime.step.graph_runner import GraphRunner

    counter, per_key = _CountOps(), []
    real_replay = GraphRunner.replay

    def replay(self, *args, **kwargs):
        counter.ops.append("replay")
        counter.replaying = True
        try:
            return real_replay(self, *args, **kwargs)
        finally:
            counter.replaying = False

    def counted(real):  # a key's verification and its timing launches, counted together
        def launch(ex, key, *args, **kwargs):
            if not per_key or per_key[-1][0] != str(key):
                per_key.append((str(key), []))
            counter.ops = per_key[-1][1]
            with counter:
                return real(ex, key, *args, **kwargs)
        return launch

    monkeypatch.setattr(GraphRunner, "replay", replay)
    monkeypatch.setattr(pipeline, "launch_verify", counted(pipeline.launch_verify))
    monkeypatch.setattr(pipeline, "launch_timing", counted(pipeline.launch_timing))
    from trtgraph.config import Config

    synthetic = {**Config.default().to_dict()["model"]["synthetic"], "num_hidden_layers": 4}
    config = tiny_config(model={"synthetic": synthetic})
    pipeline.capture(config, None, timing_repeats=2)
    assert per_key and any("prefill" in k for k, _ in per_key) and any("decode" in k for k, _ in per_key)
    for key, ops in per_key:
        replays = 1 if "prefill" in key else 3  # the verification's, and a decode key's 2 timing runs
        assert ops.count("replay") == replays, (key, ops)
        assert len(ops) - replays <= 16, (key, len(ops), ops)
        assert ops.count("index_select") == 1 and ops.count("index_copy_") == 1, (key, ops)


def _verification_clocks(monkeypatch) -> tuple[dict, list]:
    """Spies on a capture: each key's verification replay clock (None where it keeps none), and
    the keys timed by runs of their own (`launch_timing`)."""
    from trtgraph.compiler.verify import PendingParity

    clocks, timed = {}, []
    real_init, real_timing = PendingParity.__init__, pipeline.launch_timing

    def init(self, ex, key, *args, **kwargs):
        real_init(self, ex, key, *args, **kwargs)
        clocks[key] = self.replay_clock

    monkeypatch.setattr(PendingParity, "__init__", init)
    monkeypatch.setattr(pipeline, "launch_timing",
                        lambda ex, key, *a, **k: (timed.append(key), real_timing(ex, key, *a, **k))[1])
    return clocks, timed


def test_a_prefill_keys_replay_time_is_its_verification_replays_and_a_decode_keys_its_own_runs(monkeypatch, tmp_path):
    """Issue 14 (capture's wall): a prefill key gets no timing runs; its manifest replay_ms is
    the time of its verification replay (one run, the verification's random valid rows); every
    decode key is timed by runs of its own on padding-only inputs (at least 2), as the
    speculation policy reads them; the totals say how many keys were timed which way."""
    clocks, timed = _verification_clocks(monkeypatch)
    result = pipeline.capture(tiny_config(), tmp_path / "art", timing_repeats=3)
    records = {r.key: r for r in result.manifest.keys}
    prefill = [k for k in records if k.is_prefill]
    assert prefill and len(prefill) < len(records)
    assert sorted(timed) == sorted(k for k in records if not k.is_prefill)  # each once, decode keys only
    for key, record in records.items():
        clock = clocks[key]
        if key.is_prefill:
            assert record.replay_ms == pytest.approx(clock.ms(), abs=1e-4) and record.replay_ms > 0
        else:
            assert clock is None and record.replay_ms > 0
    t = result.manifest.totals["replay_timing"]
    assert t["verification_timed_keys"] == len(prefill) and t["repeats_min"] >= 2 and t["repeats_max"] <= 3


# ---- the pacer (compiler/pacing.py): when each key's verification and timing are launched ----

class _Work:
    """A fake device: each launch is an item with `ready()`, done when the test says so."""

    def __init__(self):
        self.launched, self.done = [], set()

    def item(self, name):
        outer = self

        class Item:
            def ready(self):
                return name in outer.done

        self.launched.append(name)
        return Item()

    def key(self, k, verify_ms=30.0, time_ms=30.0):
        from trtgraph.compiler.pacing import KeyWork

        return KeyWork(k, ord(k), verify=lambda: self.item("V" + k), time=lambda parity: self.item("T" + k),
                       verify_ms=verify_ms, time_ms=time_ms)


def test_unpaced_a_keys_timing_is_launched_right_after_its_verification():
    """The CPU and tensor parallelism: everything at once, in capture order (every rank the same)."""
    from trtgraph.compiler.pacing import Pacer

    dev, pacer = _Work(), Pacer(None)
    assert [t[0] for t in pacer.add(dev.key("a"))] == ["a"]
    assert [t[0] for t in pacer.add(dev.key("b"))] == ["b"]
    assert dev.launched == ["Va", "Ta", "Vb", "Tb"] and pacer.pending == 0 and pacer.pump(final=True) == []


def test_paced_launches_keep_about_ahead_ms_queued_and_a_timing_waits_for_its_verification():
    """CUDA: launched while less than ahead_ms of estimated work is not done; a key's timing
    only once its verification is done, never before an earlier key's; the rest at the end,
    verifications first."""
    from trtgraph.compiler.pacing import Pacer

    dev, pacer = _Work(), Pacer(40.0)
    assert pacer.add(dev.key("a")) == [] and dev.launched == ["Va"]  # its verification not done: no timing
    assert pacer.add(dev.key("b")) == [] and dev.launched == ["Va", "Vb"]  # 30 ms queued < 40
    assert pacer.add(dev.key("c")) == [] and dev.launched == ["Va", "Vb"]  # 60 ms queued: c waits
    dev.done.add("Va")
    assert [t[0] for t in pacer.pump()] == ["a"] and dev.launched == ["Va", "Vb", "Ta"]  # 30 + 30 queued
    dev.done |= {"Vb", "Ta"}
    assert [t[0] for t in pacer.pump()] == ["b"] and dev.launched[3:] == ["Tb", "Vc"]  # Tb: 30 queued, Vc: 60
    assert pacer.pending == 1 and pacer.held_back == 1
    assert [t[0] for t in pacer.pump(final=True)] == ["c"] and dev.launched[5:] == ["Tc"]
    dev2, pacer2 = _Work(), Pacer(0.0)  # nothing has room: everything at the end, verifications first
    for k in "abc":
        assert pacer2.add(dev2.key(k)) == []
    assert [t[0] for t in pacer2.pump(final=True)] == ["a", "b", "c"]
    assert dev2.launched == ["Va", "Vb", "Vc", "Ta", "Tb", "Tc"]


@pytest.mark.parametrize("seed", range(20))
def test_paced_launches_keep_their_order_and_budget_whatever_the_device_does(seed):
    """Random device progress (in launch order, as on one stream) and estimates: every key's
    verification comes before its timing, the timings in capture order, a timing (before the
    end) only after its verification is done, each launch (before the end) made with less
    than ahead_ms queued, and every key launched once by the end."""
    from trtgraph.compiler.pacing import Pacer

    rng = np.random.default_rng(seed)
    dev, pacer, ahead = _Work(), Pacer(40.0), 40.0
    est, queued_at_launch = {}, []
    real_item = dev.item

    def item(name):
        live = [n for n in dev.launched if n not in dev.done]
        queued_at_launch.append((name, sum(est[n] for n in live)))
        return real_item(name)

    dev.item = item
    keys = [chr(ord("a") + i) for i in range(12)]
    timed = []
    for k in keys:
        v, t = float(rng.uniform(0, 50)), float(rng.uniform(0, 50))
        est["V" + k], est["T" + k] = v, t
        timed += [x[0] for x in pacer.add(dev.key(k, v, t))]
        for _ in range(int(rng.integers(0, 4))):  # the device finishes the oldest launches
            live = [n for n in dev.launched if n not in dev.done]
            if live:
                dev.done.add(live[0])
        timed += [x[0] for x in pacer.pump()]
    before_end = len(dev.launched)
    timed += [x[0] for x in pacer.pump(final=True)]
    assert timed == keys and sorted(dev.launched) == sorted(["V" + k for k in keys] + ["T" + k for k in keys])
    for k in keys:
        assert dev.launched.index("V" + k) < dev.launched.index("T" + k)
    for name, queued in queued_at_launch[:before_end]:
        assert queued < ahead, (name, queued)


def test_a_capture_whose_launches_are_all_held_to_the_end_verifies_every_key(monkeypatch, tmp_path):
    """The pacer may hold a key's verification and timing back past many later recordings
    (CUDA: while the device is behind): with every launch held until all keys are captured,
    each key is still verified against its own warm-up reference (exact on the static
    backend) and timed, and the manifest is written."""
    from trtgraph.compiler import pacing
    from trtgraph.runtime.step.executor import Executor

    calls, real_capture, real_verify = [], Executor.capture, pipeline.launch_verify
    monkeypatch.setattr(pipeline, "Pacer", lambda ahead_ms: pacing.Pacer(0.0))
    monkeypatch.setattr(Executor, "capture", lambda self, key: (calls.append("capture"), real_capture(self, key))[1])
    monkeypatch.setattr(pipeline, "launch_verify", lambda *a, **k: (calls.append("verify"), real_verify(*a, **k))[1])
    result = pipeline.capture(tiny_config(), tmp_path / "art")
    n = len(result.manifest.keys)
    assert calls == ["capture"] * n + ["verify"] * n
    assert all(r.tokens_equal and r.max_abs_logit_diff == 0.0 and r.replay_ms > 0 for r in result.manifest.keys)
    assert result.manifest.totals["replay_timing"]["keys_held_back"] == n


@pytest.mark.gpu
def test_on_cuda_a_prefill_keys_time_is_its_replay_alone(monkeypatch, tmp_path):
    """CUDA: the verification replay that times a prefill key starts its clock after the
    device's spin (SPIN_CYCLES, about 1 ms), so neither the spin nor the host's launch is in
    the time: the tiny model's prefill replays take well under the spin (their median under
    0.8 of it), and each equals the clock of its verification."""
    from trtgraph.compiler.timing import SPIN_MS

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    clocks, timed = _verification_clocks(monkeypatch)
    result = pipeline.capture(tiny_config(device="cuda", dtype="bfloat16"), tmp_path / "art")
    prefill = sorted(r.replay_ms for r in result.manifest.keys if r.key.is_prefill)
    assert prefill and all(r.replay_ms == pytest.approx(clocks[r.key].ms(), abs=1e-4)
                           for r in result.manifest.keys if r.key.is_prefill)
    assert 0 < prefill[len(prefill) // 2] < 0.8 * SPIN_MS, prefill
    assert timed and not any(k.is_prefill for k in timed)
