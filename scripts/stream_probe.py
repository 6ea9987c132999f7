"""Probe (H200, issue 12, thirteenth session): which stream does a torch capture make, and does a
capture that torch's CUDAGraph does not drive avoid the slow-launch state of
scripts/graph_count_probe.py?

MODE=gdb (run under cuda-gdb with breakpoints on the driver's stream constructors, see
scripts/s13_gpu.sh): prints MARK lines between phases so the backtraces can be placed.
MODE=ids (default): for each capture method, the driver stream ids made per capture
(cuStreamGetId) and the replay time of a 100-kernel chain graph captured first, after 12 more
graphs by that method.

    MODE=ids METHOD=torch|raw|torchmm|rawmm [EXTRA_KERNELS=N] [ALLOC=1] [WARM=1] python3 scripts/stream_probe.py

EXTRA_KERNELS: the further graphs' chain length (4); ALLOC=1: each further graph on a new tensor;
WARM=1: one op on the side stream before each further capture; ALLOC=empty: the new tensor not
filled; UPFRONT=1: the further graphs' tensors allocated before g0; NOGRAPHS=1: no further graphs
(ALLOC alone); SCALARS=1: each further graph adds a different scalar.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_count_probe import _cudart, per_replay_us  # noqa: E402


RT = None
CU = None


def stream_id() -> int:
    st, sid = ctypes.c_void_p(), ctypes.c_ulonglong()
    assert RT.cudaStreamCreateWithFlags(ctypes.byref(st), 1) == 0
    assert CU.cuStreamGetId(st, ctypes.byref(sid)) == 0
    RT.cudaStreamDestroy(st)
    return sid.value


class RawGraph:
    """Stream capture driven through libcudart directly: begin on the torch side stream (relaxed mode;
    `global` in the method: global mode), torch ops (which allocate nothing here), end, instantiate
    with no flags (`flags9` in the method: torch's, auto-free on launch | node priority); `pool` in
    the method: torch's allocator sends the stream's allocations to the graph pool meanwhile."""

    def __init__(self, stream, body, method="raw", pool=None):
        s = ctypes.c_void_p(stream.cuda_stream)
        dev = torch.cuda.current_device()
        if "pool" in method:
            torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pool)
        assert RT.cudaStreamBeginCapture(s, ctypes.c_int(0 if "global" in method else 2)) == 0
        with torch.cuda.stream(stream):
            body()
        g = ctypes.c_void_p()
        assert RT.cudaStreamEndCapture(s, ctypes.byref(g)) == 0
        if "pool" in method:
            torch._C._cuda_endAllocateToPool(dev, pool)
        self.exec = ctypes.c_void_p()
        flags = 9 if "flags9" in method else 0
        assert RT.cudaGraphInstantiateWithFlags(ctypes.byref(self.exec), g, ctypes.c_ulonglong(flags)) == 0
        RT.cudaGraphDestroy(g)

    def replay(self):
        RT.cudaGraphLaunch(self.exec, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))


class TorchFlags0:
    """torch's capture (keep_graph=True), instantiated here with no flags."""

    def __init__(self, g):
        self.g, self.exec = g, ctypes.c_void_p()
        assert RT.cudaGraphInstantiateWithFlags(ctypes.byref(self.exec), ctypes.c_void_p(g.raw_cuda_graph()),
                                                ctypes.c_ulonglong(0)) == 0

    replay = RawGraph.replay


def capture(method: str, stream, body, pool):
    """METHOD: torch (torch's CUDAGraph), torch-relaxed (its relaxed capture mode), torch-flags0
    (instantiated with no flags), raw[-global|-flags9|-pool] (RawGraph); `nowait` in the method: no
    wait_stream before and after (a device synchronize instead), `wait` (raw): wait_stream as torch's."""
    waits = "nowait" not in method and (not method.startswith("raw") or "wait" in method)
    if waits:
        stream.wait_stream(torch.cuda.current_stream())
    else:
        torch.cuda.synchronize()
    if method.startswith("raw"):
        g = RawGraph(stream, body, method, pool)
    else:
        g = torch.cuda.CUDAGraph(keep_graph="flags0" in method)
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool, capture_error_mode="relaxed" if "relaxed" in method else "global")
            body()
            g.capture_end()
        if "flags0" in method:
            g = TorchFlags0(g)
    if waits:
        torch.cuda.current_stream().wait_stream(stream)
    else:
        torch.cuda.synchronize()
    return g


def main() -> None:
    global RT, CU
    RT, CU = _cudart(), ctypes.CDLL("libcuda.so.1")
    method = os.environ.get("METHOD", "torch")
    mode = os.environ.get("MODE", "ids")
    torch.zeros(1, device="cuda").add_(1)
    x = torch.zeros(1024, device="cuda")
    a = torch.randn(64, 64, device="cuda")
    out = torch.empty(64, 64, device="cuda")
    side = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(side):
        x.add_(1)
        torch.mm(a, a, out=out)
    torch.cuda.synchronize()

    def chain():
        for _ in range(100):
            x.add_(1)

    length = int(os.environ.get("EXTRA_KERNELS", "4"))
    targets, scalar = [x], [1]

    def small():
        if os.environ.get("SCALARS"):  # distinct parameters on the same tensor
            scalar[0] += 1
        for _ in range(length):
            targets[-1].add_(scalar[0])
        if method.endswith("mm"):
            torch.mm(a, a, out=out)

    if mode == "gdb":
        return gdb_marks(method, side, small, pool)
    upfront = [torch.zeros(1024, device="cuda") for _ in range(12)] if os.environ.get("UPFRONT") else []
    g0 = capture("torch", side, chain, pool)
    torch.cuda.synchronize()
    print(f"METHOD={method}: fresh {per_replay_us(g0):.1f} us", flush=True)
    further(method, side, small, pool, g0, targets, upfront)


def gdb_marks(method, side, small, pool) -> None:
    """MODE=gdb: three captures between MARK lines (the graphs kept: torch's allocator refuses a pool
    whose graphs are all gone)."""
    held = []
    for name in ("first", "second", "third"):
        print(f"MARK {name} capture", flush=True)
        held.append(capture(method, side, small, pool))
        torch.cuda.synchronize()
    print("MARK end", flush=True)


def further(method, side, small, pool, g0, targets, upfront) -> None:
    """12 further graphs (or tensors, NOGRAPHS), g0 timed after each."""
    held = []
    for n in range(1, 13):
        if os.environ.get("ALLOC"):  # a new tensor for each graph, as graph_count_probe.py does
            targets.append(torch.zeros(1024, device="cuda") if os.environ["ALLOC"] != "empty"
                           else torch.empty(1024, device="cuda"))
        if upfront:  # the tensors allocated before g0's capture, one for each graph
            targets.append(upfront[n - 1])
        if os.environ.get("NOGRAPHS"):
            torch.cuda.synchronize()
            print(f"  +{n} tensors, no graph: {per_replay_us(g0):.1f} us", flush=True)
            continue
        if os.environ.get("WARM"):  # one op on the side stream before the capture, as graph_count_probe.py
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                targets[-1].add_(1)
        before = stream_id()
        held.append(capture(method, side, small, pool))
        torch.cuda.synchronize()
        made = stream_id() - before - 1
        print(f"  +{n} graphs ({made} streams made by the capture): {per_replay_us(g0):.1f} us", flush=True)


if __name__ == "__main__":
    main()
