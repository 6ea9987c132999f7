"""Do cuBLAS's kernels wait for their producer when the graph edge in front of them is made
programmatic? And what does such an edge save? (A probe for issue 12's bs-64 step, where 48 of the
100 kernels are cuBLAS's, which torch cannot launch with programmatic dependent launch.)

A recorded graph's edge Triton kernel -> cuBLAS kernel is replaced (driver API, by ctypes) with a
programmatic one (CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC from the kernel's programmatic port): the
cuBLAS kernel may then launch once every program of the Triton kernel has called
griddepcontrol.launch_dependents, and only a cuBLAS kernel that executes griddepcontrol.wait reads
the producer's output safely.

1. Correctness: a Triton kernel triggers its dependents at its start, spins SPIN iterations, then
   writes X = v (v changes before every replay); cuBLAS computes Y = X @ W.T. Y is checked against
   v * W.sum(1) at every replay. Controls: the same edge kept plain (must always match), and a
   Triton consumer without griddepcontrol.wait behind a programmatic edge (should show stale reads:
   the test can see a race), and one with it (must match).
2. Time: 16 x (a Triton row kernel -> cuBLAS 64 x 2048 x 2048 on distinct weights), the Triton ->
   cuBLAS edges plain vs programmatic (the row kernel triggering at its end, or at its start: safe
   where the dependent waits, as part 1 shows cuBLAS's does), us a replay, median of 5 x 200
   replays, interleaved.
Usage: python scripts/pdl_edge_probe.py [--spin N] [--replays N]   (CUDA, compute capability 9.0+)
"""

import argparse
import ctypes
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ap = argparse.ArgumentParser()
ap.add_argument("--spin", type=int, default=20000)
ap.add_argument("--replays", type=int, default=50)
args = ap.parse_args()

lib = ctypes.CDLL("libcuda.so.1")
P = ctypes.c_void_p


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", P), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("params", P), ("extra", P), ("kern", P), ("ctx", P)]


def fn(name, *argtypes):
    for n in (name + "_v2", name):
        f = getattr(lib, n, None)
        if f is not None:
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f
    raise SystemExit(f"libcuda has no {name}")


begin = fn("cuStreamBeginCapture", P, ctypes.c_int)
end = lib.cuStreamEndCapture
end.argtypes, end.restype = [P, ctypes.POINTER(P)], ctypes.c_int
get_edges = fn("cuGraphGetEdges", P, P, P, P, ctypes.POINTER(ctypes.c_size_t))
remove = fn("cuGraphRemoveDependencies", P, P, P, P, ctypes.c_size_t)
add = fn("cuGraphAddDependencies", P, P, P, P, ctypes.c_size_t)
node_type = lib.cuGraphNodeGetType
node_type.argtypes, node_type.restype = [P, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
kparams = fn("cuGraphKernelNodeGetParams", P, ctypes.POINTER(KernelParams))
func_name = lib.cuFuncGetName
func_name.argtypes, func_name.restype = [ctypes.POINTER(ctypes.c_char_p), P], ctypes.c_int
kern_name = getattr(lib, "cuKernelGetName", None)
if kern_name is not None:
    kern_name.argtypes, kern_name.restype = [ctypes.POINTER(ctypes.c_char_p), P], ctypes.c_int
inst = lib.cuGraphInstantiateWithFlags
inst.argtypes, inst.restype = [ctypes.POINTER(P), P, ctypes.c_ulonglong], ctypes.c_int
launch = lib.cuGraphLaunch
launch.argtypes, launch.restype = [P, P], ctypes.c_int


def ok(rc, what):
    if rc:
        raise RuntimeError(f"{what}: CUresult {rc}")


def name_of(node):
    t = ctypes.c_int()
    ok(node_type(node, ctypes.byref(t)), "cuGraphNodeGetType")
    if t.value != 0:
        return None
    kp = KernelParams()
    ok(kparams(node, ctypes.byref(kp)), "cuGraphKernelNodeGetParams")
    out = ctypes.c_char_p()
    if kp.func and func_name(ctypes.byref(out), kp.func) == 0:
        return out.value.decode()
    if kp.kern and kern_name is not None and kern_name(ctypes.byref(out), kp.kern) == 0:
        return out.value.decode()
    return "?"


def record(step, stream, programmatic=lambda src, dst: False):
    """Capture step() on stream; make each kernel -> kernel edge that `programmatic(src, dst)` names
    programmatic; instantiate. Returns (exec, number of edges changed, kernel names)."""
    graph = P()
    with torch.cuda.stream(stream):
        ok(begin(P(stream.cuda_stream), 0), "begin")
        step()
        ok(end(P(stream.cuda_stream), ctypes.byref(graph)), "end")
    n = ctypes.c_size_t()
    ok(get_edges(graph, None, None, None, ctypes.byref(n)), "edges")
    frm, to, data = (P * n.value)(), (P * n.value)(), (EdgeData * n.value)()
    ok(get_edges(graph, frm, to, data, ctypes.byref(n)), "edges")
    changed, names = 0, set()
    for i in range(n.value):
        a, b = name_of(P(frm[i])), name_of(P(to[i]))
        names.update(x for x in (a, b) if x)
        if a and b and programmatic(a, b):
            ok(remove(graph, ctypes.byref(P(frm[i])), ctypes.byref(P(to[i])), ctypes.byref(data[i]), 1), "remove")
            e = EdgeData(from_port=1, to_port=0, type=1)
            ok(add(graph, ctypes.byref(P(frm[i])), ctypes.byref(P(to[i])), ctypes.byref(e), 1), "add programmatic")
            changed += 1
    ex = P()
    ok(inst(ctypes.byref(ex), graph, 0), "instantiate")
    return ex, changed, names


@triton.jit
def late_writer(X, V, spin, N: tl.constexpr, BLOCK: tl.constexpr):
    gdc_launch_dependents()  # dependents may launch now; only their griddepcontrol.wait protects them
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32) + tl.load(V)
    for _ in range(spin):
        acc = acc * 1.0000001 + 1e-30
    v = tl.load(V)
    tl.store(X + offs, tl.where(acc > 1e30, acc, v).to(X.dtype.element_ty), mask=offs < N)


@triton.jit
def consumer(X, Y, N: tl.constexpr, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    if WAIT:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)


@triton.jit
def row_op(X, Y, N: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER == 2:  # at the start (safe only where every dependent waits: cuBLAS's did, part 1)
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * 0.5 + 0.25, mask=offs < N)
    if TRIGGER == 1:
        gdc_launch_dependents()


dev = torch.device("cuda")
stream = torch.cuda.Stream()
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
M, K, N = 64, 2048, 2048
X = torch.zeros(M, K, device=dev, dtype=torch.bfloat16)
V = torch.zeros(1, device=dev, dtype=torch.float32)
W = (torch.randint(-2, 3, (N, K), device=dev)).to(torch.bfloat16)  # small integers: exact sums in fp32
Y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
Yt = torch.empty(M, K, device=dev, dtype=torch.bfloat16)
rowsum = W.float().sum(1)
BLOCK = 1024
grid = (triton.cdiv(M * K, BLOCK),)


def step_cublas():
    late_writer[grid](X, V, args.spin, M * K, BLOCK)
    torch.mm(X, W.t(), out=Y)


def step_triton(wait):
    def step():
        late_writer[grid](X, V, args.spin, M * K, BLOCK)
        consumer[grid](X, Yt, M * K, BLOCK, WAIT=wait, launch_pdl=True)
    return step


def check(ex, expect, out, label, changed):
    bad = 0
    for r in range(args.replays):
        v = float((r % 7) + 1)
        V.fill_(v)
        ok(launch(ex, P(torch.cuda.current_stream().cuda_stream)), "launch")
        torch.cuda.synchronize()
        bad += not torch.equal(out.float(), expect(v))
        X.zero_()
    print(f"{label}: {changed} edge(s) programmatic, {bad}/{args.replays} replays read a stale X", flush=True)


with torch.cuda.stream(stream):  # compile; cuBLAS's workspace for the capture stream made before capturing
    step_cublas(), step_triton(True)(), step_triton(False)()
torch.cuda.synchronize()
exp_mm = lambda v: (v * rowsum).to(torch.bfloat16).float().expand(M, N)
exp_tr = lambda v: torch.full((M, K), 2 * v, device=dev)
is_writer = lambda a, b: "late_writer" in a
ex, c, names = record(step_cublas, stream)
print("kernels:", sorted(names))
check(ex, exp_mm, Y, "plain edge -> cuBLAS", c)
ex, c, _ = record(step_cublas, stream, is_writer)
check(ex, exp_mm, Y, "programmatic edge -> cuBLAS", c)
ex, c, _ = record(step_triton(False), stream, is_writer)
check(ex, exp_tr, Yt, "control: programmatic edge -> Triton without griddepcontrol.wait", c)
ex, c, _ = record(step_triton(True), stream, is_writer)
check(ex, exp_tr, Yt, "control: programmatic edge -> Triton with griddepcontrol.wait", c)

# 2. time: 16 x (row op -> cuBLAS GEMM), weights distinct (32 MB each way past L2? 16 x 8.4 MB = 134 MB)
Ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 45 for _ in range(16)]
A = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
B = torch.empty_like(A)


def chain(trigger):
    def step():
        for w in Ws:
            row_op[grid](A, B, M * K, BLOCK, TRIGGER=trigger)
            torch.mm(B, w.t(), out=A)
    return step


with torch.cuda.stream(stream):
    chain(1)(), chain(0)(), chain(2)()
torch.cuda.synchronize()
row_to_gemm = lambda a, b: "row_op" in a and "row_op" not in b
execs = {"plain": record(chain(0), stream)[0], "programmatic": record(chain(1), stream, row_to_gemm)[0],
         "triggers, plain edges": record(chain(1), stream)[0],
         "programmatic, the row op triggering at its start": record(chain(2), stream, row_to_gemm)[0]}
times = {k: [] for k in execs}
s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for rep in range(5):
    for k, ex in execs.items():
        for _ in range(20):
            launch(ex, P(torch.cuda.current_stream().cuda_stream))
        s0.record()
        for _ in range(200):
            launch(ex, P(torch.cuda.current_stream().cuda_stream))
        s1.record()
        torch.cuda.synchronize()
        times[k].append(1e3 * s0.elapsed_time(s1) / 200)
for k, ts in times.items():
    print(f"chain of 16 x (row op -> cuBLAS {M}x{K}x{N}), {k}: {statistics.median(ts):.2f} us a replay "
          f"({min(ts):.2f}-{max(ts):.2f})", flush=True)
