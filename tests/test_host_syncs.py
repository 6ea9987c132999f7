"""No step waits on the host in the pipelined path (issue 14), counted on the static backend.

On the static backend every tensor is on the CPU, so reading device data never blocks here;
on CUDA it would. The test therefore watches every point where the host can read device
data: Tensor.tolist / item / __bool__ / __int__ / __float__ / numpy on a tensor whose storage
is device data (the executor's persistent tensors and the weights), a copy_ from device data
that is not non_blocking, and the engine's designated wait (`StepLauncher.wait`, which on
CUDA synchronizes one event). Over a run where requests arrive mid-decode, finish at
different steps and cross KV block boundaries:
- the host reads device data only inside the one wait per step, and every D2H copy is
  non-blocking: exactly one synchronisation per step;
- every step that repeats the one before it (the steady state) was launched before the host
  waited for that one: the wait is one step behind;
- a full-path step rewrites the host staging only once every step launched before the last
  upload has been waited for, so its wait for that upload (an event recorded after the copy,
  which the device runs after those steps) cannot block on running work. Full-path steps may
  be packed while one step runs: the step after one whose rows all end, the next prefill
  chunk while one runs, and the decode step launched while its rows' prefill runs.
Over whole waves (`test_waves_admission_and_block_boundaries_keep_the_device_busy`) every
launch after the first is made while a step is in flight: the next wave's first step goes with
the last step of the wave before, two ahead, and requests are admitted while steps run.
Where the rows change (`test_rows_changing_steps_are_formed_while_a_step_runs`: requests of
many lengths, more than the batch holds) every launch after the first is made while a step is
in flight too: the prefill chunk after a decode step whose rows draw (admitting waiting
requests), the decode step after a prefill while other rows are still in their prompts, the
decode step after some rows finished; the steps and tokens are those of the engine forming
them after the read (`Engine.pipeline_changes` False), rows that stop early included.
Not pipelined, so not claimed: the step after a verify step (its rows' accepted counts) and a
step formed where blocks would run out (no preemption while a step is in flight).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trtgraph.runtime.serving import engine as engine_module
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.launcher import StepLauncher
from trtgraph.runtime.serving.scheduler import Scheduler
from trtgraph.runtime.step.buffers import StepBuffers

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy")


@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


class SyncWatch:
    """Records launches, waits and host reads of device data while the engine steps."""

    def __init__(self, engine: Engine, mp: pytest.MonkeyPatch):
        ex = engine.executor
        self.device = {t.untyped_storage().data_ptr()
                       for t in (*ex.persistent_tensors().values(), *ex.weight_tensors().values())}
        self.log: list[tuple[str, object]] = []  # ("launch" | "wait", step)
        self.stray: list[str] = []  # device reads outside the one wait, blocking D2H copies
        self.staging_behind_running_work = 0  # staging rewrites whose upload wait could block on a running step
        self.in_wait = False
        self.in_flight: set[int] = set()  # launched steps not waited for yet
        self.before_last_upload: set[int] = set()  # the steps in flight when the last full-path step was launched
        self.finishing: list = []  # steps in which a row stopped (stop id, EOS or max_tokens)
        self._patch(mp)

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.device

    def _patch(self, mp: pytest.MonkeyPatch) -> None:
        watch, launch, wait, ready = self, StepLauncher.launch, StepLauncher.wait, StepBuffers.staging_ready
        postprocess = Scheduler.postprocess

        def postprocessed(sched, step, *args, **kwargs):
            news = postprocess(sched, step, *args, **kwargs)
            if any(reason for _, reason in news):
                watch.finishing.append(step)
            return news

        def launched(launcher, step, stats):
            f = launch(launcher, step, stats)
            watch.log.append(("launch", step))
            if not step.repeats:  # the full path uploaded: its event follows every step in flight
                watch.before_last_upload = set(watch.in_flight)
            watch.in_flight.add(id(step))
            return f

        def waited(launcher, f, stats):
            watch.log.append(("wait", f.step))
            watch.in_wait = True
            watch.in_flight.discard(id(f.step))
            try:
                return wait(launcher, f, stats)
            finally:
                watch.in_wait = False

        def staging_ready(buffers):
            watch.staging_behind_running_work += bool(watch.before_last_upload & watch.in_flight)
            return ready(buffers)

        mp.setattr(Scheduler, "postprocess", postprocessed)
        mp.setattr(StepLauncher, "launch", launched)
        mp.setattr(StepLauncher, "wait", waited)
        mp.setattr(StepBuffers, "staging_ready", staging_ready)
        for name in READS:
            mp.setattr(torch.Tensor, name, self._reader(name, getattr(torch.Tensor, name)))
        copy = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            if watch.is_device(src) and not watch.is_device(dst) and not non_blocking:
                watch.stray.append("a blocking device-to-host copy_")
            return copy(dst, src, non_blocking)

        mp.setattr(torch.Tensor, "copy_", copy_)

    def _reader(self, name, original):
        watch = self

        def read(t, *args, **kwargs):
            if not watch.in_wait and watch.is_device(t):
                watch.stray.append(f"Tensor.{name} on device data outside the step's wait")
            return original(t, *args, **kwargs)

        return read


def test_one_host_wait_per_step_one_step_behind(engine):
    block = engine.executor.block_size
    reqs = [{"id": f"r{i}", "prompt_token_ids": [(13 * i + j) % 300 for j in range(5 + 9 * i)],
             "max_tokens": 2 * block + 7 * i} for i in range(4)]
    late = {"id": "late", "prompt_token_ids": list(range(30)), "max_tokens": block + 3}
    served = set()
    with pytest.MonkeyPatch.context() as mp:
        watch = SyncWatch(engine, mp)
        for r in reqs:
            engine.add_request(r)
        for n in range(4000):
            if n == 20:
                engine.add_request(late)  # admitted while the others decode
            served |= {o.id for o in engine.step() if o.finished}
            if not engine.has_unfinished():
                break
    assert served == {r["id"] for r in reqs} | {"late"}
    assert not watch.stray, watch.stray[:5]

    launches = [s for what, s in watch.log if what == "launch"]
    waits = [s for what, s in watch.log if what == "wait"]
    assert len(launches) == len(waits) == engine.stats.steps
    assert sorted(map(id, launches)) == sorted(map(id, waits)), "every step is waited for exactly once"
    assert watch.staging_behind_running_work == 0

    where = {(what, id(s)): i for i, (what, s) in enumerate(watch.log)}
    repeats = [(before, step) for before, step in zip(launches, launches[1:]) if step.repeats]
    behind = [where[("launch", id(step))] < where[("wait", id(before))] for before, step in repeats]
    assert repeats and all(behind), f"{behind.count(False)} of {len(behind)} steady-state steps waited on the host"
    assert any(step.new_blocks for _, step in repeats), "no pipelined step crossed a block boundary"
    # a row finished in `before` while the step after it was already running
    assert {id(before) for before, _ in repeats} & {id(s) for s in watch.finishing}


class DeviceWork(TorchDispatchMode):
    """Every op on device data (the executor's persistent tensors) that runs in a launch but
    outside the step itself (the graph's replay; the eager closure), by launch."""

    def __init__(self, device: set[int]):
        super().__init__()
        self.device, self.in_step, self.current = device, False, None
        self.by_launch: list[tuple[object, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.current is not None and not self.in_step and not func.is_view:  # (a view moves no data)
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() in self.device for t in tensors):
                dst_device = tensors and tensors[0].untyped_storage().data_ptr() in self.device
                self.current.append(f"{func.overloadpacket.__name__} ({'to device' if dst_device else 'to host'})")
        return func(*args, **kwargs)


def test_a_fast_path_step_is_one_replay_and_the_token_copy(engine):
    """Issue 14: between two replays of the fast path the device does nothing but copy the
    drawn tokens back (and, at a block boundary, copy the staged new block entries in): the
    advance of positions, input tokens, slots and block tables runs inside the graph. A decode
    step after a prefill gathers its rows' tokens inside its graph too (its device work between
    replays: the upload and the token copy). Counted on the static backend."""
    from trtgraph.runtime.step.graph_runner import GraphRunner

    ex = engine.executor
    device = {t.untyped_storage().data_ptr() for t in ex.persistent_tensors().values()}
    block = ex.block_size
    reqs = [{"id": f"w{i}", "prompt_token_ids": [(17 * i + j) % 300 for j in range(4 + 7 * i)],
             "max_tokens": 2 * block + 5 * i} for i in range(4)]
    work = DeviceWork(device)
    launch, replay = StepLauncher.launch, GraphRunner.replay

    def launched(launcher, step, stats):
        work.current = []
        try:
            return launch(launcher, step, stats)
        finally:
            work.by_launch.append((step, work.current))
            work.current = None

    def replayed(runner, *args, **kwargs):
        work.in_step = True
        try:
            return replay(runner, *args, **kwargs)
        finally:
            work.in_step = False

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepLauncher, "launch", launched)
        mp.setattr(GraphRunner, "replay", replayed)
        with work:
            results = list(engine.generate(reqs))
    assert len(results) == len(reqs)
    fast = [(s, ops) for s, ops in work.by_launch if s.repeats]
    assert fast and any(s.new_blocks for s, _ in fast), "no fast-path step crossed a block boundary"
    copy_back = "copy_ (to host)"
    for step, ops in fast:
        want = ["copy_ (to device)"] * bool(step.new_blocks) + [copy_back]
        assert ops == want, f"fast-path step ({len(step.new_blocks)} new blocks): device work between replays {ops}"
    gathered = [(s, ops) for s, ops in work.by_launch if s.gather]
    assert gathered, "no decode step was launched after a prefill"
    for step, ops in gathered:
        # one upload (the ints and floats are views of one byte tensor), then the token copy
        assert ops == ["copy_ (to device)", copy_back], f"gathered decode step: {ops}"


def test_waves_admission_and_block_boundaries_keep_the_device_busy(engine):
    """Issue 14, the whole run of three waves (3 x max_batch_size requests, 32-token prompts in
    two prefill chunks, outputs across a KV block boundary; each wave's rows end together):
    after the first launch every step is launched while an earlier one is still in flight (the
    device always has the next step queued: the wave's first step goes with the last step of
    the wave before, two ahead; its second chunk while the first runs; the decode step while the
    second runs), every request submitted after the first step is admitted while a step is in
    flight, in slices, and the host synchronises once per step: the read-back of its tokens."""
    rows = engine.scheduler.plan.max_batch_size
    block = engine.executor.block_size
    reqs = [{"id": f"v{i}", "prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(2 * block)],
             "max_tokens": block + 4, "ignore_eos": True} for i in range(3 * rows)]
    admitted_in_flight, admitted_idle = [], []
    launched_idle = []  # launches (after the first) with no step in flight: the device would wait
    with pytest.MonkeyPatch.context() as mp:
        watch = SyncWatch(engine, mp)
        admit, launch = Engine._admit, StepLauncher.launch

        def admitted(eng, req, stream, arrived):
            (admitted_in_flight if watch.in_flight else admitted_idle).append(req.id)
            return admit(eng, req, stream, arrived)

        def launched(launcher, step, stats):
            if not watch.in_flight and watch.log:
                launched_idle.append(step)
            return launch(launcher, step, stats)

        mp.setattr(Engine, "_admit", admitted)
        mp.setattr(StepLauncher, "launch", launched)  # inside SyncWatch's wrapper: sees in_flight before it
        results = list(engine.generate(reqs))
    assert sorted(r.id for r in results) == sorted(r["id"] for r in reqs)
    assert all(len(r.token_ids) == block + 4 for r in results)
    assert not watch.stray, watch.stray[:5]
    launches = [s for what, s in watch.log if what == "launch"]
    waits = [s for what, s in watch.log if what == "wait"]
    assert len(launches) == len(waits) == engine.stats.steps
    assert watch.staging_behind_running_work == 0
    assert not launched_idle, [(s.key, s.is_prefill) for s in launched_idle]
    assert len(admitted_idle) == rows and len(admitted_in_flight) == 2 * rows, (admitted_idle, admitted_in_flight)
    prefills = [s for s in launches if s.is_prefill]
    assert len(prefills) == 6 and any(s.new_blocks for s in launches if s.repeats)
    # each later wave's first step was launched before the host waited for the step before the
    # last step of the wave it follows
    where = {(what, id(s)): i for i, (what, s) in enumerate(watch.log)}
    for first in prefills[2::2]:
        i = launches.index(first)
        assert where[("launch", id(first))] < where[("wait", id(launches[i - 2]))]


def _mixed(rows: int, block: int, ignore_eos: bool) -> list[dict]:
    """More requests than rows; prompts of 3 to 150 tokens (several prefill chunks), outputs of
    2 to 40 (rows finish at different steps and cross KV blocks), every third one sampled."""
    return [{"id": f"x{i}", "prompt_token_ids": [(11 * i + j) % 300 + 3 for j in range(3 + (37 * i) % 148)],
             "max_tokens": 2 + (13 * i) % 39, "ignore_eos": ignore_eos,
             **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {})} for i in range(3 * rows + 2)]


def _served(engine: Engine, reqs: list[dict], pipeline: bool, mp: pytest.MonkeyPatch | None = None):
    """(token ids by request, the launches as (key, rows' request ids, tokens each feeds)) of one run."""
    engine.pipeline_changes = pipeline
    try:
        steps = []
        launch = StepLauncher.launch

        def launched(launcher, step, stats):
            steps.append((step.key, tuple(s.request.id for s in step.seqs), tuple(step.num_new)))
            return launch(launcher, step, stats)

        with pytest.MonkeyPatch.context() as own:
            own.setattr(StepLauncher, "launch", launched)
            out = {r.id: r.token_ids for r in engine.generate(reqs)}
        return out, steps
    finally:
        engine.pipeline_changes = True


def test_rows_changing_steps_are_formed_while_a_step_runs(engine):
    """Issue 14 item 1 where the rows change: a prefill chunk after a decode step whose rows
    draw, the admission of waiting requests while other rows decode, the decode step after a
    prefill while other rows are still in their prompts, the decode step after some (not all)
    rows finished: each is formed and launched while the step before it runs (the device always
    has the next step queued), with one synchronisation per step (the token read-back) and no
    other read of device data. The steps and every token are those of the engine that forms
    them only after reading the step before (pipeline_changes False)."""
    rows, block = engine.scheduler.plan.max_batch_size, engine.executor.block_size
    reqs = _mixed(rows, block, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "ADMIT_SLICE", 0)
        before, steps_before = _served(engine, reqs, pipeline=False)
    launched_idle = []
    with pytest.MonkeyPatch.context() as mp:
        # admitted only as rows free up (no slices): rows finish while others wait to be admitted
        mp.setattr(engine_module, "ADMIT_SLICE", 0)
        watch = SyncWatch(engine, mp)
        launch = StepLauncher.launch

        def launched(launcher, step, stats):
            if not watch.in_flight and watch.log:
                launched_idle.append(step)
            return launch(launcher, step, stats)

        mp.setattr(StepLauncher, "launch", launched)  # inside SyncWatch's wrapper: sees in_flight before it
        after, steps_after = _served(engine, reqs, pipeline=True)
    assert after == before and len(after) == len(reqs)
    assert steps_after == steps_before, "forming ahead changed the steps"
    assert not watch.stray, watch.stray[:5]
    launches = [s for what, s in watch.log if what == "launch"]
    waits = [s for what, s in watch.log if what == "wait"]
    assert len(launches) == len(waits) == engine.stats.steps
    assert watch.staging_behind_running_work == 0
    assert not launched_idle, [(s.key, len(s.seqs)) for s in launched_idle]
    # the transitions this workload has, each launched while the step before it ran
    kinds, seen = set(), set()
    for a, b in zip(launches, launches[1:]):
        seen |= {id(s) for s in a.seqs}
        if not a.is_prefill and b.is_prefill and any(id(s) not in seen for s in b.seqs):
            kinds.add("admission while decoding")
        if a.is_prefill and b.gather and {id(s) for s in a.seqs} - {id(s) for s in b.seqs}:
            kinds.add("decode after a prefill, other rows in their prompts")
        if not a.is_prefill and not b.is_prefill and b.gather and len(b.seqs) < len(a.seqs):
            kinds.add("decode after some rows finished")
    assert kinds == {"admission while decoding", "decode after a prefill, other rows in their prompts",
                     "decode after some rows finished"}, kinds


def test_rows_that_stop_early_under_steps_formed_ahead(engine):
    """A row that stops at a stop id is known only when its step is read: the step formed
    ahead of that read carries it (its row wasted), and every request's tokens and finish
    reason are still those of the engine that forms steps only after reading (the stop ids are
    tokens the requests draw half-way through their outputs, or first)."""
    rows, block = engine.scheduler.plan.max_batch_size, engine.executor.block_size
    reqs = _mixed(rows, block, ignore_eos=False)
    first, _ = _served(engine, reqs, pipeline=True)
    for i, r in enumerate(reqs):
        out = first[r["id"]]
        if i % 2 and len(out) > 4:
            r["stop"] = [out[len(out) // 2]]
        elif i % 4 == 2:  # its first token: it stops in its prefill, under a decode step formed ahead
            r["stop"] = [out[0]]
    engine.pipeline_changes = False
    try:
        before = {r.id: (r.token_ids, r.finish_reason) for r in engine.generate(reqs)}
    finally:
        engine.pipeline_changes = True
    carried = []  # steps formed ahead that, when read, held a row which had stopped before them
    with pytest.MonkeyPatch.context() as mp:
        watch = SyncWatch(engine, mp)
        wait = StepLauncher.wait

        def waited(launcher, f, stats):
            if f.step.gather and any(s.finished for s in f.step.seqs):
                carried.append(f.step)
            return wait(launcher, f, stats)

        mp.setattr(StepLauncher, "wait", waited)
        after = {r.id: (r.token_ids, r.finish_reason) for r in engine.generate(reqs)}
    stopped = [k for k, (_, reason) in after.items() if reason == "stop"]
    assert len(stopped) >= rows, stopped
    assert after == before
    assert not watch.stray, watch.stray[:5]
    assert watch.staging_behind_running_work == 0
    assert carried, "no step formed ahead carried a row that had stopped"


def test_a_row_left_with_one_prompt_token_joins_the_decode_step_formed_ahead(engine):
    """A prefill chunk that leaves its row one prompt token (prompts of 16k + 1 tokens, chunks
    of 16 and 64) while other rows of that prefill draw (prompts of other lengths): the decode
    step formed ahead of that prefill's read takes the row in to feed
    that token at the position where the chunk ends, as the step formed after the read does (the
    H200's mixed workload found the step formed ahead leaving it out: 2,121 steps against
    2,117). The same steps and tokens as the engine that forms steps only after reading."""
    rows = engine.scheduler.plan.max_batch_size
    reqs = [{"id": f"o{i}", "prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(
                 16 * (1 + i % 5) + 1 if i % 2 else 3 + (7 * i) % 40)],
             "max_tokens": 3 + (5 * i) % 17, "ignore_eos": True,
             **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {})} for i in range(2 * rows + 3)]
    fed = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "ADMIT_SLICE", 0)
        before, steps_before = _served(engine, reqs, pipeline=False)
        launch = StepLauncher.launch

        def launched(launcher, step, stats):
            fed.extend(step.fed_ahead)
            return launch(launcher, step, stats)

        mp.setattr(StepLauncher, "launch", launched)
        after, steps_after = _served(engine, reqs, pipeline=True)
    assert fed, "no decode step was formed ahead with a row left one prompt token (the case is not exercised)"
    assert steps_after == steps_before, "forming ahead changed the steps"
    assert after == before and len(after) == len(reqs)
