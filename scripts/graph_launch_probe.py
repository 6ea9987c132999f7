"""Does a CUDA graph launch wait on the host? `python scripts/graph_launch_probe.py`.

Host milliseconds of torch.cuda.CUDAGraph.replay() calls (each graph: 150 elementwise kernels
over 32 MB, about 2.5 ms on the device) in the situations the capture loop meets: a new graph's
first launch; the same graph launched again while its last launch is queued or running; other
graphs launched then; a recording while the device is busy; and launches behind a long queue
of small kernels (how deep a stream's queue goes before a launch blocks)."""

import time

import torch

dev = torch.device("cuda")
x = torch.zeros(8 << 20, device=dev)
stream = torch.cuda.Stream()


def body():
    y = x
    for _ in range(150):
        y = y * 1.0001 + 0.5
    return y


def record():
    g = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        g.capture_begin()
        body()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return g


def ms(fn):
    t0 = time.perf_counter()
    fn()
    return round((time.perf_counter() - t0) * 1e3, 3)


body(); torch.cuda.synchronize()
graphs = [record() for _ in range(6)]
torch.cuda.synchronize()
print("first launches (device idle):", [ms(g.replay) for g in graphs[:3]])
torch.cuda.synchronize()
print("same graph x4 back to back:", [ms(graphs[0].replay) for _ in range(4)])
torch.cuda.synchronize()
print("3 distinct graphs back to back:", [ms(g.replay) for g in graphs[:3]])
torch.cuda.synchronize()
torch.cuda._sleep(100_000_000)  # ~50 ms on the device
print("behind a 50 ms sleep: same graph x3:", [ms(graphs[1].replay) for _ in range(3)])
torch.cuda.synchronize()
torch.cuda._sleep(100_000_000)
print("behind a 50 ms sleep: distinct graphs:", [ms(g.replay) for g in graphs[3:6]])
torch.cuda.synchronize()
t = time.perf_counter(); torch.cuda._sleep(200_000_000); torch.cuda.synchronize()
print("sleep 200M cycles ms:", round((time.perf_counter() - t) * 1e3, 1))
small = torch.zeros(16, device=dev)
torch.cuda._sleep(400_000_000)  # ~200 ms
marks, t0 = [], time.perf_counter()
for i in range(1, 4097):
    small.add_(1.0)
    if i % 256 == 0:
        marks.append((i, round((time.perf_counter() - t0) * 1e3, 2)))
print("small kernels queued behind a 200 ms sleep (count, host ms):", marks)
torch.cuda.synchronize()
torch.cuda._sleep(400_000_000)
marks, t0 = [], time.perf_counter()
for i in range(1, 65):
    graphs[i % 6].replay()
    if i % 8 == 0:
        marks.append((i, round((time.perf_counter() - t0) * 1e3, 2)))
print("graph launches queued behind a 200 ms sleep (count, host ms):", marks)
torch.cuda.synchronize()
torch.cuda._sleep(400_000_000)
print("recordings behind a 200 ms sleep (host ms):", [ms(record) for _ in range(3)])
torch.cuda.synchronize()
print("recordings, device idle (host ms):", [ms(record) for _ in range(3)])
torch.cuda.synchronize()
print("raw_cuda_graph_exec:", hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"), torch.__version__)

# h/u8: what else the capture loop does while the device is behind (its host stalls of 10-50 ms
# at the timing launches and 100-200 ms in one recording, docs/performance.md, eighth session).
# 1. a new graph's first launch then at once its second, behind a 50 ms sleep: does the second
#    wait for the first's upload (queued behind the sleep)?
fresh = [record() for _ in range(3)]
torch.cuda.synchronize()
for g in fresh:
    torch.cuda._sleep(100_000_000)
    print("behind a 50 ms sleep: new graph, first then second launch:", ms(g.replay), ms(g.replay))
    torch.cuda.synchronize()
# 2. device memory the caching allocator must get from the driver (a new segment), behind a sleep
torch.cuda.empty_cache()
for mb in (64, 256, 1024):
    torch.cuda._sleep(100_000_000)
    print(f"behind a 50 ms sleep: torch.empty of {mb} MB, new segment:",
          ms(lambda: torch.empty(mb << 20, dtype=torch.uint8, device=dev)))
    torch.cuda.synchronize()
# 3. pinned host memory the host allocator must get (a new block), behind a sleep
for kb in (1, 300, 65536):
    torch.cuda._sleep(100_000_000)
    print(f"behind a 50 ms sleep: pinned torch.empty of {kb} KB, new block:",
          ms(lambda: torch.empty(kb << 10, dtype=torch.uint8, pin_memory=True)))
    torch.cuda.synchronize()
# 4. a recording whose pool must grow (a new segment in the graph pool), behind a sleep
pool = torch.cuda.graph_pool_handle()
for mb in (64, 512):
    def grow(mb=mb):
        g = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool)
            torch.empty(mb << 20, dtype=torch.uint8, device=dev).fill_(1)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        fresh.append(g)
    torch.cuda._sleep(100_000_000)
    print(f"behind a 50 ms sleep: a recording that grows its pool by {mb} MB:", ms(grow))
    torch.cuda.synchronize()
print("(a 50 ms sleep: a host figure near 50 ms means the call waited for the device)")
