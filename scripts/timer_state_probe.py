"""Probe (H200, issue 12, eighteenth session): does capture's GEMM timing (kernels/linear.py
`choose_backends`, the sixteenth session's) put the process in the slow-launch state of the twelfth
and thirteenth sessions (every kernel of every graph launching 0.2-0.45 us later)?

The seventeenth session's bench ran bs 2-64 35-44 us slower than the fifteenth's, bs 1 (PDL
launches) 7 us: the state's signature. `_graph_time_us` runs the timed work on its stream, then
records it into a new pool: a new tensor and an op on the side stream before each recording,
the one driver-recorded case of scripts/stream_probe.py that switched (WARM=1 ALLOC=1).

One process per TIMER:
- `graph`: the tree's timer (cuda_graph.graph_time_us; since this session the step's warm-up call
  runs on the current stream, the timing stream only records: call 1's `nowarm`, which ran the
  first warm-up there, measured 1.057-1.060 ms at bs 64 and left the canary at 84.9 us);
- `side`: the timer before (`side_time_us`: the step run on the timing stream before each recording);
- `sleep`: no graph: the eager calls queued behind a sleep kernel, timed between CUDA events;
- `off`: nothing timed (cuBLAS everywhere, as the 1B's record is anyway).

Prints a canary (a driver-recorded chain of 100 in-place adds, us a replay) fresh, after
Executor.build (which times the GEMMs), and recorded anew; then the bs-64 greedy step (ms a replay,
median of 5 x 20, 128 cached tokens) captured alone and after the plan's other keys.

    TIMER=graph|side|sleep|off python3 scripts/timer_state_probe.py [CONFIG.yaml]
"""

from __future__ import annotations

import os
import statistics
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trtgraph.bench import _timed, decode_rows  # noqa: E402
from trtgraph.buckets import BucketPlan, GraphKey  # noqa: E402
from trtgraph.config import Config  # noqa: E402
from trtgraph.runtime.step import cuda_graph, executor  # noqa: E402
from trtgraph.runtime.step.cuda_graph import DriverGraph  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_count_probe import per_replay_us  # noqa: E402

KEY = GraphKey(64, 0, 0, "greedy")


def canary() -> DriverGraph:
    x = torch.zeros(1024, device="cuda")
    stream = torch.cuda.Stream()
    g = DriverGraph(torch.device("cuda"), torch.cuda.graph_pool_handle(), stream)

    def chain():
        for _ in range(100):
            x.add_(1)

    g.record(chain)
    g._keep = x
    return g


def side_time_us(step, device: torch.device, repeats: int = 3) -> float:
    """The sixteenth / seventeenth sessions' timer: the step run on the timing stream before each recording."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = cuda_graph._timing_stream(index)
    stream.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream(index).wait_stream(stream)
    graph = DriverGraph(device, torch.cuda.graph_pool_handle(), stream)
    try:
        graph.record(step)
        return cuda_graph.best_replay_us(graph, repeats)
    finally:
        graph.close()


def sleep_time_us(step, device: torch.device, repeats: int = 3) -> float:
    import time

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    host = time.perf_counter() - t0  # the host's enqueue time (an upper bound: the GPU may make it wait)
    torch.cuda.synchronize()
    cycles = int(max(2 * host, 50e-6) * 2.0e9)  # ~2 GHz: twice the enqueue time of sleep ahead
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        step()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3)
    return best


def main() -> None:
    timer = os.environ.get("TIMER", "graph")
    path = sys.argv[1] if len(sys.argv) > 1 else "examples/llama-3.2-1b-synthetic.yaml"
    torch.zeros(1, device="cuda").add_(1)
    g0 = canary()
    print(f"TIMER={timer}: canary fresh {per_replay_us(g0):.1f} us", flush=True)
    if timer == "off":
        executor.linear_timer = lambda device: None
    elif timer == "side":
        executor.linear_timer = lambda device: partial(side_time_us, device=device)
    elif timer == "sleep":
        executor.linear_timer = lambda device: partial(sleep_time_us, device=device)
    cfg = Config.from_yaml(path)
    plan = BucketPlan.from_config(cfg)
    ex = executor.Executor.build(cfg, plan.with_keys([KEY] + [k for k in plan.keys if k != KEY]))
    from trtgraph.kernels.linear import installed_backends, installed_times

    print(f"  backends {installed_backends()}", flush=True)
    for shape, t in installed_times().items():
        print(f"  {shape}: {t}", flush=True)
    print(f"  canary after the build {per_replay_us(g0):.1f} us; recorded anew {per_replay_us(canary()):.1f} us",
          flush=True)

    def step_ms() -> float:
        ex.prepare(KEY, decode_rows(ex, KEY.batch_size, 128))
        with torch.inference_mode():
            return statistics.median(_timed(ex.device, lambda: ex.execute(KEY), 20) for _ in range(5)) * 1e3

    ex.warmup(KEY)
    ex.capture(KEY)
    print(f"  bs 64 captured alone: {step_ms():.4f} ms; canary {per_replay_us(g0):.1f} us", flush=True)
    for k in ex.plan.keys:
        if k != KEY:
            ex.warmup(k)
            ex.capture(k)
    print(f"  bs 64 after {len(ex.plan.keys) - 1} more keys: {step_ms():.4f} ms; canary {per_replay_us(g0):.1f} us",
          flush=True)


if __name__ == "__main__":
    main()
