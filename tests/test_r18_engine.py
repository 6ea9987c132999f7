"""The eighteenth session's adversarial pass over the Python API and the serving engine
(trtgraph.LLM, Engine: ids reused after an abort, consumers on several threads, the
arguments of the API). Each test failed on the code before its fix."""

from __future__ import annotations

import threading

import pytest

import trtgraph
from trtgraph.errors import PromptError
from trtgraph.runtime.serving.requests import completion_seed

REQS = [{"id": f"q{i}", "prompt_token_ids": [(7 * i + 3 * j) % 300 for j in range(5 + 9 * i)], "max_tokens": 9 + i,
         **({"temperature": 0.9, "seed": 40 + i} if i % 2 else {})} for i in range(6)]


@pytest.fixture(scope="module")
def llm(default_artifacts, one_torch_thread):
    return trtgraph.LLM(default_artifacts)


@pytest.fixture(scope="module")
def alone(llm):
    """Each request of REQS served by itself: its tokens."""
    return {r["id"]: llm.generate([r])[0].token_ids for r in REQS}


class _StepBound:
    """Engine.step, failing the test past `most` calls instead of spinning for ever."""

    def __init__(self, engine, most=2000):
        self.engine, self.most, self.calls, self.step = engine, most, 0, engine.step

    def __call__(self, *args, **kwargs):
        self.calls += 1
        assert self.calls <= self.most, "the engine was stepped for ever: a consumer waits for outputs that never come"
        return self.step(*args, **kwargs)


def test_an_id_is_free_again_as_soon_as_its_stream_is_closed(llm, alone):
    """Closing a stream (or an interrupted generate) aborts its requests; submitting their
    ids again right away is a new request, not 'still being served'."""
    req = REQS[1]
    stream = llm.stream(req)
    next(stream)
    stream.close()
    assert llm.generate([req])[0].token_ids == alone[req["id"]]

    engine = llm.engine
    results = engine.generate([dict(r) for r in REQS[:3]])
    next(results)
    results.close()
    assert [c.token_ids for c in llm.generate(REQS[:3])] == [alone[r["id"]] for r in REQS[:3]]
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_free == engine.executor.num_blocks - 1


def test_an_aborted_stream_never_takes_the_tokens_of_a_newer_request_with_its_id(llm, alone, monkeypatch):
    """A stream whose request was aborted by Engine.abort, resumed after a new request
    reused the id, ends without it: the new request's tokens go to its own stream."""
    monkeypatch.setattr(llm.engine, "step", _StepBound(llm.engine))
    old = llm.stream({"id": "x", "prompt": "the first x", "max_tokens": 30})
    first = next(old)
    assert llm.engine.abort("x")
    llm.generate(["something else"], {"max_tokens": 2})  # applies the abort
    new = llm.stream(dict(REQS[0], id="x"))
    got = list(next(new).token_ids)
    assert [d.token_ids for d in old] == [], "the aborted stream took the new request's tokens"
    for d in new:
        got += d.token_ids
    assert got == alone["q0"] and first.id == "x"

    # aborted and reused before the old consumer's next step: the same
    old = llm.stream({"id": "y", "prompt": "the first y", "max_tokens": 30})
    next(old)
    llm.engine.abort("y")
    new = llm.stream(dict(REQS[3], id="y"))
    got = list(next(new).token_ids)
    assert all(not d.token_ids for d in old)
    got += [t for d in new for t in d.token_ids]
    assert got == alone["q3"]
    assert not llm.engine.has_unfinished()


def test_a_closed_stream_never_aborts_a_newer_request_that_reuses_its_aborted_id(llm, alone, monkeypatch):
    monkeypatch.setattr(llm.engine, "step", _StepBound(llm.engine))
    old = llm.stream({"id": "z", "prompt": "old z", "max_tokens": 30})
    next(old)
    llm.engine.abort("z")
    new = llm.stream(dict(REQS[2], id="z"))
    got = list(next(new).token_ids)
    old.close()  # its clean-up aborts what it did not finish: not the new "z"
    got += [t for d in new for t in d.token_ids]
    assert got == alone["q2"]


def _consume(llm, kind, reqs, out, errors):
    try:
        if kind == "generate":
            out.update({c.id: c.token_ids for c in llm.generate(reqs)})
        else:
            for d in llm.stream(reqs):
                out.setdefault(d.id, []).extend(d.token_ids)
    except BaseException as exc:  # reported by the test
        errors.append(exc)


@pytest.mark.parametrize("kinds", [("stream", "generate"), ("stream", "stream"), ("generate", "generate")])
def test_calls_on_several_threads_each_get_their_own_tokens(llm, alone, kinds):
    """One LLM used from several threads at once (a stream consumed on a worker thread while
    the main thread generates): each call gets exactly the tokens its requests get alone."""
    for rnd in range(3):
        outs, errors, threads = [{} for _ in range(4)], [], []
        for t in range(4):
            reqs = [dict(r, id=f"{r['id']}-{rnd}-{t}") for r in REQS[t % 2::2]]
            threads.append(threading.Thread(target=_consume, args=(llm, kinds[t % 2], reqs, outs[t], errors)))
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors
        for out in outs:
            assert out and all(toks == alone[rid.split("-")[0]] for rid, toks in out.items())
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, name", [({"eager": "no"}, "eager"), ({"eager": 1}, "eager"),
                                          ({"speculative": "off"}, "speculative"),
                                          ({"manifest_path": 5}, "manifest_path"), ({"model": 3}, "model"),
                                          ({"manifest_path": None}, "manifest_path")])
def test_llm_refuses_arguments_of_the_wrong_type_naming_them(default_artifacts, kwargs, name):
    """LLM(eager="no") served eagerly (a truthy string), LLM(5) raised a TypeError from pathlib."""
    args = {"manifest_path": default_artifacts, **kwargs}
    with pytest.raises(PromptError, match=f"LLM: `{name}`"):
        trtgraph.LLM(**args)


SHORT = {"id": "short", "prompt_token_ids": [9, 8, 7, 9, 8, 7], "max_tokens": 2}
OTHERS = [{"id": f"b{i}", "prompt_token_ids": [(11 * i + j) % 290 for j in range(20 + 4 * i)], "max_tokens": 25 if i else 3}
          for i in range(3)]


@pytest.fixture(scope="module")
def alone_more(llm):
    return {r["id"]: llm.generate([r])[0].token_ids for r in [SHORT, *OTHERS]}


def _interrupt(obj, name, at, monkeypatch):
    """obj.name raises KeyboardInterrupt at its `at`-th call."""
    orig, calls = getattr(obj, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return orig(*args, **kwargs)
    monkeypatch.setattr(obj, name, interrupted)


@pytest.mark.parametrize("where", ["launcher.wait", "launcher.launch", "scheduler.postprocess", "_news"])
@pytest.mark.parametrize("at", [2, 6])
def test_a_call_interrupted_mid_step_leaves_every_other_stream_its_exact_tokens(llm, alone, alone_more, where, at,
                                                                              monkeypatch):
    """Ctrl-C inside one generate while another call's stream is live: the stream got tokens
    of the wrong positions (24 of 25, others shifted), lost the outputs handed back to it (a
    finished request never came: its consumer stepped for ever) or an AssertionError deep in
    the scheduler; the interrupted call's requests must not stay either."""
    engine = llm.engine
    monkeypatch.setattr(engine, "step", _StepBound(engine))
    stream = llm.stream([*REQS, SHORT])
    got: dict[str, list[int]] = {}
    first = next(stream)
    got[first.id] = list(first.token_ids)
    obj, _, name = where.rpartition(".")
    with pytest.MonkeyPatch.context() as mp:
        _interrupt(getattr(engine, obj) if obj else engine, name, at, mp)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(OTHERS)
    finished = set()
    for d in stream:
        got.setdefault(d.id, []).extend(d.token_ids)
        if d.finished:
            finished.add(d.id)
            assert d.completion.token_ids == got[d.id]
    want = {**alone, "short": alone_more["short"]}
    assert got == want and finished == set(want) - ({first.id} if first.finished else set())
    assert [c.token_ids for c in llm.generate(OTHERS)] == [alone_more[r["id"]] for r in OTHERS]
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_free == engine.executor.num_blocks - 1


@pytest.mark.parametrize("stop", [None, "strings"])
def test_a_request_that_finished_in_a_step_cut_short_still_gets_its_result(llm, alone, alone_more, stop,
                                                                           monkeypatch):
    """A step interrupted after a request's last token was read but before its Result was
    made: the Result comes at the next step (its consumer waited for ever)."""
    engine = llm.engine
    monkeypatch.setattr(engine, "step", _StepBound(engine))
    req = dict(SHORT, max_tokens=6 if stop else 2, **({"stop": [llm.generate(SHORT)[0].text[-1]]} if stop else {}))
    want = llm.generate(req)[0]
    assert want.finish_reason == ("stop" if stop else "length")
    stream = llm.stream([req, *REQS[:2]])
    got = list(next(stream).token_ids)
    news, cuts = engine._news, []

    def cut(seq, reason, text=None):
        if reason is not None and seq.request.id == "short" and not cuts:
            cuts.append(1)
            raise KeyboardInterrupt
        return news(seq, reason, text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "_news", cut)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(OTHERS)
    last = None
    for d in stream:
        if d.id == "short":
            got += d.token_ids
            last = d
    assert last is not None and last.finished and last.completion.to_json() | {"ttft_ms": 0, "tpot_ms": 0} == \
        want.to_json() | {"ttft_ms": 0, "tpot_ms": 0}
    assert got == want.token_ids and not engine.has_unfinished()


def test_the_api_names_are_listed_by_dir():
    """`dir(trtgraph)` (tab completion, help()) listed none of the lazily imported API names."""
    assert set(trtgraph.__all__) <= set(dir(trtgraph))
    assert all(getattr(trtgraph, name) is not None for name in trtgraph.__all__)


def test_a_request_interrupted_while_being_admitted_is_still_served(llm, alone, alone_more, monkeypatch):
    """Ctrl-C while a step admits another consumer's request (encoding its text, rendering its
    chat): that request was gone (neither waiting nor served), its consumer stepped for ever."""
    engine = llm.engine
    monkeypatch.setattr(engine, "step", _StepBound(engine))
    stream = llm.stream(REQS[:2])
    next(stream)  # busy: what is submitted now waits to be admitted by a step
    ids = engine.submit([dict(REQS[4], id="victim")])
    owners = engine.owners(ids)
    admit, cuts = engine.admission.admit, []

    def cut(req, *args, **kwargs):
        if req.id == "victim" and not cuts:
            cuts.append(1)
            raise KeyboardInterrupt
        return admit(req, *args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.admission, "admit", cut)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(OTHERS)
    assert cuts
    got = [t for out in engine.outputs_of(ids, owners) for t in out.token_ids]
    assert got == alone["q4"]
    list(stream)
    assert not engine.has_unfinished()


def test_llm_serves_a_speculative_capture_with_plain_steps_when_asked(tmp_path_factory, one_torch_thread):
    """`run --no-speculative` had no Python twin: LLM(speculative=False), with the same tokens."""
    from conftest import tiny_config
    from trtgraph.compiler.pipeline import capture

    art = tmp_path_factory.mktemp("spec-art")
    capture(tiny_config(speculative={"draft_len": 3, "ngram_min": 1, "ngram_max": 2}), art)
    reqs = [dict(r, prompt_token_ids=r["prompt_token_ids"][:4] * 6, max_tokens=20) for r in REQS]
    spec, plain = trtgraph.LLM(art), trtgraph.LLM(art, speculative=False)
    assert [c.token_ids for c in spec.generate(reqs)] == [c.token_ids for c in plain.generate(reqs)]
    assert spec.stats["speculative"]["verify_steps"] > 0 and "speculative" not in plain.stats


def test_a_request_aborted_and_its_id_reused_before_its_consumer_waits_is_left_to_the_newer(llm, alone, monkeypatch):
    """Engine.submit, abort, submit of the same id, then each consumer's outputs_of: the first
    took the newer request's tokens and the newer one's consumer stepped for ever."""
    engine = llm.engine
    monkeypatch.setattr(engine, "step", _StepBound(engine))
    stream = llm.stream(REQS[:1])
    next(stream)  # busy
    old = engine.submit([{"id": "w", "prompt": "old w", "max_tokens": 10}])
    old_owners = engine.owners(old)
    engine.abort("w")
    new = engine.submit([dict(REQS[5], id="w")])
    new_owners = engine.owners(new)
    assert list(engine.outputs_of(old, old_owners)) == []
    assert [t for o in engine.outputs_of(new, new_owners) for t in o.token_ids] == alone["q5"]
    list(stream)


def test_token_ids_in_a_numpy_array_or_a_torch_tensor_are_a_prompt(llm, alone):
    """np.array([...]) of token ids was read as a list of prompts ("prompts[0]: ... got int64")."""
    import numpy as np
    import torch

    ids = list(REQS[2]["prompt_token_ids"])
    want = llm.generate(ids, {"max_tokens": 5})[0].token_ids
    for prompts in (np.array(ids), torch.tensor(ids), [np.array(ids, dtype=np.int32)]):
        assert [c.token_ids for c in llm.generate(prompts, {"max_tokens": 5})] == [want]
    rows = llm.generate(np.array([ids, ids[::-1]]), {"max_tokens": 5})
    assert [c.token_ids for c in rows] == [want, llm.generate(ids[::-1], {"max_tokens": 5})[0].token_ids]
    with pytest.raises(PromptError, match="prompts\\[0\\]"):
        llm.generate(np.array([1.5, 2.0]))


def test_sampling_params_take_n_as_the_readme_says(llm):
    """`SamplingParams(n=2)` raised TypeError (README: SamplingParams holds the table's fields, `n` among them)."""
    from trtgraph import SamplingParams

    sp = SamplingParams(n=3, seed=8, temperature=1.0, max_tokens=4)
    got = llm.generate([REQS[0]["prompt_token_ids"], {"prompt": "own n", "n": 1}], sp)
    assert [len(c.choices or []) for c in got] == [3, 0]
    assert [c.token_ids for c in got[0].choices] == [
        llm.generate(REQS[0]["prompt_token_ids"], {"seed": completion_seed(8, i), "temperature": 1.0,
                                                   "max_tokens": 4})[0].token_ids
        for i in range(3)]
    with pytest.raises(PromptError, match="`n` = 17"):
        SamplingParams(n=17)
