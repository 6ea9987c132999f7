"""The host's work where the device would wait for it (issue 14 item 1), on the static backend:

- Python's garbage collector is paced by the engine while it serves (runtime/serving/collection.py):
  no automatic collection during a run; the collections CPython's thresholds call for are made
  at the engine's safe point, with a step queued behind the one the host reads next; the
  collector is back on once the engine is idle, and left alone where the process had turned it
  off;
- admission derives what a request's sampling fields imply once per distinct fields (the seed
  aside): requests that differ only in their seeds share their RowFacts and keep their own seeds,
  and every request's resolved fields are the ones resolving it alone gives.
(The first launch before every request is admitted, and the next wave's prefill launched two
steps ahead, are tests/test_host_overlap.py's and test_host_syncs.py's.)
"""

from __future__ import annotations

import gc

import pytest

from trtgraph.runtime.serving import collection
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.launcher import StepLauncher
from trtgraph.runtime.serving.requests import parse_request, resolve_sampling_defaults


@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


def _requests(engine: Engine, n: int) -> list[dict]:
    rows = engine.scheduler.plan.max_batch_size
    return [{"id": f"c{i}", "prompt_token_ids": [(3 * i + j) % 300 + 3 for j in range(20)],
             "max_tokens": 6 + i % 5, "ignore_eos": True, **({"temperature": 0.7, "seed": i} if i % 2 else {})}
            for i in range(n or 2 * rows)]


def test_the_collector_runs_at_the_engines_safe_point_only_while_it_serves(engine):
    seen = []  # (automatic collection on, steps in flight, a prefill among them, generation) at each start
    launches = []  # automatic collection on at each launch

    def watch(when, info):
        if when == "start":
            seen.append((gc.isenabled(), len(engine._flight), any(f.step.is_prefill for f in engine._flight),
                         info["generation"]))

    launch = StepLauncher.launch

    def launched(launcher, step, stats):
        launches.append(gc.isenabled())
        return launch(launcher, step, stats)

    before = gc.get_threshold()
    assert gc.isenabled()
    gc.set_threshold(50, before[1], before[2])  # collections due often: the run must make several
    gc.callbacks.append(watch)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(StepLauncher, "launch", launched)
            results = list(engine.generate(_requests(engine, 0)))
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*before)
    assert len(results) == 2 * engine.scheduler.plan.max_batch_size
    assert launches and not any(launches), "the automatic collector was on while the engine served"
    during = [s for s in seen if not s[0]]
    assert during, seen  # collections were made during the run ...
    # ... each with a step queued behind the one read next; an older generation with two, or a prefill
    assert all(flight >= 2 and (gen == 0 or flight >= 3 or prefill) for _, flight, prefill, gen in during), during
    assert gc.isenabled() and not collection.held(engine)  # idle: back on


def test_a_process_that_turned_the_collector_off_keeps_it_off(engine):
    seen = []

    def watch(when, info):
        if when == "start":
            seen.append(info["generation"])

    gc.disable()
    gc.callbacks.append(watch)
    try:
        before = gc.get_threshold()
        gc.set_threshold(50, before[1], before[2])
        try:
            list(engine.generate(_requests(engine, 8)))
        finally:
            gc.set_threshold(*before)
        assert not gc.isenabled() and not seen, seen  # no collection made for it, and not turned on
    finally:
        gc.callbacks.remove(watch)
        gc.enable()


def test_an_engine_dropped_while_serving_lets_the_collector_go(default_artifacts, one_torch_thread):
    eng = Engine(default_artifacts)
    eng.submit(_requests(eng, 4))
    assert not gc.isenabled() and collection.held(eng)
    del eng
    gc.collect()  # (an explicit collection works while the automatic one is off)
    assert gc.isenabled()


def test_requests_differing_only_in_seed_share_what_their_fields_imply(engine):
    vocab = engine.executor.loaded.config.vocab_size
    base = {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0.8}
    reqs = [parse_request({**base, "id": f"s{i}", "seed": i}, "t", vocab) for i in (1, 2)]
    other = parse_request({**base, "id": "t", "seed": 1, "temperature": 0.5}, "t", vocab)
    greedy = parse_request({"id": "g", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}, "t", vocab)
    adm = engine.admission
    seqs = [adm.admit(r, i, speculative=False) for i, r in enumerate([*reqs, other, greedy, greedy])]
    a, b, c, g1, g2 = seqs
    assert a.facts is b.facts and c.facts is not a.facts and g1.facts is g2.facts
    assert (a.seed, b.seed, c.seed) == (1, 2, 1) and g1.seed != g2.seed  # own seeds; drawn when none
    for seq, req in zip(seqs, [*reqs, other, greedy, greedy]):
        alone = resolve_sampling_defaults(req, engine.generation)
        assert seq.request.sampling == alone.sampling  # as resolving it alone gives, its seed included
        assert seq.request.id == req.id and seq.request.prompt_token_ids == req.prompt_token_ids
    rows = [engine.launcher._row(s, 1) for s in (a, b, c)]
    assert [r.temperature for r in rows] == [0.8, 0.8, 0.5] and [r.seed for r in rows] == [1, 2, 1]


def test_refusals_by_sampling_fields_hold_for_every_request_that_has_them(greedy_only_artifacts, one_torch_thread):
    eng = Engine(greedy_only_artifacts)
    reqs = [{"id": f"r{i}", "prompt_token_ids": [5, 6], "max_tokens": 3, "temperature": 0.9, "seed": i}
            for i in range(3)] + [{"id": "ok", "prompt_token_ids": [5, 6], "max_tokens": 3}]
    results = {r.id: r for r in eng.generate(reqs)}
    assert all(results[f"r{i}"].finish_reason == "error" and "greedy" in results[f"r{i}"].error for i in range(3))
    assert results["ok"].finish_reason == "length" and len(results["ok"].token_ids) == 3


def test_a_waves_last_step_and_the_next_waves_first_go_three_ahead(engine):
    """Rows that all reach max_tokens together while requests wait: the wave's last step and
    the next wave's first step are launched before the host reads the step two before the last
    (the first step's forming hides behind two steps of device time), with the tokens of the
    eager oracle's schedule (every request's max_tokens, the oracle's greedy tokens)."""
    rows = engine.scheduler.plan.max_batch_size
    log: list[tuple[str, int, object]] = []
    launch, wait = StepLauncher.launch, StepLauncher.wait

    def launched(launcher, step, stats):
        log.append(("launch", len(log), step))
        return launch(launcher, step, stats)

    def waited(launcher, f, stats):
        log.append(("wait", len(log), f.step))
        return wait(launcher, f, stats)

    reqs = [{"id": f"w{i}", "prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(12)], "max_tokens": 7,
             "ignore_eos": True} for i in range(3 * rows)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepLauncher, "launch", launched)
        mp.setattr(StepLauncher, "wait", waited)
        results = {r.id: r for r in engine.generate(reqs)}
    assert all(len(results[r["id"]].token_ids) == 7 for r in reqs)
    launches = [s for what, _, s in log if what == "launch"]
    at = {(what, id(s)): i for what, i, s in log}
    firsts = [i for i, s in enumerate(launches) if s.is_prefill and i and not launches[i - 1].is_prefill]
    assert len(firsts) == 2, [(s.key, len(s.seqs)) for s in launches]
    for i in firsts:
        assert launches[i - 1].repeats and launches[i - 2].repeats
        assert at[("launch", id(launches[i]))] < at[("wait", id(launches[i - 3]))], i
    import oracle

    ex = engine.executor
    for r in reqs[::rows // 2]:
        assert results[r["id"]].token_ids == oracle.generate(ex.loaded, r["prompt_token_ids"], 7), r["id"]


def test_serving_again_and_again_registers_one_finalizer_per_engine(engine):
    """Each idle engine that serves again holds the collector again: a long-lived server that
    goes idle between requests must not add a finalizer (and its record) every time."""
    import weakref

    def mine():
        return sum(1 for f in list(weakref.finalize._registry) if (p := f.peek()) and p[0] is engine)

    list(engine.generate(_requests(engine, 1)))
    before = mine()
    for _ in range(5):
        list(engine.generate(_requests(engine, 1)))
        assert gc.isenabled() and not collection.held(engine)
    assert mine() == before <= 1


def test_a_stream_closed_early_gives_the_collector_back(default_artifacts, one_torch_thread):
    """A consumer that stops reading (a `for` over LLM.stream left with `break`) aborts what it
    had not finished; nobody steps the engine after that, so the process must not be left
    without its automatic collector until some later call."""
    from trtgraph import LLM

    llm = LLM(default_artifacts)
    for _ in llm.stream(["hi", "there"], {"max_tokens": 20}):
        break
    assert gc.isenabled() and not collection.held(llm.engine)
    s = llm.stream("hey", {"max_tokens": 20})
    next(s)
    s.close()
    assert gc.isenabled()
    # the engine serves as before, the aborted requests' KV blocks freed at its next step
    assert [c.finish_reason for c in llm.generate(["again"], {"max_tokens": 4})] == ["length"]
    sched = llm.engine.scheduler
    assert sched.allocator.num_free == sched.allocator.num_blocks - 1 and not llm.engine.has_unfinished()
