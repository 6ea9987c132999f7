"""The nineteenth session's pass over the Python API's lifecycle (LLM.close, `with`, calls
after close, an LLM dropped without close) and the engine's Ctrl-C windows (an interrupt at
any point where the interpreter can raise one). Each test failed on the code before its fix."""

from __future__ import annotations

import dis
import gc
import inspect
import os
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

    def counted(*args, **kwargs):
        steps.append(1)
        if len(steps) >= 3 and got:  # (the stream has its first delta: on a loaded machine 3 steps may not give it one)
            started.set()
        return step(*args, **kwargs)
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
    assert not engine.has_unfinished() and engine.executor.closed and gc.isenabled()  # (the collector was held)


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


def test_a_start_that_fails_after_building_gives_back_what_it_built(default_artifacts, monkeypatch):
    """An LLM whose start failed after its graphs were recorded (the pool check, a tokenizer
    that does not load, Ctrl-C) kept them, its KV cache and weights until collected; on CUDA
    its pool and cuBLAS workspace for good."""
    from trtgraph.errors import ManifestError
    from trtgraph.runtime.serving import engine as engine_module
    from trtgraph.runtime.step.executor import Executor

    built, record, build = [], engine_module.record, Executor.build

    def keep(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    def record_then_fail(*args, **kwargs):
        record(*args, **kwargs)
        held.extend(weakref.ref(t) for t in (built[0].kv_caches[0], next(built[0].model.parameters())))
        raise ManifestError("re-recorded graphs took more pool than the manifest says")
    held: list = []
    monkeypatch.setattr(Executor, "build", keep)
    monkeypatch.setattr(engine_module, "record", record_then_fail)
    with pytest.raises(ManifestError, match="pool"):
        trtgraph.LLM(default_artifacts)
    ex = built.pop()
    assert ex.closed and ex.runner.closed and not ex.runner._graphs and [r() for r in held] == [None, None]


def test_weights_moved_since_capture_are_refused_for_a_batch_too(default_artifacts):
    """The check of the weights' addresses ran at the first admission of a run only where no
    other submitted request waited: a batch of two was served from a reloaded weight's freed
    memory (test_footguns checks one request)."""
    from trtgraph.errors import ReplayMismatchError

    with trtgraph.LLM(default_artifacts) as llm:
        embed = llm.engine.executor.model.embed_tokens
        old = embed.weight
        embed.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
        for call in (lambda: llm.generate(["one", "two"], {"max_tokens": 2}),
                     lambda: list(llm.engine.generate([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}]))):
            with pytest.raises(ReplayMismatchError, match="weights moved since capture: weight.embed_tokens.weight"):
                call()
            assert not llm.engine.has_unfinished()
        embed.weight = old
        assert len(llm.generate(["one", "two"], {"max_tokens": 2})) == 2


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
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
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
    was built, twice in a row (the second build reuses nothing the first one left); an LLM dropped
    without close gives its memory back once collected and the next LLM starts. The graph
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
    for round_, how in enumerate(("close", "close", "drop", "close")):  # (dropped: given back at the next start)
        llm = trtgraph.LLM(cuda_artifacts)
        built = torch.cuda.memory_allocated(device)
        assert built > start[0] + (1 << 20), "the LLM holds nothing on the device?"
        out = llm.generate([dict(r, id=f"{r['id']}-{round_}") for r in REQS])
        assert all(c.finish_reason in ("stop", "length") for c in out)
        if how == "drop":
            del llm, out
            gc.collect()
            continue
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



@pytest.mark.gpu
def test_llms_dropped_without_close_on_cuda_end_the_interpreter_quietly(cuda_artifacts):
    """On CUDA too (driver graphs, the runners' own streams, a stream left half-read)."""
    proc = subprocess.run([sys.executable, "-c", _DROPPED, str(cuda_artifacts)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr

# ---- Ctrl-C anywhere: the interpreter's check points ---------------------------------
def _check_points(code) -> frozenset[int]:
    """The offsets in `code` where CPython (3.11+) acts on a pending signal, so where a Ctrl-C's
    KeyboardInterrupt can be raised: the instruction after each call (it checks as the call
    returns) and each backward jump. Between two stores with no call between, never."""
    ins = list(dis.get_instructions(code))
    return frozenset(cur.offset for prev, cur in zip(ins, ins[1:])
                     if prev.opname.startswith("CALL") or cur.opname.startswith("JUMP_BACKWARD"))


class _CtrlC:
    """Raises KeyboardInterrupt at the `at`-th check point (1-based) of the first call of
    `root` for which `when(frame)` holds: its own check points, those of `nested` functions it
    calls (however deep), the entry of any other Python function either calls (where a callee
    would check first), and the caller's check as the root returns. `at=None` counts them (`self.seen`) and raises nothing."""

    def __init__(self, root, at=None, nested=(), when=lambda frame: True):
        self.root, self.at, self.when, self.seen, self.fired = root.__code__, at, when, 0, False
        self.codes = {f.__code__: _check_points(f.__code__) for f in (root, *nested)}
        self.active = None  # the root frame being counted
        self.done = False

    def _hit(self):
        self.seen += 1
        if self.seen == self.at:
            self.fired = True
            raise KeyboardInterrupt

    def _global(self, frame, event, arg):
        if self.done or event != "call":
            return None
        if self.active is None:
            if frame.f_code is not self.root or not self.when(frame):
                return None
            self.active = frame
        elif not self._inside(frame.f_back):
            return None
        elif frame.f_code not in self.codes:
            if not frame.f_code.co_flags & inspect.CO_GENERATOR:  # (a generator's start: inside a call checked after)
                self._hit()  # a callee's entry
            return None
        frame.f_trace_opcodes = True
        return self._local

    def _inside(self, frame) -> bool:
        return frame is not None and frame.f_code in self.codes and frame.f_trace_opcodes

    def _local(self, frame, event, arg):
        if event == "opcode" and frame.f_lasti in self.codes[frame.f_code]:
            self._hit()
        elif event == "return" and frame is self.active:
            self.done = True
            self._hit()  # the caller's check as the call returns: what it returned is lost
        return self._local

    def __enter__(self):
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


OTHERS = [{"id": f"b{i}", "prompt_token_ids": [(11 * i + j) % 290 for j in range(12 + 4 * i)], "max_tokens": 12 if i else 3}
          for i in range(3)]
TWO = {"id": "two", "prompt_token_ids": [5, 9, 13, 17, 21, 25], "max_tokens": 7, "n": 2, "temperature": 0.8, "seed": 3}
SHORT = {"id": "short", "prompt_token_ids": [9, 8, 7, 9, 8, 7], "max_tokens": 2}
STOPPED = dict(REQS[1], id="stopped", stop=["g"])  # (its text 'K2\ufffdg...': a stop string ends it)
STREAMED = [*REQS[:3], SHORT, STOPPED]


@pytest.fixture(scope="module")
def shared(default_artifacts, one_torch_thread):
    """One LLM for the Ctrl-C tests, and what each of their requests gives served alone."""
    llm = trtgraph.LLM(default_artifacts)
    want = {c.id: c for c in llm.generate([*STREAMED, TWO, *OTHERS])}
    assert want["stopped"].finish_reason == "stop" and want["stopped"].text == "K2\ufffd"
    yield llm, want
    llm.close()


def _interrupted(llm, want, make_ctrl_c, interrupted_call=None, busy=True):
    """Another consumer's stream (STREAMED) and an Engine-level n = 2 request are being
    served when `interrupted_call` (llm.generate(OTHERS)) is interrupted by `make_ctrl_c()`:
    the _CtrlC. Then each of the others must get exactly its tokens and text, the
    interrupted requests none (their ids free again), and the engine end idle with every block
    free and the collector on."""
    engine = llm.engine
    calls, step = [], engine.step

    def bounded(*args, **kwargs):  # a consumer waiting for outputs that never come fails, not spins
        calls.append(1)
        assert len(calls) < 1000, "stepped for ever"
        return step(*args, **kwargs)
    engine.step = bounded
    try:
        if not busy:
            return _alone(llm, want, make_ctrl_c, interrupted_call)
        return _served(llm, want, make_ctrl_c, interrupted_call)
    finally:
        del engine.step


def _call(llm, make_ctrl_c, interrupted_call):
    with make_ctrl_c() as ctrl_c:
        try:
            (interrupted_call or (lambda: llm.generate(OTHERS)))()
        except KeyboardInterrupt:
            assert ctrl_c.fired
    return ctrl_c


def _alone(llm, want, make_ctrl_c, interrupted_call):
    """The interrupted call on an idle engine: its requests must not stay (nor the collector off)."""
    ctrl_c = _call(llm, make_ctrl_c, interrupted_call)
    assert gc.isenabled(), ctrl_c.at
    assert [c.token_ids for c in llm.generate(OTHERS)] == [want[r["id"]].token_ids for r in OTHERS], ctrl_c.at
    engine = llm.engine
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_free == engine.executor.num_blocks - 1
    assert gc.isenabled() and not engine._owners
    return ctrl_c


GONE = {"id": "gone", "prompt_token_ids": [3, 1, 4, 1, 5], "max_tokens": 30}


def _served(llm, want, make_ctrl_c, interrupted_call):
    engine = llm.engine
    stream = llm.stream(STREAMED)
    gone = engine.submit([GONE])  # (admitted at the stream's first step, aborted before the interrupted call)
    gone_owners = engine.owners(gone)
    got: dict[str, list] = {}
    first = next(stream)
    got[first.id] = [list(first.token_ids), first.text, first]
    ids = engine.submit([TWO])
    owners = engine.owners(ids)
    assert engine.abort("gone")
    ctrl_c = _call(llm, make_ctrl_c, interrupted_call)
    for d in stream:
        mine = got.setdefault(d.id, [[], "", None])
        mine[0] += d.token_ids
        mine[1] += d.text
        mine[2] = d
    for rid, (tokens, text, last) in got.items():
        assert last.finished and last.completion.token_ids == tokens == want[rid].token_ids, (rid, ctrl_c.at)
        assert text == last.completion.text == want[rid].text, (rid, ctrl_c.at)
    assert set(got) == {r["id"] for r in STREAMED}
    assert list(engine.outputs_of(gone, gone_owners)) == []
    engine.abort_unfinished(gone, set(), gone_owners)  # (its consumer's clean-up, as LLM's calls make)
    two = [o for o in engine.outputs_of(ids, owners) if o.finished]
    assert [[c.token_ids for c in o.result.choices] for o in two] == [[c.token_ids for c in want["two"].choices]]
    assert [c.token_ids for c in llm.generate(OTHERS)] == [want[r["id"]].token_ids for r in OTHERS], ctrl_c.at
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_free == engine.executor.num_blocks - 1
    assert gc.isenabled() and not engine._owners and not engine._choices
    return ctrl_c


def _every_check_point(llm, want, make, interrupted_call=None, busy=True) -> int:
    """_interrupted at each check point in turn (make(at) makes the _CtrlC); how many there were."""
    seen = _interrupted(llm, want, lambda: make(None), interrupted_call, busy).seen
    assert seen > 0
    for at in range(1, seen + 1):
        assert _interrupted(llm, want, lambda: make(at), interrupted_call, busy).fired, at
    return seen


def _deliveries():
    from trtgraph.runtime.serving import deliveries, streaming
    return deliveries.Deliveries, streaming.TextStream


def _of(ids, streamed):
    """A `_news` call for one of `ids`: of a step's new tokens (streamed) or of a finish."""
    return lambda frame: frame.f_locals["seq"].request.id in ids and (frame.f_locals["reason"] is None) == streamed


@pytest.mark.parametrize("streamed", [True, False])
def test_ctrl_c_anywhere_in_making_another_consumers_output_loses_nothing(shared, streamed):
    """A Ctrl-C inside `_news` for another consumer's request: between its two statements the
    stream's delta was lost or sent twice (its TextStream moved on, `num_sent` not), after its
    Result's `del _live[id]` the request vanished and its consumer stepped for ever."""
    llm, want = shared
    D, T = _deliveries()
    ids = {r["id"] for r in STREAMED}
    n = _every_check_point(llm, want, lambda at: _CtrlC(D._news, at, (D._delta, D._last_delta, T.feed, T.finish), _of(ids, streamed)))
    assert n >= 5


class _Nth:
    """A `_CtrlC.when` that holds for the nth call it sees for which `test(frame)` holds."""

    def __init__(self, n, test):
        self.n, self.test, self.seen = n, test, 0

    def __call__(self, frame) -> bool:
        if self.test(frame):
            self.seen += 1
            return self.seen == self.n
        return False


@pytest.mark.parametrize("nth", [1, 2])
def test_ctrl_c_as_a_completion_of_another_consumers_n_2_request_finishes(shared, nth):
    """An n > 1 request whose completion finished in a step interrupted before its Result was
    made never finished (`_orphans` skipped n > 1; its consumer stepped for ever); one
    interrupted inside `_finish_choice` lost its slot or the whole request."""
    llm, want = shared
    D, _ = _deliveries()
    finishing = lambda frame: frame.f_locals["seq"].request.id == "two" and frame.f_locals["reason"] is not None
    n = _every_check_point(llm, want, lambda at: _CtrlC(D._news, at, (D._finish_choice, D._last_delta), _Nth(nth, finishing)))
    assert n >= 5


def _engine():
    from trtgraph.runtime.serving.engine import Engine
    return Engine


CALLS = {"LLM.generate": lambda llm: llm.generate(OTHERS), "LLM.stream": lambda llm: list(llm.stream(OTHERS)),
         "Engine.generate": lambda llm: list(llm.engine.generate(OTHERS))}


@pytest.mark.parametrize("busy", [True, False])
@pytest.mark.parametrize("call", CALLS)
def test_ctrl_c_anywhere_in_submitting_leaves_no_request_served_for_nobody(shared, call, busy):
    """A Ctrl-C mid-`submit` (its queueing loop: some requests queued, or one queued without
    its owner or its id) or as it returns (before the caller knew the ids to abort) left
    requests served for nobody (the engine never idle, their ids 'still being served'), or, on
    an idle engine, the collector off for good."""
    llm, want = shared
    E = _engine()
    n = _every_check_point(llm, want, lambda at: _CtrlC(E.submit.__wrapped__, at, (E.start_run,)),
                           lambda: CALLS[call](llm), busy)
    assert n >= 5


def test_ctrl_c_anywhere_in_a_step_of_one_call_loses_no_output_of_another(shared):
    """A Ctrl-C as a step returned its outputs, before the consumer handed the others' back
    (outputs_of), lost them (a finished request's consumer stepped for ever); one while the step
    applied an abort left the request's sequences in the scheduler without it (KeyError in the
    next step) or counted it twice."""
    llm, want = shared
    E = _engine()
    n = _every_check_point(llm, want, lambda at: _CtrlC(E.step.__wrapped__, at, (E._apply_aborts,), _Nth(2, bool)))
    assert n >= 5


def test_ctrl_c_anywhere_in_admitting_a_request_loses_it_nowhere(shared):
    """A Ctrl-C while a step admits a waiting request (between taking it off the queue and its
    id, between its Live and the scheduler's queue) lost it or left it live but never scheduled."""
    llm, want = shared
    E = _engine()
    n = _every_check_point(llm, want, lambda at: _CtrlC(E._admit, at, (), _Nth(1, bool)))
    assert n >= 5


def test_one_request_object_in_two_calls_never_aborts_the_first(shared):
    """A Request object passed to a second call while the first still serves it: the second is
    refused (duplicate id) and must leave the first call's request alone (its clean-up, which
    knows its submission before submitting, took the same object for its own)."""
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.requests import parse_request

    llm, want = shared
    req = parse_request(dict(REQS[2]), "test", llm.engine.vocab_size)
    for second in (lambda: llm.generate([req]), lambda: list(llm.stream([req])),
                   lambda: list(llm.engine.generate([req]))):
        stream = llm.stream([req])
        got = list(next(stream).token_ids)
        with pytest.raises(PromptError, match="duplicate id 'q2'"):
            second()
        got += [t for d in stream for t in d.token_ids]
        assert got == want["q2"].token_ids
