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
