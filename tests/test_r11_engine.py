"""The engine under load (eleventh session's adversarial pass, R11e): preemption and
re-admission, chunked prompts, penalties, aborts and id reuse, counters, KV blocks.

Defect found: a row with logits processors (penalties, logit_bias, min_tokens) whose prompt
(or, after preemption, prompt + generated tokens) was chunked so that exactly one token was
left fed that token in a decode step, which never scans its fed token: the last prompt
token's "in the prompt" bit (repetition_penalty) or, for a recomputed sequence, its last
generated token's count (repetition / presence / frequency penalties) was missing from the
slot's counts, so the row's tokens changed with its chunking and with preemption.
"""

from __future__ import annotations

import math
import random

import pytest

from trtgraph.kernels.sampler_reference import PROMPT_BIT
from trtgraph.runtime.serving.engine import Engine


@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


@pytest.fixture(scope="module")
def small(small_kv_artifacts, one_torch_thread):
    return Engine(small_kv_artifacts)


def drain(engine: Engine, outputs: dict | None = None, max_steps: int = 3000) -> dict:
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.id, []).append(out)
    raise AssertionError("the engine did not go idle")


def all_free(engine: Engine) -> None:
    s = engine.scheduler
    assert s.allocator.num_free == engine.executor.num_blocks - 1
    assert sorted(s.free_slots) == list(range(s.plan.max_batch_size))
    assert not s.running and not s.waiting and not s._retired


@pytest.mark.parametrize("plen", [17, 65, 81])
def test_penalised_row_sets_the_prompt_bit_of_every_prompt_token(engine, plen):
    """A prompt of chunk + 1 tokens: its last token must count as in the prompt too."""
    prompt = [(11 * j + 3) % 290 for j in range(plen)]
    engine.add_request({"id": f"p{plen}", "prompt_token_ids": prompt, "max_tokens": 3,
                        "repetition_penalty": 1.3})
    seq = engine._live[f"p{plen}"].seq
    slot = None
    while engine.has_unfinished():
        engine.step()
        slot = seq.slot if seq.slot is not None else slot
    counts = engine.executor.buffers.state["token_counts"][slot]
    assert [t for t in set(prompt) if not int(counts[t]) & PROMPT_BIT] == []
    all_free(engine)


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.3}, {"presence_penalty": 0.5},
                                     {"frequency_penalty": 0.3}])
def test_penalised_greedy_row_preempted_gets_its_tokens_alone(small, penalty):
    """20 KV blocks: the second request is preempted and recomputed (prompt + generated);
    its penalties must count the same tokens as when it runs alone."""
    a = {"id": "a", "prompt_token_ids": [(3 * j) % 300 for j in range(100)], "max_tokens": 150}
    b = {"id": "b", "prompt_token_ids": [(7 * j + 1) % 300 for j in range(100)], "max_tokens": 150, **penalty}
    before = small.scheduler.num_preemptions
    both = {r.id: r for r in small.generate([a, b])}
    assert small.scheduler.num_preemptions > before
    alone = next(iter(small.generate([b])))
    assert both["b"].token_ids == alone.token_ids
    all_free(small)


def _mixed(rng: random.Random, i: int) -> dict:
    plen = rng.choice([1, 16, 17, 64, 65, 120, 200])
    r = {"id": f"m{i}", "prompt_token_ids": [rng.randrange(300) for _ in range(plen)],
         "max_tokens": rng.choice([1, 40, 256 - plen, 256 - plen])}
    if rng.random() < .4:
        r.update(temperature=0.9, seed=rng.randrange(100), top_k=20)
    if rng.random() < .3:
        r.update(logprobs=1)
    if rng.random() < .3:
        r.update(repetition_penalty=1.2, frequency_penalty=0.2)
    if rng.random() < .2:
        r.update(stop=["e"])
    if rng.random() < .15:
        r.update(n=2, temperature=0.8, seed=rng.randrange(100))
    return r


def test_mixed_load_with_preemption_aborts_and_id_reuse(small):
    """Requests arriving while others run on a cache barely big enough, aborts at several
    phases, an aborted id reused at once: every finished request gets its tokens alone, the
    counters add up, and every block and slot is free at the end."""
    rng = random.Random(7)
    reqs = [_mixed(rng, i) for i in range(12)]
    small.start_run()
    outputs: dict = {}
    aborted, reused = set(), {}
    for step in range(3000):
        if step < len(reqs):
            small.add_request(reqs[step])
        if step in (5, 14, 30):
            rid = reqs[{5: 1, 14: 3, 30: 6}[step]]["id"]
            if small.abort(rid):
                aborted.add(rid)
                small.step()  # the abort applies; then the id is free again
                again = dict(next(r for r in reqs if r["id"] == rid), max_tokens=3)
                small.add_request(again)
                reused[rid] = again
                outputs.pop(rid, None)
        if step >= len(reqs) and not small.has_unfinished():
            break
        for out in small.step():
            outputs.setdefault(out.id, []).append(out)
    assert not small.has_unfinished()
    stats = small.stats.to_json()
    assert stats["preemptions"] > 0 and reused and stats["aborted"] == len(aborted), (stats, reused, aborted)
    for k, v in stats.items():
        assert not isinstance(v, (int, float)) or (v >= 0 and not math.isnan(v)), (k, v)
    assert stats["steps"] == sum(stats["steps_per_key"].values())
    done = [o[-1].result for o in outputs.values()]
    assert stats["completion_tokens"] == sum(len(c.token_ids) for r in done for c in (r.choices or [r]))
    for r in done:
        for c in r.choices or [r]:
            assert c.ttft_ms >= 0 and (c.tpot_ms is None or c.tpot_ms >= 0)
    all_free(small)
    for req in reqs:
        req = reused.get(req["id"], req)
        got = outputs[req["id"]][-1].result
        alone = next(iter(small.generate([req])))
        assert [c.token_ids for c in got.choices or [got]] == [c.token_ids for c in alone.choices or [alone]], req["id"]


def test_aborted_n_request_counts_no_completion_tokens(small):
    """n = 3, aborted once one completion has finished: none is handed out, so none counts in
    the run's completion_tokens (an aborted n = 1 request counts none either)."""
    small.start_run()
    small.add_request({"id": "nx", "prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 30, "n": 3,
                       "temperature": 1.0, "seed": 1, "stop": ["a", "b", "c", "d", "e"]})
    delivered, aborted = 0, False
    for _ in range(500):
        outs = small.step()
        delivered += sum(len(o.token_ids) for o in outs)
        done = small._choices.get("nx")
        if not aborted and done and any(done) and not all(done):
            aborted = small.abort("nx")
        if not small.has_unfinished():
            break
    assert aborted and delivered == 0
    assert small.stats.completion_tokens == 0 and small.stats.aborted == 1
    all_free(small)
