"""Probe (H200, issue 12, twelfth session): why the first variant of a decode_ablation.py call
times 35-45 us under the same step's later runs. One bs-64 greedy graph of the example config,
timed as decode_ablation.py times it (median of 5 x 20 replays, CUDA events; the host's time per
replay beside it, the wait included) with the SM clock, power and temperature from NVML, fresh,
again, after one eager step under torch.profiler (CUPTI), then per DRIFT:

- 1 (default): after capturing the rest of the plan's keys, after 15 s of back-to-back replays
  (heat, power), after 10 s idle;
- 2: after capturing the rest, the bs-64 key captured again (last), one replay of every other
  decode key, the other graphs dropped, the allocator's cache emptied;
- 3: after capturing the decode greedy, the decode sampled, the prefill keys; the graph's kernels
  (torch.profiler over 5 replays) before and after;
- 4 / 6: one more decode key captured at a time (bs 40, 32, 8, 2, 1 / 40, 48, 56, 32, 24, 16, 8);
- 5: an eager bs-1 step, then its capture;
- 7: the bs-64 key itself captured again, five times; 8: the same, counting the streams the
  process makes meanwhile (the driver's stream ids).

scripts/graph_count_probe.py takes the finding (the fourth capture) to plain torch graphs.
Thirteenth session: the runtime records through the driver (runtime/step/cuda_graph.py);
TORCH_CAPTURE=1 records through torch.cuda.CUDAGraph as the runtime did before, for comparison.

    [DRIFT=N] python3 scripts/replay_drift.py [CONFIG.yaml]
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trtgraph.bench import _timed, decode_rows  # noqa: E402
from trtgraph.buckets import BucketPlan, GraphKey  # noqa: E402
from trtgraph.config import Config  # noqa: E402
from trtgraph.runtime.step.executor import Executor  # noqa: E402

KEY = GraphKey(int(os.environ.get("BS", 64)), 0, 0, "greedy")  # BS=N: another batch size (thirteenth session)


def nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return lambda: (f"sm {pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)} MHz, "
                        f"mem {pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)} MHz, "
                        f"{pynvml.nvmlDeviceGetPowerUsage(h) / 1000:.0f} W, "
                        f"{pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)} C")
    except Exception as e:  # noqa: BLE001 (a probe: say why and go on)
        return lambda: f"(no NVML: {type(e).__name__})"


class Probe:
    def __init__(self, config_path: str):
        cfg = Config.from_yaml(config_path)
        plan = BucketPlan.from_config(cfg)
        self.ex = Executor.build(cfg, plan.with_keys([KEY] + [k for k in plan.keys if k != KEY]))
        self.others = [k for k in self.ex.plan.keys if k != KEY]
        self.read = nvml()
        self.capture(KEY)

    def capture(self, key, warm: bool = True) -> None:
        self.ex.runner._graphs.pop(key, None)
        if warm:
            self.ex.warmup(key)
        self.ex.capture(key)

    def timing(self, label: str) -> None:
        ex, host = self.ex, []
        ex.prepare(KEY, decode_rows(ex, KEY.batch_size, 128))

        def twenty():
            t0 = time.perf_counter()
            out = _timed(ex.device, lambda: ex.execute(KEY), 20)
            host.append((time.perf_counter() - t0) / 20)
            return out

        with torch.inference_mode():
            ms = statistics.median(twenty() for _ in range(5)) * 1e3
        print(f"{label:48s} {ms:.4f} ms (host {statistics.median(host) * 1e3:.3f} ms a replay incl. the wait)  "
              f"{self.read()}", flush=True)

    def kernel_times(self) -> dict:
        """us per kernel name over one replay of the bs-64 graph (torch.profiler's CUDA activity)."""
        from torch.profiler import ProfilerActivity, profile

        self.ex.prepare(KEY, decode_rows(self.ex, KEY.batch_size, 128))
        with torch.inference_mode():
            self.ex.execute(KEY)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    self.ex.execute(KEY)
                torch.cuda.synchronize()
        return {e.key: e.device_time_total / 5 for e in prof.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA}

    def capture_others(self, pick=lambda k: True) -> None:
        for k in self.others:
            if pick(k) and k not in self.ex.runner._graphs:
                self.capture(k)


def drift1(p: Probe) -> None:
    p.capture_others()
    p.timing(f"after capturing {len(p.others)} more keys")
    end = time.time() + 15
    with torch.inference_mode():
        while time.time() < end:
            for _ in range(50):
                p.ex.execute(KEY)
            torch.cuda.synchronize()
    p.timing("after 15 s of replays")
    time.sleep(10)
    p.timing("after 10 s idle")
    p.timing("again")


def drift2(p: Probe) -> None:
    p.capture_others()
    p.timing(f"after capturing {len(p.others)} more keys")
    p.capture(KEY, warm=False)
    p.timing("bs 64 captured again, last")
    with torch.inference_mode():
        for k in p.others:
            if not k.is_prefill:
                p.ex.prepare(k, [])
                p.ex.execute(k)
    torch.cuda.synchronize()
    p.timing("after one replay of every other decode key")
    for k in p.others:
        p.ex.runner._graphs.pop(k)
    gc.collect()  # (the runner's _graphs_alive still holds the CUDAGraph objects)
    torch.cuda.synchronize()
    p.timing("the other graphs dropped")
    torch.cuda.empty_cache()
    p.timing("and the cache emptied")


def drift3(p: Probe) -> None:
    before = p.kernel_times()
    for label, pick in (("decode greedy", lambda k: not k.is_prefill and k.sampling == "greedy"),
                        ("decode sampled", lambda k: not k.is_prefill and k.sampling != "greedy"),
                        ("prefill", lambda k: k.is_prefill)):
        p.capture_others(pick)
        p.timing(f"after capturing the {label} keys")
    after = p.kernel_times()
    for name in sorted(set(before) | set(after), key=lambda n: -after.get(n, 0)):
        print(f"  {before.get(name, 0):8.1f} -> {after.get(name, 0):8.1f} us  {name[:90]}")
    print(f"  {sum(before.values()):8.1f} -> {sum(after.values()):8.1f} us  all kernels of one replay")


def one_at_a_time(batches):
    def run(p: Probe) -> None:
        for b in batches:
            k = GraphKey(b, 0, 0, "greedy")
            if k in p.ex.metadata:
                p.capture(k)
                p.timing(f"after capturing {k}")
    return run


def drift5(p: Probe) -> None:
    k = GraphKey(1, 0, 0, "greedy")
    p.ex.warmup(k)
    p.timing("after an eager bs-1 step")
    p.ex.capture(k)
    p.timing("after capturing bs 1")


def drift7(p: Probe) -> None:
    for n in range(2, 7):
        p.capture(KEY, warm=False)
        p.timing(f"bs {KEY.batch_size} captured {n} times")


def drift8(p: Probe) -> None:
    """DRIFT 7 with the streams the process makes counted (graph_count_probe.next_stream_id)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from graph_count_probe import next_stream_id

    last = next_stream_id()
    for n in range(2, 7):
        p.capture(KEY, warm=False)
        sid = next_stream_id()
        p.timing(f"bs 64 captured {n} times ({sid - last - 1} streams made)")
        last = next_stream_id()


MODES = {"8": drift8, "1": drift1, "2": drift2, "3": drift3, "4": one_at_a_time((40, 32, 8, 2, 1)), "5": drift5,
         "6": one_at_a_time((40, 48, 56, 32, 24, 16, 8)), "7": drift7}


def _torch_capture(self, step):
    """GraphRunner._capture_cuda before the thirteenth session: torch.cuda.CUDAGraph."""
    before = torch.cuda.memory_reserved(self.device)
    graph = torch.cuda.CUDAGraph()
    self._stream.wait_stream(torch.cuda.current_stream(self.device))
    with torch.cuda.stream(self._stream):
        graph.capture_begin(pool=self.pool)
        try:
            outputs = step()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(self.device).wait_stream(self._stream)
    self._graphs_alive.append(graph)
    return outputs, torch.cuda.memory_reserved(self.device) - before, graph.replay


def main() -> None:
    if os.environ.get("TORCH_CAPTURE"):
        from trtgraph.runtime.step.graph_runner import GraphRunner

        GraphRunner._capture_cuda = _torch_capture
    print(f"recorded by {'torch.cuda.CUDAGraph' if os.environ.get('TORCH_CAPTURE') else 'the driver (DriverGraph)'}")
    p = Probe(sys.argv[1] if len(sys.argv) > 1 else "examples/llama-3.2-1b-synthetic.yaml")
    p.timing("fresh")
    p.timing("again")
    from torch.profiler import ProfilerActivity, profile
    p.ex.prepare(KEY, decode_rows(p.ex, KEY.batch_size, 128))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]):
        p.ex.execute(KEY, eager=True)
        torch.cuda.synchronize()
    p.timing("after one profiled eager step")
    p.timing("again")
    MODES[os.environ.get("DRIFT", "1")](p)


if __name__ == "__main__":
    main()
