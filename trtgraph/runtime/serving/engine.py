"""The replay-only runtime: load and check a manifest, re-record exactly its keys, lock,
then serve requests with continuous batching. After start-up it only replays (or, with
eager=True, runs the same steps eagerly for A/B checks); it never captures again and
never imports the compiler.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterable

import torch

from ... import startup
from ...artifacts import Manifest, manifest_path
from ...errors import PromptError
from ...models import load_tokenizer
from ...models.chat import load_chat_template
from ...models.parallel import TPGroup
from ..distributed import StepBroadcast
from ..step.executor import Executor
from . import collection
from .admission import Admission
from .drafter import NgramDrafter
from .engine_start import check_built, open_manifest, record
from .launcher import InFlight, StepLauncher
from .requests import Request, Result, parse_request
from .scheduler import Scheduler
from .stats import RunStats
from .consumers import Consumers, locked
from .deliveries import Deliveries, Live
from .lifecycle import EngineClosedError, Lifecycle  # noqa: F401 (EngineClosedError: importers take it from here)
from .streaming import RequestOutput, TextStream

ADMIT_SLICE = 8  # submitted requests admitted per step() while the device runs (Engine._admit_slice)


class Engine(Deliveries, Consumers, Lifecycle):
    def __init__(self, path: str | Path | Manifest = "trtgraph-artifacts", eager: bool = False, speculative: bool = True,
                 tp: TPGroup = TPGroup(), model: str | Path | None = None):
        """speculative=False ignores the manifest's speculative section (plain decode steps),
        for A/B runs on the same capture. model: the checkpoint directory, where it has moved
        since capture (its files must match the manifest's sizes and sha256). With tensor
        parallelism every rank builds an Engine; rank 0 calls generate() and close(), the
        others follow()."""
        startup.begin()
        self.manifest, config, device = open_manifest(path, tp, model)
        self.tp = tp
        self.artifacts_dir = manifest_path(path).parent
        self.eager = eager
        self.executor = ex = Executor.build(config, self.manifest.plan(), device, tp=tp, from_manifest=True,
                                            linear_record=self.manifest.totals.get("linear_backends"))
        try:
            self._start(path, tp, eager, speculative, config)
        except BaseException:  # a start that fails gives back what it built (its graphs, KV cache, weights)
            with contextlib.suppress(Exception):  # (a device that failed too: the start's own error is the one)
                ex.close()
            raise

    def _start(self, path, tp: TPGroup, eager: bool, speculative: bool, config) -> None:
        """__init__ once the executor is built: checks, re-records, locks; the serving side."""
        ex = self.executor
        self.vocab_size = ex.loaded.config.vocab_size  # (kept after close: a prompt is parsed, then refused)
        startup.lap("kv_cache_and_buffers")
        check_built(self.manifest, ex, manifest_path(path))
        self.record_seconds = record(self.manifest, ex, tp, eager)
        ex.runner.lock()
        self.broadcast = StepBroadcast(tp, ex, self.manifest.capture_order) if tp.active else None
        self.tokenizer = load_tokenizer(ex.loaded.checkpoint_dir, ex.loaded.config.vocab_size,
                                        ex.loaded.config.bos_token_id)
        self.chat_template = load_chat_template(ex.loaded.checkpoint_dir)
        self.generation = ex.loaded.generation  # generation_config.json: eos ids, sampling defaults
        self.stop_ids = set(ex.loaded.config.eos_token_ids) | set(self.generation.eos_token_ids)
        sp = config.speculative
        self.drafter = (NgramDrafter(sp.draft_len, sp.ngram_min, sp.ngram_max, ex.loaded.config.vocab_size)
                        if sp and speculative else None)
        self.scheduler = Scheduler(self.manifest.plan(), ex.num_blocks, ex.block_size, self.drafter,
                                   config.limits.max_seq_len, eos_ids=self.stop_ids,
                                   replay_ms={r.key: r.replay_ms for r in self.manifest.keys}  # CPU times: noise
                                   if ex.device.type == "cuda" else None)
        self.scheduler.fast_path = self.broadcast is None  # the other ranks get every step's full inputs
        if self.drafter is not None:  # the policy prices steps by their measured wall times (not the CPU's)
            self.scheduler.speculation.measure = ex.device.type == "cuda"
        self.admission = Admission(self.tokenizer, self.chat_template, ex.loaded.config, self.generation,
                                   ex.loaded.checkpoint_dir, config.limits.max_seq_len,
                                   has_sampled="sampled" in {k.sampling for k in self.manifest.graph_keys},
                                   tensor_parallel=tp.active)
        self.launcher = StepLauncher(ex, eager, self.broadcast)
        self.stats = RunStats(record_seconds=self.record_seconds, speculative=self.drafter is not None)
        self._preemptions_before = 0  # the scheduler's count when `stats` began
        self._run_start: float | None = None  # when `stats` began counting seconds
        self._live: dict[str, Live] = {}  # requests being served, by id
        self._undelivered: list[RequestOutput] = []  # refusals, and outputs no consumer took yet
        self._aborts: set[str] = set()  # applied at the next step
        self._arrivals = 0  # requests added so far: each sequence's arrival order
        self._aborts_applied = 0  # aborts applied so far (outputs_of stops waiting for an aborted request)
        self._flight: deque[InFlight] = deque()  # launched steps whose tokens are not read yet, in launch order
        # Submitted, not admitted yet: (request, stream, when it was submitted), in order; admitted
        # in slices while the device runs, and always before the scheduler could take them.
        self._pending: deque[tuple[Request, bool, float]] = deque()
        self._pending_ids: set[str] = set()
        self._choices: dict[str, list[Result | None]] = {}  # n > 1: finished completions by request
        self._reading: list = []  # the sequences of the steps read by this step() (deliveries.py: _orphans)
        self._lock = threading.RLock()  # around every change: consumers may step it from several threads
        self._owners: dict[str, Request] = {}  # id -> the submit() request now under it (consumers.py)
        # Form the step after a rows-changing one before reading it (form_ahead); False: after (A/B runs).
        self.pipeline_changes = True
        self.closed = False  # close(): every call that would serve refuses (EngineClosedError)
        startup.lap("tokenizer_and_scheduler")

    @property
    def config(self):
        return self.executor.config

    # ---- the incremental core: add, abort, step -----------------------------------------
    @locked
    def add_request(self, request: Request | dict, where: str = "request", stream: bool = True) -> None:
        """Queue a request; it joins the running batch at a coming step. A request no
        recorded key can serve comes back from the next step() as an error Result. Raises
        PromptError for a malformed dict or an id that is already live. stream=False: no
        output until it finishes (its text is decoded once, at the end)."""
        self.check_open()
        req = request if isinstance(request, Request) else parse_request(
            request, where, self.vocab_size)
        self._settle_aborts([req.id])
        if self._is_live(req.id):
            raise PromptError(f"{where}: duplicate id {req.id!r}: a request with that id is still being "
                              f"served; ids must be unique, results are keyed by them.")
        if not self.has_unfinished():  # a new run: the graphs read the weights where they were recorded
            self.executor.runner.check_weights()
        self._owners.pop(req.id, None)  # (a consumer still waiting on an aborted request of this id: not this one)
        if self._pending:  # after the submitted ones still waiting for admission, in order
            entry = (req, stream, time.perf_counter())
            self._pending_ids |= {req.id}  # (no call between: see Deliveries on Ctrl-C)
            self._pending.append(entry)
            return
        self._admit(req, stream, time.perf_counter(), queued=False)

    def _admit(self, req: Request, stream: bool, arrived: float, queued: bool = True) -> None:
        """Admission: the request's Sequence joins the scheduler's queue, or its refusal waits
        to be handed out. arrived: when it was submitted (its time to first token counts from there).
        queued: it is the first of `_pending`, which it leaves. Made first (its text encoded, its chat
        rendered), then recorded by stores alone: a Ctrl-C leaves it waiting as it was, or admitted."""
        if self._run_start is None:
            self._run_start = time.perf_counter()
        item = self.admission.admit(req, self._arrivals + 1, speculative=self.drafter is not None)
        if isinstance(item, Result):
            out = [RequestOutput(req.id, finished=True, finish_reason="error", result=item)]
            live, tokens, refused = None, 0, 1
        else:
            out, tokens, refused = [], len(item.prompt_ids), 0
            live = Live(item, arrived, TextStream(self.tokenizer, req.stop_strings), stream)
        if queued:  # (no call from here on but the last: see Deliveries on Ctrl-C)
            del self._pending[0]
            self._pending_ids -= {req.id}
        self._arrivals += 1
        self.stats.requests += 1
        self.stats.refused += refused
        self.stats.prompt_tokens += tokens
        self._undelivered += out
        if live is not None:
            self._live[req.id] = live
            self.scheduler.waiting.append(item)  # (Scheduler.add; the last call: nothing after it)

    def _admit_pending(self, most: int) -> None:
        """Admit up to `most` of the submitted requests, in order (each leaves `_pending` as it
        is admitted: a Ctrl-C while encoding its text leaves it waiting)."""
        while self._pending and most > 0:
            self._admit(*self._pending[0])
            most -= 1

    def _top_up(self) -> None:
        """Before the scheduler decides anything that depends on its queue: admit submitted
        requests until the queue holds every one the next step could take (the rows free in
        the batch), so that every step is the one it would be with all of them admitted at
        submit (admission in slices never changes a step, and so never a token)."""
        sched = self.scheduler
        while self._pending and len(sched.waiting) < max(sched.plan.max_batch_size - len(sched.running), 0):
            self._admit_pending(1)

    def _admit_slice(self) -> None:
        """A slice of the submitted requests, admitted after a launch while the device runs."""
        self._admit_pending(ADMIT_SLICE)

    def _is_live(self, request_id: str) -> bool:
        """Submitted, being served, or finished with its last output not yet handed out."""
        return (request_id in self._live or request_id in self._pending_ids
                or any(o.id == request_id for o in self._undelivered))

    @locked
    def abort(self, request_id: str) -> bool:
        """Stop serving a live request at the next step: it leaves the scheduler, its KV
        blocks are freed, and no more outputs come for it. False if it is not live (nothing
        is, once the engine is closed)."""
        if self.closed or not self._is_live(request_id):
            return False
        self._aborts.add(request_id)
        if self._only_aborted():  # its consumer may step no more (a stream left early): the collector
            collection.release(self)  # goes back on now, not at some later call's step
        return True

    def _only_aborted(self) -> bool:
        """Whether every request still here is one being aborted (steps in flight aside)."""
        a = self._aborts
        return (len(a) >= len(self._live) and a.issuperset(self._live) and a.issuperset(self._pending_ids)
                and all(o.id in a for o in self._undelivered))

    def has_unfinished(self) -> bool:
        """Whether step() has anything left to do or hand out."""
        return bool(self._live or self._undelivered or self._flight or self._pending)

    @locked
    def step(self, take=None) -> list[RequestOutput]:
        """Advance by one step: apply aborts, launch a step if none is in flight (and, in
        steady decoding, the next one before reading this one's tokens; where every row ends
        with that one, the next wave's first step too), admit a slice of the submitted
        requests while the device runs, read the oldest step's tokens back. Returns every
        request's news: outputs other consumers left in place first, then refusals, then
        this step's. take(output): which of them the caller takes (a consumer of some requests,
        Consumers.outputs_of); the others stay for the next step, handed out by the store that
        takes these (a Ctrl-C as step() returns loses none of them)."""
        self.check_open()
        collection.hold(self)  # the collector runs at this step's safe point below (collection.py)
        try:
            self._apply_aborts()  # (a Ctrl-C as it frees an aborted request's blocks: recovered too)
            self._step()
        except BaseException:
            self._recover()
            collection.release(self)
            raise
        ready = self._undelivered
        if take is None:
            outputs, left = ready, []
        else:
            mine = [take(o) for o in ready]
            outputs, left = [o for o, m in zip(ready, mine) if m], [o for o, m in zip(ready, mine) if not m]
        if not (self._live or self._flight or self._pending):  # nothing to run: outputs left for another consumer
            collection.release(self)  # (a consumer dropped in a reference cycle has only the collector to close it)
        self._undelivered = left
        return outputs

    def _step(self) -> None:
        """step()'s launches and read (the collector held), its outputs into `_undelivered`."""
        self._reading = []  # (a step drained after the first read must not hide the first's rows from _orphans)
        with torch.inference_mode():
            if not self._flight:
                self._launch_next()
            if len(self._flight) == 1:
                f = self._flight[0]
                if self.scheduler.retire_ahead(f.step) or self.scheduler.settle_ahead(f.step):
                    # Every row ends with this step, or none draws in it: form and launch the
                    # next step now (it needs none of this one's tokens), while the device runs it.
                    self._launch_next()
                else:
                    # Overlap: while the device runs this step, launch the next one before reading
                    # this one's tokens back: the same decode rows (inputs advanced on the device),
                    # or after a prefill the decode step its rows join (their tokens gathered there).
                    self._top_up()
                    ahead = self.scheduler.extend_decode(f.step)
                    if ahead is not None:
                        self._flight.append(self.launcher.launch(ahead, self.stats))
                        if self.scheduler.retire_ahead(ahead, ahead=1):
                            # Every row ends with that step: the next wave's first step goes now
                            # too, so the device runs it right after, whatever the host does then.
                            self._launch_next()
                        elif (self._pending or self.scheduler.waiting) and self.scheduler.wave_ends_next(ahead):
                            # Every row ends with the step after: it goes now, and the next wave's
                            # first step behind it (three ahead: its forming hides behind two steps).
                            last = self.scheduler.extend_decode(ahead, unread=2)
                            if last is not None:
                                self._flight.append(self.launcher.launch(last, self.stats))
                                if self.scheduler.retire_ahead(last, ahead=2):
                                    self._launch_next()
                    elif self.pipeline_changes:
                        # The rows change (some finish, requests are admitted, prompts go on in
                        # chunks): the step the scheduler would form after this one is read,
                        # formed now where it needs none of its tokens (scheduler.form_ahead).
                        ahead = self.scheduler.form_ahead(f.step, self._top_up)
                        if ahead is not None:
                            self._flight.append(self.launcher.launch(ahead, self.stats))
            self._admit_slice()  # while the device runs what was just launched
            collection.collect_due(self, len(self._flight), any(f.step.is_prefill for f in self._flight))
            drew = self._drawn(self._flight.popleft()) if self._flight else []
            while self._flight and all(s.finished for s in self._flight[0].step.seqs):
                self._drawn(self._flight.popleft())  # ran ahead for rows that all finished: drain it
            if not self._flight:
                # The rows changed (a request finished, or one waits to be admitted): form and
                # launch the next step now, before turning this one's tokens into text.
                self._launch_next()
            for d in drew:  # (kept as they are made: a step that raises loses none, Engine._recover)
                self._news(*d)
        self.stats.preemptions = self.scheduler.num_preemptions - self._preemptions_before
        if self._run_start is not None:
            self.stats.seconds = time.perf_counter() - self._run_start

    @locked
    def submit(self, requests: Iterable[Request | dict], gpu_timing: bool = False, stream: bool = True) -> list[str]:
        """Validate every request (ids unique within the batch and among live requests),
        then queue them all; their ids. Submitted to an idle engine they start a new run:
        `stats` then cover this batch (and whatever joins it before the engine is idle).
        stream=False: each request's one output is its last (no per-step text deltas)."""
        self.check_open()
        reqs = self.parsed(requests)
        self._settle_aborts(r.id for r in reqs)
        first: dict[str, int] = {}
        for i, r in enumerate(reqs):
            if r.id in first:
                raise PromptError(f"request {i}: duplicate id {r.id!r} (first at request {first[r.id]}); "
                                  f"ids must be unique, results are keyed by them.")
            if self._is_live(r.id):
                raise PromptError(f"request {i}: duplicate id {r.id!r}: a request with that id is still being "
                                  f"served; ids must be unique, results are keyed by them.")
            first[r.id] = i
        idle = not self.has_unfinished()
        if idle:  # a new run: the graphs read the weights where they were recorded
            self.executor.runner.check_weights()
        now = time.perf_counter()
        entries, owners, ids = deque((req, stream, now) for req in reqs), {req.id: req for req in reqs}, set(first)
        try:
            if idle:
                collection.hold(self)  # (before the run's clock: queueing allocates too)
                self.start_run(gpu_timing)
            self._pending_ids |= ids  # (no call between: see Deliveries on Ctrl-C)
            self._pending += entries
            self._owners |= owners
        except BaseException:  # (Ctrl-C as the collector was held: none queued)
            if idle and not self.has_unfinished():
                collection.release(self)
            raise
        if idle:
            # Admit what the first step can take, launch it, and admit the rest in slices while
            # the device runs (every step is the one it would be with all admitted now: _top_up).
            with torch.inference_mode():
                try:
                    self._launch_next()
                except BaseException:  # its rows are all of these: none may stay live, stepped at every later call
                    self._reading = []  # (recovered as a failed step is: no block or slot left held part-way)
                    self._recover()
                    for req in reqs:
                        self.abort(req.id)
                    raise
            if not self.has_unfinished():  # no requests: no step will ever release the collector
                collection.release(self)
        return list(first)

    def _apply_aborts(self) -> None:
        """The aborts asked for, applied, each made first and recorded by stores alone (see
        Deliveries on Ctrl-C; one interrupted is applied again at the next step)."""
        aborts = self._aborts
        if aborts and self._pending_ids & aborts:  # submitted, not admitted: counted, dropped
            kept = deque(p for p in self._pending if p[0].id not in aborts)
            dropped = len(self._pending) - len(kept)
            self.stats.requests += dropped  # (no call from here on)
            self.stats.aborted += dropped
            self._pending_ids -= aborts
            self._pending = kept
        for rid in list(aborts):
            live = self._live.get(rid)
            if live is None:  # finished; its last output is dropped below
                continue
            self.scheduler.abort(live.seq.request)  # with n > 1, every completion forked from it (again: none left)
            done = self._choices.get(rid) or ()  # its finished completions: never handed out, not counted
            tokens = sum(len(r.token_ids) for r in done if r is not None)
            self.stats.aborted += 1  # (no call from here on)
            self.stats.completion_tokens -= tokens
            del self._live[rid]
            if rid in self._choices:
                del self._choices[rid]
        if aborts:
            kept, applied = [o for o in self._undelivered if o.id not in aborts], len(aborts)
            self._undelivered = kept  # (no call from here on)
            self._aborts_applied += applied
            self._aborts = set()

    def _recover(self) -> None:
        """A step raised part-way (Ctrl-C, a device error): the steps in flight dropped, every sequence
        recomputed as after a preemption (Scheduler.requeue_all), so the requests of other consumers
        go on with exactly their tokens; one that finished before its Result was made gets it now."""
        self._flight.clear()
        self.scheduler.requeue_all()
        self._orphans()

    def _launch_next(self) -> None:
        """Form and launch a step (it joins the steps in flight), unless nothing is left to run."""
        self._top_up()
        while self.scheduler.has_work:
            step = self.scheduler.schedule()
            if step is not None:  # None: every running row stepped aside this time; they wait now
                self._flight.append(self.launcher.launch(step, self.stats))
                return
            self._top_up()

    def follow(self) -> int:
        """Ranks other than 0: replay every step rank 0 broadcasts, until it closes."""
        self.check_open()
        return self.broadcast.follow(self.eager)
