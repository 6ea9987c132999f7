"""The twentieth session's adversarial pass over the serving engine (Engine: step, abort,
recovery after an interrupted step; the scheduler's postprocess; `run`'s request files).
Each test failed on the code before its fix."""

from __future__ import annotations

import contextlib

import pytest

from trtgraph.runtime.serving import outcomes
from trtgraph.runtime.serving.engine import Engine

PROMPT = [5, 6, 7, 8] * 5


@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


def _same(got, want) -> bool:
    """Two Results alike but for their timings (n > 1: their completions') and the last digits of
    their log-probabilities (a batch's shape, or a token recomputed in a prefill, moves them)."""
    def drop(r):
        if r.choices:
            return [drop(c) for c in r.choices]
        d = {k: v for k, v in r.to_json().items() if k not in ("ttft_ms", "tpot_ms")}
        d["logprobs"] = [(e["token_id"], round(e["logprob"], 3)) for e in d.get("logprobs") or []]
        return d
    return drop(got) == drop(want)


def _served_with_one_interrupt(engine, req, obj, name, when=lambda *args: True, most=200):
    """Serve `req` alone while obj.name raises KeyboardInterrupt at its first call that `when`
    its arguments (inside a step: step() raises, the caller steps on); its Result, or None
    when it never came."""
    orig, cuts = getattr(obj, name), []

    def cut(*args, **kwargs):
        if not cuts and when(*args):
            cuts.append(1)
            raise KeyboardInterrupt
        return orig(*args, **kwargs)
    setattr(obj, name, cut)
    try:
        engine.submit([req])
        outs = []
        for _ in range(most):
            if not engine.has_unfinished():
                break
            try:
                outs += engine.step()
            except KeyboardInterrupt:
                pass
    finally:
        setattr(obj, name, orig)
    assert cuts, f"{name} was never called"
    done = [o.result for o in outs if o.finished]
    if engine.has_unfinished():  # (leave the module's engine idle for the next test)
        engine.abort(req["id"])
        while engine.has_unfinished():
            engine.step()
    return done[0] if done else None


@pytest.mark.parametrize("where", ["_stop", "finish"])
@pytest.mark.parametrize("stop", ["length", "stop id"])
def test_a_ctrl_c_as_a_step_checks_its_stops_never_lets_a_request_run_past_them(engine, where, stop):
    """A Ctrl-C after a step appended a row's tokens but before its stop check (or the finish
    it called for) was done: the recovered row drew on and only its next tokens were checked, so
    it ran past max_tokens (7 tokens of 6) or past its stop token (9 tokens, stop at the 3rd)."""
    req = {"id": "a", "prompt_token_ids": PROMPT, "max_tokens": 6}
    if stop == "stop id":
        third = list(engine.generate([req]))[0].token_ids[2]
        req = dict(req, max_tokens=20, stop=[third])
    want = list(engine.generate([req]))[0]
    assert want.finish_reason == ("length" if stop == "length" else "stop")
    got = _served_with_one_interrupt(engine, req, engine.scheduler, where)
    assert got is not None and _same(got, want), (got and got.token_ids, want.token_ids)
    s = engine.scheduler
    assert s.allocator.num_free == s.allocator.num_blocks - 1 and len(s.free_slots) == s.plan.max_batch_size


def test_a_ctrl_c_as_an_n_request_forks_its_completions_still_finishes_it(engine):
    """A Ctrl-C as the first token of an n > 1 request started its other completions: they were
    never made (the parent only forks at its first token) and the request never finished."""
    req = {"id": "n", "prompt_token_ids": PROMPT, "max_tokens": 6, "n": 3, "temperature": 0.8, "seed": 5}
    want = list(engine.generate([req]))[0]
    got = _served_with_one_interrupt(engine, req, engine.scheduler, "fork")
    assert got is not None and [c.token_ids for c in got.choices] == [c.token_ids for c in want.choices]


def test_a_fork_cut_after_its_last_completion_is_not_called_again_at_every_step(engine, monkeypatch):
    """A Ctrl-C after a fork had made its last completion but before it counted it: the fork
    called again found every completion made, counted none, and was called again at every later
    step of the request (each a scan of the running and waiting rows)."""
    req = {"id": "nf", "prompt_token_ids": PROMPT, "max_tokens": 8, "n": 3, "temperature": 0.8, "seed": 6}
    want = list(engine.generate([req]))[0]
    s, calls, cuts = engine.scheduler, [], []
    fork, insert = s.fork, s._insert_running

    def inserted(seq):
        insert(seq)
        if seq.index == req["n"] - 1 and not cuts:
            cuts.append(1)
            raise KeyboardInterrupt
    monkeypatch.setattr(s, "_insert_running", inserted)
    monkeypatch.setattr(s, "fork", lambda *a: calls.append(1) or fork(*a))
    engine.submit([req])
    outs = []
    while engine.has_unfinished():
        try:
            outs += engine.step()
        except KeyboardInterrupt:
            pass
    assert cuts and len(calls) == 2, (cuts, len(calls))
    [got] = [o.result for o in outs if o.finished]
    assert [c.token_ids for c in got.choices] == [c.token_ids for c in want.choices]


def test_a_ctrl_c_before_a_steps_logprobs_are_kept_leaves_each_token_its_own(engine, monkeypatch):
    """The log-probabilities of a step's tokens not kept (a Ctrl-C) but its tokens appended:
    every later entry was one token off (a token's entry held the next one's log-probability)."""
    req = {"id": "lp", "prompt_token_ids": PROMPT, "max_tokens": 5, "logprobs": 2}
    want = list(engine.generate([req]))[0]
    got = _served_with_one_interrupt(engine, req, outcomes, "_keep_logprobs", lambda step, drew, logprobs: drew)
    assert got is not None and _same(got, want)


@pytest.mark.parametrize("where", ["free", "share"])
def test_a_ctrl_c_inside_the_scheduler_s_block_accounting_leaks_no_block_or_slot(engine, where):
    """A Ctrl-C as a finished request's blocks were being freed (or as an n > 1 request's
    completions took their holds on the prompt's blocks): a KV block and a device slot were lost
    for good, and the next full batch failed at every step ("pop from empty list"); a row retired
    that way was in no queue, and its request never finished."""
    req = {"id": "a", "prompt_token_ids": PROMPT * 2, "max_tokens": 4, "n": 2 if where == "share" else 1}
    want = list(engine.generate([req]))[0]
    got = _served_with_one_interrupt(engine, req, engine.scheduler.allocator, where, lambda blocks: blocks)
    assert got is not None and _same(got, want)
    s = engine.scheduler
    assert s.allocator.num_free == s.allocator.num_blocks - 1 and sorted(s.free_slots) == list(range(8))
    batch = [{"id": f"b{i}", "prompt_token_ids": [3 + i] * 5, "max_tokens": 3} for i in range(8)]
    assert [len(r.token_ids) for r in engine.generate(batch)] == [3] * 8


@contextlib.contextmanager
def first_free_interrupted(engine):
    """The body must raise KeyboardInterrupt, thrown as the allocator first frees some blocks."""
    free, cuts = engine.scheduler.allocator.free, []

    def cut(blocks):
        if blocks and not cuts:
            cuts.append(1)
            raise KeyboardInterrupt
        return free(blocks)
    engine.scheduler.allocator.free = cut
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        del engine.scheduler.allocator.free


def test_a_ctrl_c_as_an_abort_frees_its_blocks_leaks_none(engine):
    """The aborts are applied at the start of a step, before the part of it that recovers from
    an interrupt: a Ctrl-C as an aborted request's blocks were freed lost them and its slot."""
    reqs = [{"id": f"a{i}", "prompt_token_ids": PROMPT, "max_tokens": 12} for i in range(2)]
    want = list(engine.generate(reqs[1:]))[0]
    engine.submit(reqs)
    outs = engine.step()
    engine.abort("a0")
    with first_free_interrupted(engine):
        engine.step()
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.result.token_ids for o in outs if o.finished] == [want.token_ids]
    s = engine.scheduler
    assert s.allocator.num_free == s.allocator.num_blocks - 1 and sorted(s.free_slots) == list(range(8))


def test_a_ctrl_c_as_a_stop_string_ends_a_request_still_ends_it_there(engine):
    """A Ctrl-C as a stop string found in a step's text was ending its request: the search had
    gone past it, so the request ran on to max_tokens, and its Result's text (cut at the stop)
    no longer matched its tokens (all 15 of them)."""
    req = {"id": "s", "prompt_token_ids": [(30 + j) % 300 for j in range(69)], "max_tokens": 15}
    second = engine.tokenizer.decode(list(engine.generate([req]))[0].token_ids[1:2])
    req = dict(req, stop=[second])
    want = list(engine.generate([req]))[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 15
    got = _served_with_one_interrupt(engine, req, engine.scheduler, "finish", lambda seq: seq.finish_reason is None)
    assert got is not None and _same(got, want), (got and got.token_ids, want.token_ids)


MIX = [{"id": f"m{i}", "prompt_token_ids": [(5 * i + j) % 300 for j in range(3 + 11 * i)], "max_tokens": 4 + 3 * i,
        **({"temperature": 0.9, "seed": 70 + i} if i % 2 else {}), **({"n": 2} if i % 3 == 1 else {}),
        **({"stop": ["a", 17]} if i % 4 == 2 else {}), **({"logprobs": 1} if i == 3 else {})} for i in range(7)]


@pytest.fixture(scope="module")
def mix_alone(engine):
    return {r["id"]: list(engine.generate([r]))[0] for r in MIX}


@pytest.mark.parametrize("where", ["scheduler.postprocess", "scheduler._stop", "scheduler.finish", "scheduler.fork",
                                   "scheduler._release_all", "scheduler.allocator.free", "scheduler.allocator.allocate",
                                   "launcher.wait", "_news"])
def test_a_batch_cut_by_ctrl_c_anywhere_in_a_step_still_gets_exactly_its_tokens(engine, mix_alone, where):
    """A mixed batch (n > 1, stop strings and ids, sampled, logprobs), a Ctrl-C at the 1st, 3rd,
    7th and 12th calls of one of the functions a step runs: every request still gets exactly the
    Result it gets alone, and no KV block or slot is left held."""
    path, _, name = where.rpartition(".")
    obj = engine
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    orig, calls = getattr(obj, name), []

    def cut(*args, **kwargs):
        calls.append(1)
        if len(calls) in (1, 3, 7, 12):
            raise KeyboardInterrupt
        return orig(*args, **kwargs)
    got = {}
    engine.submit(MIX)
    setattr(obj, name, cut)
    try:
        for _ in range(500):
            if not engine.has_unfinished():
                break
            try:
                got |= {o.id: o.result for o in engine.step() if o.finished}
            except KeyboardInterrupt:
                pass
    finally:
        delattr(obj, name)
    assert len(calls) >= 3
    assert set(got) == set(mix_alone) and all(_same(got[k], mix_alone[k]) for k in got)
    s = engine.scheduler
    assert s.allocator.num_free == s.allocator.num_blocks - 1 and sorted(s.free_slots) == list(range(8))


def test_a_run_stopped_by_an_error_names_what_it_wrote_and_how_to_go_on(default_artifacts, one_torch_thread,
                                                                        tmp_path, monkeypatch):
    """A run that a failure stops part-way (a device error; here the 30th step's read) said
    only "internal error": not that the results before it were written, which did not finish,
    nor that --resume goes on from there, as an interrupted run says."""
    import json

    from click.testing import CliRunner

    from trtgraph.cli import main
    from trtgraph.runtime.serving.launcher import StepLauncher

    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [3 + i] * (5 + i), "max_tokens": 4 + i})
                               + "\n" for i in range(20)))
    wait, calls = StepLauncher.wait, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 30:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return wait(self, *args, **kwargs)
    monkeypatch.setattr(StepLauncher, "wait", failing)
    result = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(default_artifacts),
                                       "--output", str(out)])
    written = len(out.read_text().splitlines())
    assert result.exit_code == 1 and 0 < written < 20
    assert f"{written} of 20 requests finished and written to {out}" in result.output
    assert f"--resume --output {out}" in result.output and "illegal memory access" in result.output


def test_a_ctrl_c_as_submit_launches_the_first_step_leaks_no_block(engine):
    """submit() to an idle engine forms and launches the first step itself; a Ctrl-C there (here
    as the allocator hands out a row's blocks, before the row holds them) aborted the requests
    but left the blocks held by nobody, for good."""
    alloc = engine.scheduler.allocator
    allocate, cuts = alloc.allocate, []

    def cut(n):
        blocks = allocate(n)
        if not cuts:
            cuts.append(1)
            raise KeyboardInterrupt
        return blocks
    alloc.allocate = cut
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.submit([{"id": "k", "prompt_token_ids": PROMPT, "max_tokens": 3}])
    finally:
        del alloc.allocate
    while engine.has_unfinished():
        engine.step()
    s = engine.scheduler
    assert cuts and s.allocator.num_free == s.allocator.num_blocks - 1 and sorted(s.free_slots) == list(range(8))
    assert not s.running and not s.waiting


def test_a_ctrl_c_as_a_reused_id_settles_its_abort_leaks_no_block(engine):
    """Submitting an id whose abort is pending applies that abort at once, outside any step; a
    Ctrl-C as it freed the aborted request's blocks left them, and its slot, held by nobody."""
    reqs = [{"id": f"u{i}", "prompt_token_ids": PROMPT, "max_tokens": 12} for i in range(2)]
    want = list(engine.generate(reqs[:1]))[0]
    engine.submit(reqs)
    outs = engine.step()
    engine.abort("u1")
    with first_free_interrupted(engine):
        engine.submit([reqs[1]])
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.result.token_ids for o in outs if o.finished] == [want.token_ids]
    s = engine.scheduler
    assert s.allocator.num_free == s.allocator.num_blocks - 1 and sorted(s.free_slots) == list(range(8))


def test_a_consumer_dropped_in_a_reference_cycle_does_not_keep_the_collector_off_for_good(engine):
    """A generate() left part-way inside a reference cycle is only closed by the collector, which
    the engine holds off while it has unfinished work: its request was served for nobody and its
    outputs left waiting, so the engine never idled and Python's collector stayed off for good
    (the cycle, and all of the program's, never collected); once it was closed, the next call
    found the engine busy with the aborted leftovers, and its stats were not its own."""
    import gc

    assert gc.isenabled()
    left = engine.generate([{"id": "short", "prompt_token_ids": PROMPT, "max_tokens": 1},
                            {"id": "long", "prompt_token_ids": PROMPT, "max_tokens": 30}])
    assert next(left).id == "short"
    cycle = [left]
    cycle.append(cycle)
    del left
    list(engine.generate([{"id": "later", "prompt_token_ids": PROMPT, "max_tokens": 40}]))  # "long" ends meanwhile
    del cycle  # garbage now, for the collector alone to find
    assert gc.isenabled()
    gc.collect()  # the abandoned generate is closed: its request is aborted, its outputs dropped
    list(engine.generate([{"id": "last", "prompt_token_ids": PROMPT, "max_tokens": 2}]))
    assert not engine.has_unfinished() and gc.isenabled()
    assert engine.stats.requests == 1  # (a run of its own: the aborted leftovers were no work in progress)
