"""CUDA graphs recorded and launched through the driver API (libcuda, by ctypes), with torch's
caching allocator serving the recording's allocations from the runner's shared pool.

Why not torch.cuda.CUDAGraph: on the H200 (driver 580, torch 2.11; docs/performance.md, twelfth
and thirteenth sessions) every kernel of every graph in a process launches 0.2-0.45 us later once
torch's capture_begin / capture_end have recorded a few graphs over distinct tensors (the bs-64 step
of the 1B: +32 us). Graphs recorded by the driver's stream capture did not bring that state on in
the runtime (the bs-64 key recorded six times; the bench after its 92 keys) nor in the probes,
whatever the capture mode, instantiation flags, stream waits or allocator pool — except one probe
case (a kernel on the capture stream before each recording, scripts/stream_probe.py WARM=1
ALLOC=1), so the state is a driver behaviour this path avoids in practice, not by construction:
capture's GEMM timer did exactly that until the eighteenth session (graph_time_us).
The recording is the same stream capture as torch's, so replays compute the same thing.

What torch's capture does that this one does not: register RNG generator states (no step of this
project draws from torch's generators inside a graph) and route pinned host allocations to the pool
(steps make none).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ...errors import CaptureError

_CAPTURE_MODE_GLOBAL = 0  # as torch's default: other threads' unsafe CUDA calls fail the capture
_INSTANTIATE_FLAGS = 1 | 8  # as torch's: auto-free on launch, node priorities
_lib = None
_lib_lock = threading.Lock()


def _driver():
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            for name, args in (("cuStreamBeginCapture_v2", (ctypes.c_void_p, ctypes.c_int)),
                               ("cuStreamEndCapture", (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))),
                               ("cuGraphInstantiateWithFlags", (ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                                ctypes.c_ulonglong)),
                               ("cuGraphLaunch", (ctypes.c_void_p, ctypes.c_void_p)),
                               ("cuGraphExecDestroy", (ctypes.c_void_p,)),
                               ("cuGraphDestroy", (ctypes.c_void_p,)),
                               ("cuGraphGetNodes", (ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))),
                               ("cuStreamCreate", (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)),
                               ("cuStreamDestroy_v2", (ctypes.c_void_p,)),
                               ("cuGetErrorName", (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)))):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise CaptureError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")


class DriverGraph:
    """One executable graph: `record(step)` captures it on `stream`, `replay()` launches it on the
    device's current stream, `close()` (or collection) destroys it and releases its hold on the pool.
    Once every graph recorded into a pool is closed, that pool takes no further recording (torch's
    allocator rule): a runner's graphs live as long as the runner."""

    def __init__(self, device: torch.device, pool, stream: torch.cuda.Stream):
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        self.pool = pool
        self.stream = stream
        self._exec = ctypes.c_void_p()
        self._holds_pool = False
        self._launch = _driver().cuGraphLaunch  # replay()'s, without the loader's lock on every step

    def record(self, step):
        """Capture `step()` (which must only launch work on the current stream) and instantiate it;
        returns what `step` returned. On failure nothing is left capturing and the error is raised.
        The graph is instantiated in this device's context (made current here, as torch's capture
        does), where replay() launches it."""
        with torch.cuda.device(self.device_index):
            return self._record(step)

    def _record(self, step):
        lib = _driver()
        handle = ctypes.c_void_p(self.stream.cuda_stream)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        # this thread's allocations to the pool (and a hold on it, its use count) until _cuda_endAllocateToPool
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device_index, self.pool)
        graph = ctypes.c_void_p()
        try:
            with torch.cuda.stream(self.stream):
                _check(lib.cuStreamBeginCapture_v2(handle, _CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture")
                try:
                    outputs = step()
                except BaseException:
                    if lib.cuStreamEndCapture(handle, ctypes.byref(graph)) == 0 and graph.value:
                        lib.cuGraphDestroy(graph)
                    raise
                ended = lib.cuStreamEndCapture(handle, ctypes.byref(graph))
            _check(ended, "cuStreamEndCapture (the recording was invalidated: a step called something "
                          "that is not allowed while capturing, or launched work on another stream)")
        finally:
            torch._C._cuda_endAllocateToPool(self.device_index, self.pool)
        try:
            count = ctypes.c_size_t()
            _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
            if count.value == 0:
                raise CaptureError("the recording holds no work: the step launched nothing on the capture stream")
            _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), graph, _INSTANTIATE_FLAGS),
                   "cuGraphInstantiateWithFlags")
        finally:
            lib.cuGraphDestroy(graph)
        # Released at close(). A failed recording keeps its hold, as torch's capture does: torch's
        # allocator refuses a pool whose holders all released it, and the runner's next key records
        # into the same pool.
        self._holds_pool = True
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return outputs

    def replay(self) -> None:
        _check(self._launch(self._exec, ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)),
               "cuGraphLaunch")

    def close(self) -> None:
        if self._exec.value:
            _driver().cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._holds_pool:
            self._holds_pool = False
            torch._C._cuda_releasePool(self.device_index, self.pool)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: the driver may be gone already)
            pass


_CU_STREAM_NON_BLOCKING = 1  # as torch's pooled side streams


_DROPPED: list = []  # the streams of runners collected without close(): given back at the next safe point


def own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A capture stream of the caller's alone (GraphRunner), given back by `give_back`.

    Not one of torch's pooled streams: torch keeps a cuBLAS workspace per (handle, stream) for
    good, made at the stream's first GEMM; on a capture stream that is inside a recording, in the
    runner's pool, and the graphs hold its address. A pooled stream comes back to the next runner
    once 32 more were taken, whose graphs would then use a workspace in an earlier runner's pool;
    with a stream of its own a runner's workspace is its own, freed at its close
    (`release_workspaces`) with nothing else recorded over it."""
    if _DROPPED:  # (a runner's start: no recording is under way here)
        give_back(None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):  # (the primary context current: torch made it)
        _check(_driver().cuStreamCreate(ctypes.byref(handle), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


def give_back(stream: torch.cuda.ExternalStream | None) -> None:
    """A closed runner's `own_stream` (and those of runners collected without close) given back:
    the cuBLAS workspaces freed first (`release_workspaces`), then the streams destroyed (work
    still queued on one completes first, as the driver does). Not while this thread records."""
    dropped = _DROPPED[:]
    del _DROPPED[:len(dropped)]  # (one a finalizer adds meanwhile waits for the next time)
    streams = dropped + ([] if stream is None else [stream])
    release_workspaces()
    for s in streams:
        _driver().cuStreamDestroy_v2(ctypes.c_void_p(s.cuda_stream))


def dropped_stream(stream: torch.cuda.ExternalStream) -> None:
    """A runner collected without close (a finalizer, which may run in the middle of another
    runner's recording): its stream waits for the next safe point, `own_stream` or `give_back`."""
    _DROPPED.append(stream)


def release_workspaces() -> None:
    """The cuBLAS / cuBLASLt workspaces torch keeps per (handle, stream), freed (torch makes
    them again at the next GEMM on a stream). A closed runner's own (in its pool, which is then
    free as a whole); the live runners' (each in its own pool, which takes no allocation after its
    lock, so its graphs go on using the same memory); those of other streams (the allocator's
    stream order keeps them safe). The timing streams are made afresh at their next use, their
    workspaces outside any recording again (`_timing_stream`). Call with the device idle."""
    torch._C._cuda_clearCublasWorkspaces()
    _TIMING_STREAMS.clear()


_TIMING_STREAMS: dict[int, torch.cuda.Stream] = {}


def _timing_stream(index: int) -> torch.cuda.Stream:
    """The device's one timing stream (one stream: one cuBLAS workspace), made with that workspace:
    a GEMM and an in-place addmm run on it once, outside any recording (torch keeps a stream's
    workspace for good, so one made in a recording would hold the recording's pool)."""
    stream = _TIMING_STREAMS.get(index)
    if stream is None:
        stream = _TIMING_STREAMS[index] = torch.cuda.Stream(index)
        stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream):
            a = torch.ones((16, 16), device=torch.device("cuda", index))
            torch.nn.functional.linear(a, a)
            a.addmm_(a, a.t())
        torch.cuda.current_stream(index).wait_stream(stream)
        stream.synchronize()
    return stream


def graph_time_us(step, device: torch.device, repeats: int = 3) -> float:
    """GPU microseconds of `step()` (launches on the current stream only) as a replayed graph spends
    them, without the host's launch cost: run once on the current stream (compiles, lets cuBLAS
    pick), recorded once by the driver on the timing stream into a pool of its own, replayed
    `repeats` times between CUDA events, the best replay.

    Never run on the timing stream outside its recordings (but once, _timing_stream): work on a side
    stream and then its recording, over new tensors, put the process in the slow-launch state that
    DriverGraph avoids — once capture's GEMM timing ran the step there before each recording, every
    graph of the process launched its kernels later (docs/performance.md, eighteenth session: a
    100-kernel canary 84.6 -> 102.6 us a replay, the 1B's bs-64 step 1.06 -> 1.10 ms)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):  # the events, the replays and the stream on `device`
        return _graph_time_us(step, device, index, repeats)


def _graph_time_us(step, device: torch.device, index: int, repeats: int) -> float:
    stream = _timing_stream(index)
    step()
    pool = torch.cuda.graph_pool_handle()
    graph = DriverGraph(device, pool, stream)
    try:
        try:
            graph.record(step)
        except BaseException:  # e.g. out of memory: the pool is this call's alone, give back what it took
            torch._C._cuda_releasePool(graph.device_index, pool)
            raise
        return best_replay_us(graph, repeats)
    finally:
        graph.close()


def best_replay_us(graph: DriverGraph, repeats: int) -> float:
    """The best of `repeats` replays of `graph` (after one untimed), us between CUDA events."""
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3)
    return best
