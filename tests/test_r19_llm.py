"""The nineteenth session's pass over the Python API's lifecycle (LLM.close, `with`, calls
after close, an LLM dropped without close) and the engine's Ctrl-C windows (an interrupt at
any point where the interpreter can raise one). Each test failed on the code before its fix."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import trtgraph
from trtgraph.errors import TrtgraphError
from trtgraph.runtime.serving.engine import EngineClosedError

REQS = [{"id": f"q{i}", "prompt_token_ids": [(7 * i + 3 * j) % 300 for j in range(5 + 9 * i)], "max_tokens": 9 + i,
         **({"temperature": 0.9, "seed": 40 + i} if i % 2 else {})} for i in range(4)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def alone(default_artifacts, one_torch_thread):
    """Each request of REQS served by itself: its tokens."""
    with trtgraph.LLM(default_artifacts) as llm:
        return {r["id"]: llm.generate([r])[0].token_ids for r in REQS}


def _held(llm) -> list[weakref.ref]:
    """Weak references to what an LLM holds: a weight, a KV cache, the step buffers, a graph's
    recorded outputs, the graph runner."""
    ex = llm.engine.executor
    recorded = next(iter(ex.runner._graphs.values()))
    return [weakref.ref(t) for t in (next(ex.model.parameters()), ex.kv_caches[0], ex.buffers.raw,
                                     ex.buffers.next_tokens, recorded.outputs[1])] + [weakref.ref(recorded)]


# ---- close / with -------------------------------------------------------------------
def test_close_lets_go_of_weights_cache_buffers_and_graphs_without_the_collector(default_artifacts, alone):
    """LLM had no close(): every LLM built kept its graphs, pool, KV cache and weights until the
    process ended (on CUDA, out of memory by the third). close() drops them at once: no
    reference is left (with the cyclic collector off, nothing waits for it), twice is fine."""
    llm = trtgraph.LLM(default_artifacts)
    assert [c.token_ids for c in llm.generate(REQS)] == [alone[r["id"]] for r in REQS]
    held = _held(llm)
    enabled = gc.isenabled()
    gc.disable()
    try:
        llm.close()
        assert [r() is None for r in held] == [True] * len(held)
    finally:
        if enabled:
            gc.enable()
    llm.close()
    assert llm.closed and llm.engine.executor.closed and llm.engine.executor.runner.closed
    assert llm.stats["requests"] == len(REQS)  # the last run's summary stays readable


def test_a_with_block_closes_the_llm_also_when_it_raises(default_artifacts, alone):
    with trtgraph.LLM(default_artifacts) as llm:
        assert llm.generate(REQS[0])[0].token_ids == alone["q0"]
        held = _held(llm)
    assert llm.closed and all(r() is None for r in held)
    with pytest.raises(ZeroDivisionError):
        with trtgraph.LLM(default_artifacts) as llm:
            held = _held(llm)
            stream = llm.stream(REQS[1])
            next(stream)
            1 / 0
    assert llm.closed and all(r() is None for r in held)
    assert list(stream) == []  # the stream left open ends cleanly


def test_every_call_after_close_is_refused_naming_close(default_artifacts):
    """Not an AttributeError or a crash deep in the engine: EngineClosedError (a TrtgraphError
    and a ValueError, as I/O on a closed file) that says the LLM was closed."""
    llm = trtgraph.LLM(default_artifacts)
    unstarted = llm.stream("not started yet")
    llm.close()
    engine = llm.engine
    calls = {"generate": lambda: llm.generate("hello"), "stream": lambda: llm.stream("hello"),
             "chat": lambda: llm.chat([{"role": "user", "content": "hi"}]),
             "with": lambda: llm.__enter__(), "a stream made before close": lambda: next(unstarted),
             "Engine.submit": lambda: engine.submit([{"prompt": "x"}]),
             "Engine.add_request": lambda: engine.add_request({"id": "x", "prompt": "x"}),
             "Engine.step": engine.step, "Engine.generate": lambda: list(engine.generate([{"prompt": "x"}])),
             "Engine.start_run": engine.start_run, "Engine.follow": engine.follow}
    for name, call in calls.items():
        with pytest.raises(EngineClosedError, match=r"closed \(LLM\.close\(\)") as err:
            call()
        assert isinstance(err.value, TrtgraphError) and isinstance(err.value, ValueError), name
    assert engine.abort("x") is False and not engine.has_unfinished()
    engine.abort_unfinished(["x"], set(), {"x": None})  # (a consumer's clean-up after close: nothing to do)
    llm.close()


def test_close_while_streams_and_generates_run_on_other_threads(default_artifacts, alone, monkeypatch):
    """close() on one thread while a stream and a generate are being served on others: the
    stream ends where it was (each delta it gave exact), the generate raises EngineClosedError,
    neither hangs nor crashes, and the engine is empty."""
    llm = trtgraph.LLM(default_artifacts)
    engine, started, steps = llm.engine, threading.Event(), []
    step = engine.step

    def counted():
        steps.append(1)
        if len(steps) == 3:
            started.set()
        return step()
    monkeypatch.setattr(engine, "step", counted)
    monkeypatch.setattr(engine, "_lock", _Yielding(engine._lock, started))
    long = [dict(r, id=f"long-{r['id']}", max_tokens=200, ignore_eos=True) for r in REQS]
    got, errors = {}, []

    def read_stream():
        try:
            for d in llm.stream(long[:2]):
                got.setdefault(d.id, []).extend(d.token_ids)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def run_generate():
        try:
            llm.generate(long[2:])
        except BaseException as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=read_stream), threading.Thread(target=run_generate)]
    for t in threads:
        t.start()
    assert started.wait(60)
    llm.close()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert [type(e) for e in errors] == [EngineClosedError], errors
    assert got and all(len(toks) < 200 for toks in got.values())
    with trtgraph.LLM(default_artifacts) as again:  # what the stream gave: the start of each request's tokens
        want = {c.id: c.token_ids for c in again.generate(long[:2])}
    assert all(toks == want[rid][:len(toks)] for rid, toks in got.items())
    assert not engine.has_unfinished() and engine.executor.closed


class _Yielding:
    """The engine's lock, with a pause after each release once `started` (a lock is not fair:
    the stepping threads would take it again and again before the closing one gets it)."""

    def __init__(self, lock, started):
        self.lock, self.started = lock, started

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        if self.started.is_set():
            time.sleep(0.005)


_DROPPED = """
import sys, torch, trtgraph
torch.set_num_threads(1)
kept = trtgraph.LLM(sys.argv[1])
stream = kept.stream([{"prompt": "left open", "max_tokens": 20}])
next(stream)
gen = kept.engine.generate([{"id": "g", "prompt": "also open", "max_tokens": 20}])
next(gen)
closed = trtgraph.LLM(sys.argv[1])
closed.generate("x")
closed.close()
cycle = [trtgraph.LLM(sys.argv[1])]
cycle.append(cycle)
print("done")
"""


def test_an_llm_dropped_without_close_ends_the_interpreter_quietly(default_artifacts):
    """Finalizers at interpreter exit (an LLM never closed, its stream and an Engine.generate
    left half-read, one in a reference cycle, one closed): nothing raises or is reported."""
    proc = subprocess.run([sys.executable, "-c", _DROPPED, str(default_artifacts)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


# ---- CUDA: close gives the device memory back -----------------------------------------
@pytest.fixture(scope="module")
def cuda_artifacts(tmp_path_factory):
    from conftest import tiny_config
    from trtgraph.compiler.pipeline import capture

    out = tmp_path_factory.mktemp("cuda-artifacts")
    capture(tiny_config(device="cuda"), out)
    return out


@pytest.mark.gpu
def test_close_gives_the_device_memory_back_on_cuda(cuda_artifacts):
    """Built from a small CUDA capture, generated, closed: torch's allocated and (after
    empty_cache) reserved memory return to within a few MiB of where they were before the LLM
    was built, twice in a row (the second build reuses nothing the first one left). The graph
    runner's cuBLAS workspace (made inside its first recording, in its pool, and kept by torch
    for good) held 34 MB and the pool's segment after close."""
    from trtgraph.runtime.step.cuda_graph import release_workspaces

    gc.collect()
    torch.cuda.synchronize()
    release_workspaces()  # (the capture's own streams' cuBLAS workspaces, which torch keeps: close frees them too)
    torch.cuda.empty_cache()
    device = torch.device("cuda", torch.cuda.current_device())
    start = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    slack = 4 << 20
    for round_ in range(2):
        llm = trtgraph.LLM(cuda_artifacts)
        built = torch.cuda.memory_allocated(device)
        assert built > start[0] + (1 << 20), "the LLM holds nothing on the device?"
        out = llm.generate([dict(r, id=f"{r['id']}-{round_}") for r in REQS])
        assert all(c.finish_reason in ("stop", "length") for c in out)
        llm.close()
        torch.cuda.empty_cache()
        now = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        assert now[0] <= start[0] + slack, (round_, start, now, built)
        assert now[1] <= start[1] + slack, (round_, start, now, built)


@pytest.mark.gpu
def test_closing_one_llm_leaves_another_live_one_exact_on_cuda(cuda_artifacts):
    """close() frees every cuBLAS workspace torch keeps (release_workspaces): a live LLM's
    graphs recorded over their own, in their own pool, which takes no allocation after the lock,
    so scribbling over all the memory the closed one gave back changes none of its tokens."""
    reqs = [dict(r, max_tokens=24) for r in REQS]
    first, second = trtgraph.LLM(cuda_artifacts), trtgraph.LLM(cuda_artifacts)
    want = [c.token_ids for c in second.generate(reqs)]
    assert [c.token_ids for c in first.generate(reqs)] == want
    first.close()
    torch.cuda.empty_cache()
    junk = [torch.full(((64 << 20) // 4,), float("nan"), device="cuda") for _ in range(4)]
    for _ in range(2):
        assert [c.token_ids for c in second.generate(reqs)] == want
    del junk
    second.close()
