"""Shared fixtures: captured artifacts of tiny configs on the static (CPU) backend."""

from __future__ import annotations

import pytest
import torch

from trtgraph.config import Config


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_config(**changes) -> Config:
    """The embedded default on the CPU, with nested overrides: tiny_config(kv_cache={"num_blocks": 20})."""
    d = Config.default().to_dict()
    d["device"] = "cpu"
    for section, value in changes.items():
        if isinstance(value, dict) and isinstance(d.get(section), dict):
            d[section].update(value)
        else:
            d[section] = value
    return Config.from_dict(d, source="tiny_config")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine the OpenMP
    workers of several threads make each op ~100x slower; restore the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_artifacts(tmp_path_factory):
    """The embedded default captured once (static backend): the artifacts directory."""
    from trtgraph.compiler.pipeline import capture

    out = tmp_path_factory.mktemp("default-artifacts")
    capture(tiny_config(), out)
    return out


@pytest.fixture(scope="session")
def small_kv_artifacts(tmp_path_factory):
    """A KV cache of 20 blocks (one max_seq_len sequence needs 16): forces preemption."""
    from trtgraph.compiler.pipeline import capture

    out = tmp_path_factory.mktemp("small-kv-artifacts")
    capture(tiny_config(kv_cache={"num_blocks": 20}), out)
    return out


@pytest.fixture(scope="session")
def greedy_only_artifacts(tmp_path_factory):
    from trtgraph.compiler.pipeline import capture

    out = tmp_path_factory.mktemp("greedy-artifacts")
    capture(tiny_config(buckets={"sampling": ["greedy"]}), out)
    return out


def generate_with_scheduler(engine, requests):
    """Run engine.generate to the end; return ({id: Result}, the engine's Scheduler), so tests
    can look at the block allocator and queues afterwards. The engine keeps one scheduler for
    its life: its allocator's peak is reset first, so `peak_used` is this call's."""
    engine.scheduler.allocator.peak_used = 0
    results = {r.id: r for r in engine.generate(requests)}
    return results, engine.scheduler
