"""The twentieth session's adversarial pass over the serving engine (Engine: step, abort,
recovery after an interrupted step; the scheduler's postprocess; `run`'s request files).
Each test failed on the code before its fix."""

from __future__ import annotations

import pytest

from trtgraph.runtime.serving import outcomes
from trtgraph.runtime.serving.engine import Engine

PROMPT = [5, 6, 7, 8] * 5


@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


def _same(got, want) -> bool:
    """Two Results alike but for their timings (n > 1: their completions')."""
    def drop(r):
        return [drop(c) for c in r.choices] if r.choices else \
            {k: v for k, v in r.to_json().items() if k not in ("ttft_ms", "tpot_ms")}
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


def test_a_ctrl_c_as_an_abort_frees_its_blocks_leaks_none(engine):
    """The aborts are applied at the start of a step, before the part of it that recovers from
    an interrupt: a Ctrl-C as an aborted request's blocks were freed lost them and its slot."""
    reqs = [{"id": f"a{i}", "prompt_token_ids": PROMPT, "max_tokens": 12} for i in range(2)]
    want = list(engine.generate(reqs[1:]))[0]
    engine.submit(reqs)
    outs = engine.step()
    engine.abort("a0")
    free, cuts = engine.scheduler.allocator.free, []

    def cut(blocks):
        if blocks and not cuts:
            cuts.append(1)
            raise KeyboardInterrupt
        return free(blocks)
    engine.scheduler.allocator.free = cut
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        del engine.scheduler.allocator.free
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.result.token_ids for o in outs if o.finished] == [want.token_ids]
    s = engine.scheduler
    assert s.allocator.num_free == s.allocator.num_blocks - 1 and sorted(s.free_slots) == list(range(8))
