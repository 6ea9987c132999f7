"""The Python API (trtgraph/runtime/serving/llm.py): prompts in every accepted form, sampling given
once, typed completions that serialise to `run`'s JSONL, incremental streams, and any
interleaving of generate/stream calls on one LLM giving each request its tokens alone."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trtgraph
from trtgraph.errors import PromptError
import oracle

RESULT_FIELDS = {"id", "text", "token_ids", "finish_reason", "error", "usage", "ttft_ms", "tpot_ms"}

POOL = [
    {"id": "g1", "prompt": "interleaved one", "max_tokens": 7},
    {"id": "g2", "prompt_token_ids": [(5 * j) % 290 for j in range(23)], "max_tokens": 5},
    {"id": "s1", "prompt": "sampled ¿qué?", "max_tokens": 6, "temperature": 0.8, "top_k": 30, "seed": 21},
    {"id": "s2", "prompt": "sampled two", "max_tokens": 8, "temperature": 1.1, "top_p": 0.9, "seed": 4},
    {"id": "g3", "prompt": "x", "max_tokens": 3},
]


@pytest.fixture(scope="module")
def llm(default_artifacts, one_torch_thread):
    return trtgraph.LLM(default_artifacts)


@pytest.fixture(scope="module")
def alone(llm):
    """Each pool request served by itself."""
    return {r["id"]: llm.generate([r])[0].token_ids for r in POOL}


def test_alone_is_the_oracle(llm, alone):
    loaded = llm.engine.executor.loaded
    assert alone["g1"] == oracle.generate(loaded, list(b"interleaved one"), 7)
    assert alone["s1"] == oracle.generate(loaded, list("sampled ¿qué?".encode()), 6, temperature=0.8, top_k=30,
                                          seed=21)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_interleavings_of_generate_and_stream_equal_one_at_a_time(llm, alone, data):
    reqs = data.draw(st.permutations(POOL))
    groups, i = [], 0
    while i < len(reqs):
        n = data.draw(st.integers(1, 2))
        groups.append((data.draw(st.sampled_from(["generate", "stream"])), reqs[i:i + n]))
        i += n
    got, live, names = {}, {}, itertools.count()  # live: name -> (iterator, {id: [deltas]})
    while groups or live:
        if groups and (not live or data.draw(st.booleans())):
            kind, group = groups.pop(0)
            if kind == "generate":
                got.update({c.id: c.token_ids for c in llm.generate(group)})
            else:
                live[next(names)] = (iter(llm.stream(group)), {})
            continue
        key = data.draw(st.sampled_from(sorted(live)))
        it, deltas = live[key]
        d = next(it, None)
        if d is None:
            del live[key]
            continue
        deltas.setdefault(d.id, []).append(d)
        if d.finished:
            assert sum((x.token_ids for x in deltas[d.id]), []) == d.completion.token_ids
            assert "".join(x.text for x in deltas[d.id]) == d.completion.text
            got[d.id] = d.completion.token_ids
    assert got == alone
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.allocator.num_free == llm.engine.executor.num_blocks - 1


def test_two_streams_consumed_alternately_get_their_own_tokens(llm, alone):
    a = llm.stream([POOL[0], POOL[2]])
    b = llm.stream([POOL[3], POOL[1]])
    got, count = {}, {}
    for x, y in zip(a, b):  # strictly alternating; zip stops at the shorter, finish the other
        for d in (x, y):
            count[d.id] = count.get(d.id, 0) + 1
            if d.finished:
                got[d.id] = d.completion.token_ids
    for d in list(a) + list(b):
        count[d.id] = count.get(d.id, 0) + 1
        if d.finished:
            got[d.id] = d.completion.token_ids
    assert got == {r["id"]: alone[r["id"]] for r in POOL[:4]}
    assert count["g1"] > 1 and count["s2"] > 1  # incremental: a delta per step, not one at the end


def test_prompt_forms_and_generated_ids(llm, alone):
    ids = list("interleaved one".encode())
    outs = llm.generate(["interleaved one", ids, np.array(ids, dtype=np.int64).tolist(),
                         [np.int64(t) for t in ids], {"prompt": "interleaved one"}], {"max_tokens": 7})
    assert [c.token_ids for c in outs] == [alone["g1"]] * 5
    assert len({c.id for c in outs}) == 5
    (one,) = llm.generate("interleaved one", {"max_tokens": 7})
    assert one.token_ids == alone["g1"]
    (toks,) = llm.generate(ids, {"max_tokens": 7})
    assert toks.token_ids == alone["g1"] and toks.usage.prompt_tokens == len(ids)
    # a dict prompt's own fields win over `sampling`
    (own,) = llm.generate([{"prompt": "interleaved one", "max_tokens": 2}], {"max_tokens": 7})
    assert own.token_ids == alone["g1"][:2]


def test_sampling_goes_through_the_jsonl_validator(llm, alone):
    s1 = {k: v for k, v in POOL[2].items() if k not in ("id", "prompt")}
    (c,) = llm.generate("sampled ¿qué?", s1)
    assert c.token_ids == alone["s1"]
    with pytest.raises(PromptError, match=r"prompts\[0\]: field `temperature`"):
        llm.generate("hi", {"temperature": -1})
    with pytest.raises(PromptError, match="unknown field.*bogus"):
        llm.generate("hi", {"bogus": 1})
    with pytest.raises(PromptError, match="`prompt` is not a sampling field"):
        llm.generate("hi", {"prompt": "x"})
    with pytest.raises(PromptError, match=r"prompts\[1\]: a prompt is a string"):
        llm.generate(["ok", 3.5])


def test_completions_are_typed_and_serialise_to_the_run_jsonl(llm):
    outs = llm.generate([{"id": "a", "prompt": "typed", "max_tokens": 4},
                         {"id": "r", "prompt_token_ids": [5] * 250, "max_tokens": 50}])
    a, r = outs
    assert isinstance(a, trtgraph.Completion) and isinstance(a.usage, trtgraph.Usage)
    assert isinstance(a.timings, trtgraph.Timings) and a.timings.ttft_ms >= 0
    body = a.to_json()
    assert set(body) == RESULT_FIELDS and body["token_ids"] == a.token_ids and body["text"] == a.text
    assert body["usage"] == {"prompt_tokens": a.usage.prompt_tokens, "completion_tokens": 4}
    assert a.usage.total_tokens == a.usage.prompt_tokens + 4
    assert r.finish_reason == "error" and "max_seq_len" in r.error and r.to_json()["error"] == r.error
    json.dumps([c.to_json() for c in outs])
    for name in trtgraph.__all__:
        assert getattr(trtgraph, name) is not None


def test_text_longer_than_any_prompt_that_fits_is_refused_before_encoding(llm, monkeypatch):
    """A prompt whose text no max_seq_len tokens can cover is refused without encoding it (a
    30 MB prompt held a server's engine thread for 82 s in the tokenizer); the rest still encode."""
    admission = llm.engine.admission
    most = admission.max_seq_len * admission.tokenizer.max_token_chars * 8
    encoded = []
    real = admission.tokenizer.encode
    monkeypatch.setattr(admission.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or real(text, **kw))
    huge, ok = llm.generate([{"id": "huge", "prompt": "x" * (most + 1), "max_tokens": 2},
                             {"id": "ok", "prompt": "fits", "max_tokens": 2}])
    assert huge.finish_reason == "error" and "refused before encoding" in huge.error and "max_seq_len" in huge.error
    assert ok.finish_reason != "error" and encoded == [4]


def test_closing_a_stream_early_aborts_its_requests(llm):
    it = llm.stream([{"id": "cut", "prompt": "cut short", "max_tokens": 60}])
    first = next(it)
    assert first.id == "cut" and not first.finished
    it.close()
    llm.generate("afterwards")  # the abort is applied at this call's first step
    engine = llm.engine
    assert not engine.has_unfinished() and engine.stats.aborted == 1
    assert engine.scheduler.allocator.num_free == engine.executor.num_blocks - 1
    assert all(s.request.id != "cut" for s in engine.scheduler.running + list(engine.scheduler.waiting))


def test_chat_refuses_what_is_not_a_conversation(llm):
    for bad in ([], "hello", [[]]):
        with pytest.raises(PromptError):
            llm.chat(bad)



def test_a_stream_closed_late_leaves_a_later_request_with_its_id_alone(llm):
    """A stream left after its request finished (a `break` at the last delta) is closed later:
    it must not abort a newer request that reuses the id, which would then never finish."""
    old = llm.stream({"id": "x", "prompt": "hi", "max_tokens": 3})
    for d in old:
        if d.finished:
            break  # `old` stays suspended at its last delta
    new = llm.stream({"id": "x", "prompt": "hello", "max_tokens": 12})
    got = [next(new)]
    old.close()  # its clean-up runs now, while the new "x" is being served
    got += list(new)
    assert got[-1].finished and got[-1].completion.finish_reason == "length"
    assert sum(len(d.token_ids) for d in got) == 12


def test_a_request_aborted_by_another_consumer_ends_the_wait_for_it(llm):
    """Engine.abort of a request another consumer waits for ends that wait instead of stepping
    an idle engine for ever: a stream goes on without it, generate() names it."""
    stream = llm.stream([{"id": "kept", "prompt": "a", "max_tokens": 6}, {"id": "gone", "prompt": "b", "max_tokens": 40}])
    seen = [next(stream)]
    assert llm.engine.abort("gone")
    seen += list(stream)
    assert {d.id for d in seen if d.finished} == {"kept"} and not llm.engine.has_unfinished()

    engine = llm.engine
    submit = engine.submit

    def submit_then_abort(reqs, *args, **kwargs):
        ids = submit(reqs, *args, **kwargs)
        engine.abort(ids[-1])  # as another consumer would, between its submit and its wait
        return ids

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "submit", submit_then_abort)
        with pytest.raises(PromptError, match="'gone2' was aborted"):
            llm.generate([{"id": "kept2", "prompt": "a", "max_tokens": 4}, {"id": "gone2", "prompt": "b", "max_tokens": 40}])
    assert not engine.has_unfinished()
    assert [c.finish_reason for c in llm.generate(["again"], {"max_tokens": 3})] == ["length"]


def test_an_interrupted_generate_leaves_nothing_served_for_nobody(llm):
    """Ctrl-C inside LLM.generate (or an Engine.generate left early): its unfinished requests
    are aborted, not served on by later calls with their outputs held for nobody (and the
    engine never idle again, its collector off)."""
    import gc

    from trtgraph.runtime.serving.engine import Engine

    engine, step, calls = llm.engine, Engine.step, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([f"p{i}" for i in range(12)], {"max_tokens": 30})
    assert [c.finish_reason for c in llm.generate(["hi"], {"max_tokens": 2})] == ["length"]
    assert not engine.has_unfinished() and not engine._undelivered and gc.isenabled()

    results = engine.generate([{"id": f"g{i}", "prompt": "x", "max_tokens": 20 + i} for i in range(6)])
    next(results)
    results.close()  # left early
    assert [c.finish_reason for c in llm.generate(["hi"], {"max_tokens": 2})] == ["length"]
    assert not engine.has_unfinished() and not engine._undelivered and gc.isenabled()
    assert engine.scheduler.allocator.num_free == engine.executor.num_blocks - 1
