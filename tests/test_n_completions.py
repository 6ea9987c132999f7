"""n > 1: n completions of one prompt share its KV blocks (reference-counted), each draws
with its own derived seed (completion_seed(seed, i)), and the output carries all n; preemption and finishing
never free a block another completion still holds."""

from __future__ import annotations

import pytest

from conftest import generate_with_scheduler
from trtgraph.errors import PromptError
from trtgraph.runtime.serving.requests import completion_seed
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.step.kv_cache import BlockAllocator
from trtgraph.runtime.serving.requests import MAX_N, Result, parse_request

PROMPT = [(7 * j + 3) % 300 for j in range(40)]  # 2 full blocks of 16 before the last prompt token


# ---- the allocator ----------------------------------------------------------------------------

def test_shared_blocks_are_freed_only_by_their_last_holder():
    a = BlockAllocator(6)
    blocks = a.allocate(3)
    assert a.share(blocks[:2]) == blocks[:2] and [a.refs(b) for b in blocks] == [2, 2, 1]
    a.free(blocks)
    assert a.num_free == 5 - 2 and [a.refs(b) for b in blocks] == [1, 1, 0]
    a.free(blocks[:2])
    assert a.num_free == 5 and a.peak_used == 3
    with pytest.raises(ValueError, match="freed twice"):
        a.free(blocks[:1])
    with pytest.raises(ValueError, match="only held blocks"):
        a.share(blocks[:1])
    b = a.allocate(1)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(b + b)
    assert a.allocate(4) == [2, 3, 4, 5] and a.num_free == 0


# ---- the request field ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, MAX_N + 1, True, 2.0, "2"])
def test_n_out_of_range_is_refused_naming_the_field(n):
    with pytest.raises(PromptError, match="field `n`"):
        parse_request({"id": "a", "prompt": "x", "n": n}, "p.jsonl line 1")


def test_n_one_output_is_unchanged_and_n_output_carries_choices():
    one = Result(id="a", text="hi", token_ids=[1, 2], finish_reason="stop", prompt_tokens=3)
    assert set(one.to_json()) == {"id", "text", "token_ids", "finish_reason", "error", "usage", "ttft_ms", "tpot_ms"}
    many = Result(id="a", prompt_tokens=3, choices=[one, Result(id="a", text="x", token_ids=[5])])
    line = many.to_json()
    assert set(line) == {"id", "choices", "error", "usage"}
    assert line["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}
    assert [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in line["choices"]] == \
        [(0, "hi", [1, 2], "stop"), (1, "x", [5], "length")]


# ---- the engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


def request(rid, seed, **kw):
    return {"id": rid, "prompt_token_ids": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": seed, **kw}


def separate(engine, seed, n, **kw):
    """n separate requests with the derived seeds completion_seed(seed, i): (tokens by index, peak blocks)."""
    results, sched = generate_with_scheduler(engine, [request(f"s{i}", completion_seed(seed, i), **kw) for i in range(n)])
    assert sched.allocator.num_free == sched.allocator.num_blocks - 1, "KV blocks leaked"
    return [results[f"s{i}"].token_ids for i in range(n)], sched.allocator.peak_used


def test_n_completions_equal_separate_requests_with_derived_seeds_and_share_the_prompt(engine):
    results, sched = generate_with_scheduler(engine, [request("r", 123, n=4)])
    assert sched.allocator.num_free == sched.allocator.num_blocks - 1, "KV blocks leaked"
    assert engine.stats.prompt_tokens == len(PROMPT) and engine.stats.completion_tokens == 40
    res, shared_peak = results["r"], sched.allocator.peak_used
    assert len(res.choices) == 4 and all(c.finish_reason == "length" for c in res.choices)
    want, separate_peak = separate(engine, 123, 4)
    assert [c.token_ids for c in res.choices] == want
    assert len({tuple(t) for t in want}) > 1, "the derived seeds drew the same tokens: the test proves nothing"
    # 2 prompt blocks shared by 4 completions of 4 blocks each: 2 + 4 * 2 at most, against 4 * 4.
    assert shared_peak <= 10 < separate_peak == 16
    assert res.to_json()["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 40}


def test_n_completions_mixed_with_other_requests_and_stop_early(engine):
    reqs = [request("r", 5, n=3, max_tokens=6), {"id": "plain", "prompt": "Hello", "max_tokens": 4},
            request("g", 9, n=2, temperature=0.0, max_tokens=1)]
    results, sched = generate_with_scheduler(engine, reqs)
    assert sched.allocator.num_free == sched.allocator.num_blocks - 1, "KV blocks leaked"
    assert results["plain"].choices is None and len(results["plain"].token_ids) == 4
    assert [c.token_ids for c in results["r"].choices] == separate(engine, 5, 3, max_tokens=6)[0]
    greedy = [c.token_ids for c in results["g"].choices]
    assert len(greedy) == 2 and greedy[0] == greedy[1] and len(greedy[0]) == 1


def test_n_completions_survive_preemption_without_freeing_shared_blocks(small_kv_artifacts, one_torch_thread):
    """20 blocks: four completions of 40 + 60 tokens (7 blocks each) cannot all run at once."""
    engine = Engine(small_kv_artifacts)
    results, sched = generate_with_scheduler(engine, [request("r", 77, n=4, max_tokens=60)])
    assert sched.num_preemptions > 0, "the cache was not tight enough to preempt"
    assert sched.allocator.num_free == sched.allocator.num_blocks - 1, "KV blocks leaked"
    want, _ = separate(engine, 77, 4, max_tokens=60)
    assert [c.token_ids for c in results["r"].choices] == want


# ---- the scheduler alone: reference counts hold on every step ---------------------------------

def run_forking_scheduler(specs, num_blocks: int, block_size: int = 16):
    """Drive a Scheduler like the engine (fork after a request's first token), fake tokens
    by (request, completion, position); check every block's count against its holders."""
    from collections import Counter

    from conftest import tiny_config
    from trtgraph.buckets import BucketPlan
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Scheduler, Sequence

    sched = Scheduler(BucketPlan.from_config(tiny_config()), num_blocks, block_size)
    for i, (plen, max_tokens, n) in enumerate(specs):
        req = Request(id=f"r{i}", prompt_token_ids=tuple(range(plen)), max_tokens=max_tokens, n=n)
        sched.add(Sequence(request=req, arrival=i, prompt_ids=list(req.prompt_token_ids), seed=0))
    forked, done = set(), []
    for _ in range(20000):
        step = sched.schedule()
        if step is None:
            if not sched.has_work:
                break
            continue
        tokens = [hash((s.request.id, s.index, len(s.output_ids))) % 300 for s in step.seqs]
        for seq, _ in sched.advance(step, tokens):
            if seq.request.n > 1 and seq.request.id not in forked:
                forked.add(seq.request.id)
                sched.fork(seq, [0] * (seq.request.n - 1))
            if len(seq.output_ids) == seq.request.max_tokens:
                sched.finish(seq)
                done.append(seq)
        holders = Counter(b for s in sched.running for b in s.block_table)
        assert all(sched.allocator.refs(b) == k for b, k in holders.items()), "a block's count != its holders"
        assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
        assert len(holders) + sched.allocator.num_free == num_blocks - 1, "KV blocks leaked"
    assert not sched.has_work and sched.allocator.num_free == num_blocks - 1
    return sched, done


@pytest.mark.parametrize("num_blocks", [17, 24, 200])
def test_forked_completions_keep_counts_right_through_preemption(num_blocks):
    specs = [(40, 60, 4), (17, 30, 3), (5, 20, 2), (100, 50, 1), (33, 80, 5)]
    sched, done = run_forking_scheduler(specs, num_blocks)
    assert sorted((s.request.id, s.index) for s in done) == \
        sorted((f"r{i}", k) for i, (_, _, n) in enumerate(specs) for k in range(n))
    for s in done:
        assert s.output_ids == [hash((s.request.id, s.index, j)) % 300 for j in range(s.request.max_tokens)]
    if num_blocks < 100:
        assert sched.num_preemptions > 0
    else:
        assert sched.num_preemptions == 0
