"""Probe (H200, issue 12, twelfth session): does a CUDA graph replay more slowly once more graphs
exist? (scripts/replay_drift.py found the bs-64 step's launch gaps 35 us longer, its kernels
unchanged, from the fourth graph the process captured on.) Pure torch: a graph of a chain of
KERNELS tiny kernels (in-place adds on a 4 KB tensor), timed per replay (CUDA events over 200
replays, median of 5) fresh, after each further graph captured (the same chain on its own
tensor), after cudaGraphUpload of the first graph again, and after the others are destroyed.
Knobs (environment): CHAIN (the chain's kernel: `_chain_op`), ONESTREAM=1 (every capture on one
side stream; by default each graph is captured on a new stream), POOL=own (a memory pool per
graph), FLAGS=N (instantiated here by cudaGraphInstantiateWithFlags, `Instantiated`); instead of
more graphs: MALLOCS, PINNED, EVENTS or STREAMS=1 (the `after_*` functions). Thirteenth session:
EXTRA_KERNELS=N (the further graphs' chain length), DESTROY=1 (each further graph destroyed right
after its capture).

    [KNOB=...] python3 scripts/graph_count_probe.py [KERNELS] [GRAPHS]
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import sys

import torch


def _chain_op():
    """CHAIN: what the chain's kernels are: `add` (torch's in-place add, the default), `triton` (a
    Triton kernel), `pdl` (the same launched with programmatic dependent launch), `mm` (cuBLAS),
    `params` (a Triton kernel with 30 more pointer arguments), `functions` (16 distinct Triton
    kernels in turn)."""
    kind = os.environ.get("CHAIN", "add")
    if kind == "add":
        return lambda x: x.add_(1)
    if kind == "mm":
        return lambda x: torch.mm(x.view(32, 32), x.view(32, 32), out=_MM_OUT.setdefault(x.data_ptr(), torch.empty(
            (32, 32), device="cuda")))
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    @triton.jit
    def _add_many(x_ptr, n, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
                  c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, BLOCK: tl.constexpr, C: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + C, mask=i < n)

    if kind == "params":  # 30 more pointer arguments (~270 bytes of parameters a launch), one function
        return lambda x: _add_many[(1,)](x, x.numel(), *([x] * 30), BLOCK=1024, C=1)
    if kind == "functions":  # 16 distinct compiled functions, small parameters
        count = [0]

        def op(x):
            count[0] += 1
            _add_one_c[(1,)](x, x.numel(), BLOCK=1024, C=count[0] % 16)

        @triton.jit
        def _add_one_c(x_ptr, n, BLOCK: tl.constexpr, C: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + C, mask=i < n)

        return op
    pdl = kind == "pdl"
    return lambda x: _add_one[(1,)](x, x.numel(), BLOCK=1024, PDL=pdl, **({"launch_pdl": True} if pdl else {}))


_MM_OUT: dict = {}


def chain_graph(kernels: int, pool):
    flags = os.environ.get("FLAGS")
    op = _chain_op()
    x = torch.zeros(1024, device="cuda")
    g = torch.cuda.CUDAGraph(keep_graph=flags is not None)
    s = _STREAM[0] if _STREAM else torch.cuda.Stream()
    if os.environ.get("ONESTREAM") and not _STREAM:
        _STREAM.append(s)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(x)  # warm
        g.capture_begin(pool=pool)
        for _ in range(kernels):
            op(x)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if flags is not None:
        g = Instantiated(g, int(flags))
    return g, x


class Instantiated:
    """A graph torch captured (keep_graph=True) instantiated here with cudaGraphInstantiateWithFlags
    (FLAGS: 1 auto-free on launch, 2 upload, 4 device launch, 8 node priority) and launched by
    cudaGraphLaunch, both through libcudart."""

    def __init__(self, torch_graph, flags: int):
        self.rt, self.g = _cudart(), torch_graph
        self.exec = ctypes.c_void_p()
        err = self.rt.cudaGraphInstantiateWithFlags(ctypes.byref(self.exec), ctypes.c_void_p(torch_graph.raw_cuda_graph()),
                                                    ctypes.c_ulonglong(flags))
        assert err == 0, f"cudaGraphInstantiateWithFlags({flags}) -> {err}"

    def replay(self):
        self.rt.cudaGraphLaunch(self.exec, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))

    def raw_cuda_graph_exec(self):
        return self.exec.value


def _cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    raise OSError("no libcudart")


_STREAM: list = []


def per_replay_us(g) -> float:
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(200):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 200)
    return statistics.median(times)


def upload(g) -> str:
    rt = _cudart()
    err = rt.cudaGraphUpload(ctypes.c_void_p(g.raw_cuda_graph_exec()),
                             ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    return f"cudaGraphUpload -> {err}"


def next_stream_id() -> int:
    """The driver's id of a stream made now (cuStreamGetId; ids rise with every stream the process
    creates, so the difference between two calls counts the streams made in between, plus one)."""
    rt, cu = _cudart(), ctypes.CDLL("libcuda.so.1")
    st, sid = ctypes.c_void_p(), ctypes.c_ulonglong()
    assert rt.cudaStreamCreateWithFlags(ctypes.byref(st), 1) == 0
    assert cu.cuStreamGetId(st, ctypes.byref(sid)) == 0
    rt.cudaStreamDestroy(st)
    return sid.value


def after_mallocs(g0) -> None:
    """MALLOCS: device memory allocated (64 MB tensors, kept), no more graphs."""
    held = []
    for n in range(1, 9):
        held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        print(f"{n} x 64 MB allocated: {per_replay_us(g0):.1f} us "
              f"(reserved {torch.cuda.memory_reserved() >> 20} MB)", flush=True)


def after_pinned(g0) -> None:
    """PINNED: pinned host buffers (1 MB, kept), each copied to the device."""
    held, dev = [], torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    for n in range(1, 9):
        held.append(torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True))
        dev.copy_(held[-1], non_blocking=True)
        torch.cuda.synchronize()
        print(f"{n} pinned buffers: {per_replay_us(g0):.1f} us", flush=True)


def after_events(g0) -> None:
    """EVENTS: events created and recorded."""
    held = []
    for n in range(1, 9):
        held.append(torch.cuda.Event())
        held[-1].record()
        torch.cuda.synchronize()
        print(f"{n} events: {per_replay_us(g0):.1f} us", flush=True)


def after_streams(g0) -> None:
    """STREAMS: streams created (each running one kernel), no more graphs; then the graph replayed on
    a new stream, on the first of them and on a high-priority one."""
    streams = []
    for n in range(1, 9):
        streams.append(torch.cuda.Stream())
        with torch.cuda.stream(streams[-1]):
            torch.zeros(8, device="cuda").add_(1)
        torch.cuda.synchronize()
        print(f"{n} more streams: {per_replay_us(g0):.1f} us", flush=True)
    for label, st in (("a new stream", torch.cuda.Stream()), ("the first of them", streams[0]),
                      ("a high-priority stream", torch.cuda.Stream(priority=-1))):
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            print(f"replayed on {label}: {per_replay_us(g0):.1f} us", flush=True)
        torch.cuda.current_stream().wait_stream(st)


def after_graphs(g0, kernels: int, graphs: int, pool, shared: bool) -> None:
    """The default: more graphs captured (the same chain), then cudaGraphUpload of the first, the last
    one's own time, and the others destroyed."""
    others, last_id = [], next_stream_id()
    extra = int(os.environ.get("EXTRA_KERNELS", kernels))
    for n in range(2, graphs + 1):
        others.append(chain_graph(extra, pool if shared else torch.cuda.graph_pool_handle()))
        if os.environ.get("DESTROY"):
            others.pop()
            gc.collect()
        sid = next_stream_id()
        print(f"{n} graphs: {per_replay_us(g0):.1f} us (streams made meanwhile: {sid - last_id - 1})", flush=True)
        last_id = next_stream_id()
    print(upload(g0), f"-> {per_replay_us(g0):.1f} us", flush=True)
    last = others[-1][0]
    print(f"the last graph captured: {per_replay_us(last):.1f} us", flush=True)
    others.clear()
    del last
    gc.collect()
    torch.cuda.synchronize()
    print(f"the others destroyed: {per_replay_us(g0):.1f} us", flush=True)


def main() -> None:
    kernels = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    graphs = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    shared = os.environ.get("POOL", "shared") == "shared"
    pool = torch.cuda.graph_pool_handle() if shared else None
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '(unset)')}, "
          f"pool {'shared' if shared else 'per graph'}, FLAGS={os.environ.get('FLAGS', '(torch instantiates)')}, "
          f"CHAIN={os.environ.get('CHAIN', 'add')}, ONESTREAM={os.environ.get('ONESTREAM', '')}", flush=True)
    g0, _ = chain_graph(kernels, pool)
    print(f"{kernels} kernels a graph; 1 graph: {per_replay_us(g0):.1f} us a replay", flush=True)
    for name, fn in (("MALLOCS", after_mallocs), ("PINNED", after_pinned), ("EVENTS", after_events),
                     ("STREAMS", after_streams)):
        if os.environ.get(name):
            return fn(g0)
    after_graphs(g0, kernels, graphs, pool, shared)


if __name__ == "__main__":
    main()
