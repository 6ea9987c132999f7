"""The graph runner: one interface, two backends.

- `cuda`: CUDA graphs recorded by the driver's stream capture (`cuda_graph.DriverGraph`, not
  torch.cuda.CUDAGraph: its module says why), every graph in torch's one shared memory pool.
- `static` (CPU): "captures" the step closure and replays it by calling it.

Both keep the same strict replay checks, always on: the key was recorded; the metadata
object is the one captured (`is`, not `==`); the token count equals the key's; the
positions have the key's shape; no persistent buffer moved since capture. After `lock()`
capture raises, so nothing can be recorded once serving starts.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from ...buckets import GraphKey
from ...errors import CaptureError, ReplayMismatchError
from . import cuda_graph
from .cuda_graph import DriverGraph

BACKENDS = ("cuda", "static")


@dataclass
class CaptureStats:
    capture_seconds: float
    pool_bytes: int  # bytes the shared pool grew by for this key


@dataclass
class _Recorded:
    key: GraphKey
    meta: object
    outputs: object
    replay_fn: Callable[[], None]
    addresses: dict  # name -> data_ptr at capture


class GraphRunner:
    def __init__(self, backend: str, device: torch.device, persistent: Callable[[], dict],
                 weights: Callable[[], dict] | None = None):
        """`persistent()` returns the tensors checked at every replay; `weights()` those
        checked by `check_weights()` (the model's parameters), by name."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown graph backend {backend!r}; expected one of {BACKENDS}")
        if backend == "cuda" and device.type != "cuda":
            raise ValueError("the cuda graph backend needs a CUDA device")
        self.backend = backend
        self.device = device
        self._persistent = persistent
        self._weights = weights or dict
        self._weight_addresses: dict | None = None
        self._graphs: dict[GraphKey, _Recorded] = {}
        self._locked = False
        self.pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        self._stream = cuda_graph.own_stream(device) if backend == "cuda" else None
        # a runner dropped without close(): its stream is given back at the next runner's start or close
        self._dropped = weakref.finalize(self, cuda_graph.dropped_stream, self._stream) if self._stream else None
        if self._dropped is not None:
            self._dropped.atexit = False  # (the process ends: nothing to give back)
        self._graphs_alive: list = []  # the graphs must outlive their replays
        self._cache_emptied = False
        self.closed = False
        self.num_captures = 0
        self.replays: Counter = Counter()

    # ---- capture -------------------------------------------------------------------
    @property
    def locked(self) -> bool:
        return self._locked

    def lock(self) -> None:
        """From now on only replay: any capture raises."""
        self._locked = True

    def close(self) -> None:
        """Destroy every graph and let go of what they hold: the recorded outputs and step
        closures (the buffers, KV cache and weights they reach), the driver graphs and their holds on
        the shared pool (torch frees a pool none holds at its next empty_cache). The device must be
        idle (Executor.close synchronises first). Idempotent; a closed runner neither records nor replays."""
        graphs, self._graphs_alive = self._graphs_alive, []
        self._graphs = {}
        self._locked = self.closed = True
        self._persistent, self._weights = dict, dict  # (bound methods of the executor: no cycle left)
        self._weight_addresses = None
        for graph in graphs:
            graph.close()
        if self._dropped is not None:
            self._dropped.detach()
            cuda_graph.give_back(self._stream)
        self.pool = self._stream = None

    def capture(self, key: GraphKey, step: Callable[[], object], meta) -> CaptureStats:
        """Record `step` (which reads and writes only persistent buffers) for `key`."""
        if self.closed:
            raise CaptureError(f"capture of {key} after close(): the runner's graphs were destroyed.")
        if self._locked:
            raise CaptureError(f"capture of {key} after lock(): the runtime only replays. Every graph "
                               f"must be recorded at start-up, before lock().")
        if key in self._graphs:
            raise CaptureError(f"{key} was already captured")
        start = time.perf_counter()
        if self.backend == "cuda":
            outputs, pool_bytes, replay_fn = self._capture_cuda(step)
        else:
            outputs = step()  # the static backend's "recording" is the closure itself
            pool_bytes = 0

            def replay_fn(step=step, outputs=outputs):
                _copy_outputs(step(), outputs)
        seconds = time.perf_counter() - start
        self._graphs[key] = _Recorded(key, meta, outputs, replay_fn, self._addresses())
        weights = {n: t.data_ptr() for n, t in self._weights().items()}
        if self._weight_addresses is None:
            self._weight_addresses = weights
        elif weights != self._weight_addresses:
            raise CaptureError(f"{key}: model weights moved between captures ({_moved(self._weight_addresses, weights)})")
        self.num_captures += 1
        return CaptureStats(seconds, pool_bytes)

    def _capture_cuda(self, step):
        """Record on a side stream into the shared pool. Unlike torch.cuda.graph() this skips a
        gc.collect() and empty_cache() per key; the cache is emptied once, before the first
        capture, so the growth of reserved memory is the pool's growth. Nor does it synchronise:
        recording runs nothing on the device, so work queued before it (a capture's verification
        of the key recorded before) runs while the host records (the side stream waits for that
        work before the recording, not after)."""
        if not self._cache_emptied:
            torch.cuda.empty_cache()
            self._cache_emptied = True
        before = torch.cuda.memory_reserved(self.device)
        graph = DriverGraph(self.device, self.pool, self._stream)
        outputs = graph.record(step)
        self._graphs_alive.append(graph)
        return outputs, torch.cuda.memory_reserved(self.device) - before, graph.replay

    # ---- replay --------------------------------------------------------------------
    def replay(self, key: GraphKey, meta, num_tokens: int, positions: torch.Tensor):
        """Replay the graph of `key`; returns the outputs recorded at capture (now refreshed)."""
        rec = self._graphs.get(key)
        if rec is None and self.closed:
            raise ReplayMismatchError(f"replay of {key} after close(): the runner's graphs were destroyed.")
        if rec is None:
            raise ReplayMismatchError(f"replay of {key}: no graph was recorded for it; recorded keys: "
                                      f"{', '.join(str(k) for k in sorted(self._graphs)) or 'none'}")
        if meta is not rec.meta:
            raise ReplayMismatchError(f"replay of {key}: attention metadata is a different object than "
                                      f"the one captured (expected id {id(rec.meta):#x}, got {id(meta):#x}); "
                                      f"the graph reads the captured object's tensors, so a new one would "
                                      f"be silently ignored")
        if num_tokens != key.num_tokens:
            raise ReplayMismatchError(f"replay of {key}: expected={key.num_tokens} tokens != got={num_tokens}; "
                                      f"a shorter input leaves the tail of the static buffers stale")
        if tuple(positions.shape) != (key.num_tokens,):
            raise ReplayMismatchError(f"replay of {key}: positions shape expected={(key.num_tokens,)} != "
                                      f"got={tuple(positions.shape)}; copy_() would broadcast silently")
        now = self._addresses()
        if now != rec.addresses:
            raise ReplayMismatchError(f"replay of {key}: persistent buffers moved since capture: "
                                      f"{_moved(rec.addresses, now)}; the graph would read freed memory")
        rec.replay_fn()
        self.replays[key] += 1
        return rec.outputs

    def check_weights(self) -> None:
        """Raise if any model parameter moved since the graphs recorded its address."""
        if self._weight_addresses is None:
            return
        now = {n: t.data_ptr() for n, t in self._weights().items()}
        if now != self._weight_addresses:
            raise ReplayMismatchError(f"model weights moved since capture: {_moved(self._weight_addresses, now)}; "
                                      f"the graphs would read freed memory. Reload by restarting, which re-records.")

    def _addresses(self) -> dict:
        return {name: t.data_ptr() for name, t in self._persistent().items()}


def _moved(before: dict, now: dict) -> str:
    names = sorted(n for n in set(now) | set(before) if now.get(n) != before.get(n))
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _copy_outputs(new, recorded) -> None:
    """The static backend writes fresh results into the tensors returned at capture, so
    callers hold the same output objects for both backends."""
    if new is None:  # an output the step does not write (a greedy key's logits)
        return
    if isinstance(new, torch.Tensor):
        recorded.copy_(new)
    else:
        for n, r in zip(new, recorded):
            _copy_outputs(n, r)
