"""The driver-recorded CUDA graph (runtime/step/cuda_graph.py): what the runner's cuda backend
records every key with. Needs CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from trtgraph.errors import CaptureError
from trtgraph.runtime.step.cuda_graph import DriverGraph

pytestmark = pytest.mark.gpu


@pytest.fixture()
def parts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    return device, torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)


def test_a_recorded_step_replays_on_new_inputs_and_its_allocations_come_from_the_pool(parts):
    device, pool, stream = parts
    x = torch.arange(4096, dtype=torch.float32, device=device)
    w = torch.randn(64, 4096 // 64, device=device)

    def step():
        y = x.view(64, -1) * 2 + 1  # allocated inside the recording: from the pool
        return (y * w).sum(dim=1)

    graph = DriverGraph(device, pool, stream)
    out = graph.record(step)
    for scale in (1.0, -3.0, 0.5):
        x.copy_(torch.arange(4096, dtype=torch.float32, device=device) * scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), scale
    graph.close()
    graph.close()  # twice: no double release


def test_two_graphs_share_the_pool_and_replay_independently(parts):
    device, pool, stream = parts
    a = torch.zeros(1024, device=device)
    b = torch.zeros(1024, device=device)
    ga, gb = DriverGraph(device, pool, stream), DriverGraph(device, pool, stream)
    ga.record(lambda: a.add_(1))
    gb.record(lambda: b.add_(2))
    for _ in range(3):
        ga.replay()
    gb.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, torch.full_like(a, 3)) and torch.equal(b, torch.full_like(b, 2))


def test_a_step_that_synchronises_fails_the_recording_and_leaves_nothing_capturing(parts):
    device, pool, stream = parts
    x = torch.ones(16, device=device)

    def bad():
        x.add_(1)
        return x.sum().item()  # a host read: not allowed while capturing

    with pytest.raises((RuntimeError, CaptureError)):
        DriverGraph(device, pool, stream).record(bad)
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(stream):
        assert not torch.cuda.is_current_stream_capturing()
    graph = DriverGraph(device, pool, stream)  # the stream records again
    graph.record(lambda: x.mul_(2))
    before = x.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before * 2)


def test_a_step_that_launches_nothing_is_refused(parts):
    device, pool, stream = parts
    with pytest.raises(CaptureError, match="holds no work"):
        DriverGraph(device, pool, stream).record(lambda: None)


# The slow-launch state (docs/performance.md, twelfth, thirteenth and eighteenth sessions): once a process
# is in it, every kernel of every graph launches 0.2-0.45 us later (the 1B's bs-64 step +35-45 us). It is
# per process and lasting, so each check runs in a fresh one: a driver-recorded chain of 100 adds timed
# (us a replay) before and after the work under test.
_CANARY = """
import statistics, sys, torch
from trtgraph.runtime.step.cuda_graph import DriverGraph, graph_time_us
cuda = torch.device("cuda")
x = torch.zeros(1024, device=cuda)
canary = DriverGraph(cuda, torch.cuda.graph_pool_handle(), torch.cuda.Stream())
canary.record(lambda: [x.add_(1) for _ in range(100)])
def us():
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(200):
            canary.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 200)
    return statistics.median(times)
before = us()
"""

_TIMINGS = """
w = torch.randn(256, 256, device=cuda)
for m in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64):  # a new input and output each, as capture's timing
    xm = torch.randn(m, 256, device=cuda)
    graph_time_us(lambda: torch.nn.functional.linear(xm, w), cuda)
print(before, us())
"""

_CAPTURE = """
from pathlib import Path
from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
d = Config.from_yaml("examples/llama-3.2-1b-synthetic.yaml").to_dict()
d["model"]["synthetic"]["num_hidden_layers"] = 2
d["buckets"].update(context_batch_sizes=[1, 2, 4, 8], chunk_sizes=[64, 256])
d.update(limits={"max_batch_size": 64, "max_seq_len": 1024, "max_num_tokens": 4096},
         kv_cache={"block_size": 16, "num_blocks": 2048}, output=sys.argv[1])
result = capture(Config.from_dict(d, source="launch-state"), Path(sys.argv[1]))
print(before, us())
"""


def _before_after(body: str, *args: str) -> tuple[float, float]:
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = subprocess.run([sys.executable, "-c", _CANARY + body, *args], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(float, out.stdout.split()[-2:])
    return before, after


def test_the_gemm_timer_leaves_graphs_launching_as_fast():
    """Capture's GEMM timer (graph_time_us) must not slow the process's graphs down: with the timed step
    run on the timing stream before each recording, the canary replayed ~20% slower after a few timings
    (84.6 -> 102.6 us on the H200)."""
    before, after = _before_after(_TIMINGS)
    assert after < 1.08 * before, (before, after)


def test_a_whole_capture_leaves_graphs_launching_as_fast(tmp_path):
    """Everything `trtgraph capture` does in a process (the GEMM timing, warm-up, every key recorded, the
    checks and timings) leaves its graphs launching as fast as before: `bench --config` measures in the
    capturing process."""
    before, after = _before_after(_CAPTURE, str(tmp_path))
    assert after < 1.08 * before, (before, after)
