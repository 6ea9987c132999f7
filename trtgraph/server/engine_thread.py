"""One thread owns the engine (its scheduler and the GPU). The HTTP side never touches the
engine: it puts requests and aborts into this thread's inbox and drains a per-request
asyncio queue that this thread fills after each step. Requests join and leave the running
batch at any step; the fast path and the overlap work as in `run`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import TrtgraphError
from ..runtime.serving.deliveries import BY_CHOICE
from ..runtime.serving.requests import Request
from ..runtime.serving.streaming import RequestOutput
from .metrics import Metrics

IDLE_WAIT_SECONDS = 0.05  # how long an idle engine thread sleeps before looking at its inbox again


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    started: bool = False  # has produced output (no longer counts as queued)


@dataclass(frozen=True)
class Aborted:
    """Put in a request's queue when the server aborts it (shutdown)."""
    reason: str


class EngineThread:
    def __init__(self, load: Callable[[], object], metrics: Metrics, max_waiting: int):
        """`load` builds the Engine (load, check, re-record, lock) inside this thread."""
        self._load = load
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.engine = None
        self.ready = threading.Event()  # graphs locked, serving
        self.failed: BaseException | None = None  # why loading failed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}  # request id -> where its outputs go (engine thread only)
        self._queued = 0  # accepted requests that have produced nothing yet (guarded by _lock)
        self._thread = threading.Thread(target=self._main, name="trtgraph-engine", daemon=True)
        self.on_failure: Callable[[], None] = lambda: None  # e.g. tell the HTTP server to exit
        metrics.queue_depth.set_function(lambda: self._queued)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queued

    # ---- the HTTP side ---------------------------------------------------------------
    def submit(self, *requests: Request) -> asyncio.Queue | None:
        """Queue requests from the event loop (all or none); their outputs arrive in the returned
        queue (each names its request). None when that would make more than max_waiting queued."""
        with self._lock:
            if self._queued + len(requests) > self.max_waiting:
                return None
            self._queued += len(requests)
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for request in requests:
            self._inbox.put(("add", request, _Sink(loop, q)))
        self._wake.set()
        return q

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def abort_all(self, reason: str) -> None:
        """Abort every request in flight; each consumer gets Aborted(reason)."""
        self._inbox.put(("abort_all", reason, None))
        self._wake.set()

    def stop(self, timeout_s: float) -> None:
        """Abort what is still running, tell its consumers, and end the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the engine thread -----------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._load()
        except BaseException as exc:  # reported by the server after it exits
            self.failed = exc
            self.on_failure()
            return
        self.engine.start_run(gpu_timing=True)  # (CUDA only) the GPU's idle time per step, for /metrics
        self.metrics.sample(self.engine)
        self.ready.set()
        try:
            self._serve()
        except BaseException as exc:  # a step failed: end every request, stop the server, report it
            self.failed = exc
            self.ready.clear()
            for rid in list(self._sinks):
                self._finish_sink(rid, Aborted(f"the engine failed: {type(exc).__name__}: {exc}"))
            self.on_failure()

    def _serve(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            if not engine.has_unfinished():
                self._wake.wait(IDLE_WAIT_SECONDS)
                continue
            t0 = time.perf_counter()
            outputs = engine.step()
            self._deliver(outputs)
            self.metrics.after_step(engine, outputs, time.perf_counter() - t0)
        self._drain_inbox()
        self._abort_all("the server is shutting down")
        if engine.has_unfinished():
            engine.step()  # applies the aborts: every KV block is free again

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, arg, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "abort_all":
                self._abort_all(arg)
                continue
            if op == "abort":
                if arg in self._sinks:
                    self.engine.abort(arg)
                    self._close_sink(arg)
                    self.metrics.requests.labels("abort").inc()
                continue
            try:  # by choice: n > 1 completions and logprobs stream too (the handler keeps what it answers)
                self.engine.add_request(arg, stream=BY_CHOICE)
            except TrtgraphError as exc:  # handed to the request's consumer
                self._sinks[arg.id] = sink
                self._finish_sink(arg.id, exc)
                continue
            self._sinks[arg.id] = sink

    def _abort_all(self, reason: str) -> None:
        for rid in list(self._sinks):
            self.engine.abort(rid)
            self._finish_sink(rid, Aborted(reason))
            self.metrics.requests.labels("abort").inc()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's queue: one hand-over per event loop per step, not one
        per output."""
        handed: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.id)
            if sink is None:
                continue  # aborted meanwhile
            if out.finished:
                self._close_sink(out.id)
            else:
                self._started(sink)
            handed.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, items in handed.items():
            _call(loop, _put_all, items)

    def _started(self, sink: _Sink) -> None:
        """The request produced something (or ended): it no longer counts as queued."""
        if not sink.started:
            sink.started = True
            with self._lock:
                self._queued -= 1

    def _close_sink(self, request_id: str) -> _Sink:
        sink = self._sinks.pop(request_id)
        self._started(sink)
        return sink

    def _finish_sink(self, request_id: str, item) -> None:
        _put(self._close_sink(request_id), item)


def _put(sink: _Sink, item) -> None:
    _call(sink.loop, sink.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call(loop: asyncio.AbstractEventLoop, fn, arg) -> None:
    """Run fn(arg) on the event loop's thread."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the event loop has closed: nobody is listening any more
        pass
