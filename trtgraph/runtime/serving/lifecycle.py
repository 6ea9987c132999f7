"""An engine's runs and its end (`Lifecycle`, mixed into the Engine): start_run() begins a run's
stats; close() stops it for good and gives back what it holds; every call that would serve
refuses after it."""

from __future__ import annotations

import time
from collections import deque

from ...errors import EngineClosedError
from . import collection
from .stats import RunStats


class Lifecycle:
    def start_run(self, gpu_timing: bool = False) -> None:
        """Fresh stats, from now on (an idle engine only; submit() and generate() start one
        when the engine is idle, so what they report covers their own call). gpu_timing:
        CUDA events around every step, for the GPU's idle time."""
        self.check_open()
        if self.has_unfinished():
            raise RuntimeError("start_run() on an engine that is still serving requests")
        self.stats = RunStats(record_seconds=self.record_seconds, speculative=self.drafter is not None)
        self._preemptions_before = self.scheduler.num_preemptions
        self._run_start = time.perf_counter()
        self.launcher.timing = gpu_timing and self.executor.device.type == "cuda"
        if self.launcher.timing:
            self.stats.gpu_busy_seconds = 0.0

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this engine was closed (LLM.close() / Engine.close(), or the end of its `with` "
                                    "block): it serves nothing more. Build a new trtgraph.LLM to go on.")

    def close(self) -> None:
        """Stop serving for good and give back what the engine holds; idempotent. Rank 0 tells
        the other ranks to stop following. The requests still live are dropped (a consumer
        waiting for them gets EngineClosedError at its next step; an LLM.stream ends), the
        collector goes back to Python (collection.py), and the executor's graphs, KV cache,
        buffers and weights are released (Executor.close: on CUDA, torch's allocator has
        their memory back; torch.cuda.empty_cache() returns it to the device). Every call that
        would serve refuses from then on (EngineClosedError); `stats` stays readable."""
        with self._lock:  # (a step on another thread ends first)
            if self.closed:
                return
            self.closed = True
            try:
                if self.broadcast is not None:
                    self.broadcast.stop()
            finally:
                collection.release(self)
                self._drop_everything()

    def _drop_everything(self) -> None:
        """close()'s release: the requests, the steps in flight, then what is on the device."""
        self._live, self._undelivered, self._aborts, self._flight = {}, [], set(), deque()
        self._pending, self._pending_ids, self._choices, self._owners, self._reading = deque(), set(), {}, {}, []
        self.executor.close()
        self.launcher = self.broadcast = None  # (pinned result buffers, events; the ranks' header)
