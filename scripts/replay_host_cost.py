"""Host time of one DriverGraph.replay() call (a one-kernel graph, launches queued while the GPU
drains them): the bound cuGraphLaunch of replay() against the driver looked up under its lock per
call (the thirteenth session's replay). Usage: python scripts/replay_host_cost.py [N]"""

import ctypes
import statistics
import sys
import time

import torch

from trtgraph.runtime.step import cuda_graph as cg

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
dev = torch.device("cuda", 0)
pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev)
x = torch.zeros(1024, device=dev)
graph = cg.DriverGraph(dev, pool, stream)
graph.record(lambda: x.add_(1))


def locked():  # the thirteenth session's replay()
    cg._check(cg._driver().cuGraphLaunch(graph._exec, ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)),
              "cuGraphLaunch")


for name, fn in (("bound (replay)", graph.replay), ("locked lookup", locked)) * 2:
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(N):
            fn()
        times.append((time.perf_counter() - t) / N * 1e6)
        torch.cuda.synchronize()
    print(f"{name:16s} {statistics.median(times):.2f} us a call (median of 5 x {N})", flush=True)
assert x[0].item() == 20 * N, x[0].item()
print("replays counted:", int(x[0].item()))
