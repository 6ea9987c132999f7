"""Graph keys, the bucket plan, select() and the coverage proof (trtgraph/buckets.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtgraph.buckets import GREEDY, SAMPLED, BatchShape, BucketPlan, GraphKey, select, uncovered_shapes
from trtgraph.config import Config
from trtgraph.errors import BucketMissError, TrtgraphError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama-3.2-1b-synthetic.yaml"


def make_config(max_batch_size=8, batch_sizes="auto", context_batch_sizes=(1, 2, 4), chunk_sizes=(16, 64),
                draft_lens=(0,), sampling=(GREEDY, SAMPLED), max_num_tokens=4096) -> Config:
    return Config.from_dict({
        "model": {"synthetic": {"architecture": "LlamaForCausalLM", "seed": 0}},
        "limits": {"max_batch_size": max_batch_size, "max_seq_len": 256, "max_num_tokens": max_num_tokens},
        "buckets": {"batch_sizes": batch_sizes if batch_sizes == "auto" else list(batch_sizes),
                    "context_batch_sizes": context_batch_sizes if context_batch_sizes == "auto" else
                    list(context_batch_sizes), "chunk_sizes": list(chunk_sizes),
                    "draft_lens": list(draft_lens), "sampling": list(sampling)},
    })


def plan_of(**kw) -> BucketPlan:
    return BucketPlan.from_config(make_config(**kw))


@pytest.fixture(scope="module")
def default_plan() -> BucketPlan:
    return BucketPlan.from_config(Config.default())


# ---- GraphKey ------------------------------------------------------------------------------

def test_graph_key_is_frozen():
    key = GraphKey(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.batch_size = 8  # type: ignore[misc]
    assert key.batch_size == 4


def test_graph_key_defaults_are_a_greedy_decode_step():
    key = GraphKey(4)
    assert (key.batch_size, key.draft_len, key.chunk_size, key.sampling) == (4, 0, 0, GREEDY)
    assert not key.is_prefill


def test_graph_keys_are_hashable_and_compare_by_value():
    assert GraphKey(2, 0, 16, SAMPLED) == GraphKey(2, 0, 16, SAMPLED)
    assert GraphKey(2, 0, 16, SAMPLED) != GraphKey(2, 0, 16, GREEDY)
    assert len({GraphKey(2), GraphKey(2), GraphKey(2, sampling=SAMPLED)}) == 2


def test_graph_keys_are_ordered_by_batch_then_draft_then_chunk_then_sampling():
    keys = [GraphKey(8), GraphKey(1, 0, 64), GraphKey(1, 2), GraphKey(1, 0, 16), GraphKey(1),
            GraphKey(1, sampling=SAMPLED), GraphKey(2)]
    assert sorted(keys) == [GraphKey(1), GraphKey(1, sampling=SAMPLED), GraphKey(1, 0, 16), GraphKey(1, 0, 64),
                            GraphKey(1, 2), GraphKey(2), GraphKey(8)]
    assert GraphKey(1, 5, 512) < GraphKey(2)
    assert GraphKey(4, 0, 0, GREEDY) < GraphKey(4, 0, 0, SAMPLED)


@pytest.mark.parametrize("key,q_len,num_tokens,logit_rows,prefill", [
    (GraphKey(1), 1, 1, 1, False),
    (GraphKey(8), 1, 8, 8, False),  # decode: one token and one logit row per sequence
    (GraphKey(8, sampling=SAMPLED), 1, 8, 8, False),
    (GraphKey(4, draft_len=3), 4, 16, 16, False),  # verify: q = 1 + k, every token is scored
    (GraphKey(1, draft_len=1), 2, 2, 2, False),
    (GraphKey(2, chunk_size=64), 64, 128, 2, True),  # prefill: q = chunk, one logit row per sequence
    (GraphKey(4, chunk_size=16, sampling=SAMPLED), 16, 64, 4, True),
    (GraphKey(1, chunk_size=1), 1, 1, 1, True),
])
def test_graph_key_shapes(key, q_len, num_tokens, logit_rows, prefill):
    assert key.q_len == q_len
    assert key.num_tokens == num_tokens
    assert key.num_logit_rows == logit_rows
    assert key.is_prefill is prefill


def test_graph_key_as_dict_round_trips():
    key = GraphKey(4, 2, 0, SAMPLED)
    assert key.as_dict() == {"batch_size": 4, "draft_len": 2, "chunk_size": 0, "sampling": SAMPLED}
    assert GraphKey(**key.as_dict()) == key


# ---- BucketPlan.from_config -------------------------------------------------------------------

def test_auto_context_batch_sizes_fill_max_num_tokens_per_chunk_size():
    plan = plan_of(max_batch_size=64, context_batch_sizes="auto", chunk_sizes=(16, 128, 256), max_num_tokens=4096)
    most = {c: plan.max_key_batch(chunk_size=c) for c in (16, 128, 256)}
    assert most == {16: 64, 128: 32, 256: 16}  # min(max_batch_size, max_num_tokens // chunk)
    sizes = [k.batch_size for k in plan.keys if k.chunk_size == 128 and k.sampling == GREEDY]
    assert sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32]  # every size below 8, then multiples of 8
    assert uncovered_shapes(plan) == []



def test_default_plan_key_set(default_plan):
    gen = {GraphKey(bs, 0, 0, s) for bs in (1, 2, 4, 8) for s in (GREEDY, SAMPLED)}
    # context_batch_sizes: auto, max_num_tokens 256: chunk 16 up to 8 rows (max_batch_size), chunk 64 up to 4
    pre = {GraphKey(bs, 0, c, s) for c, most in ((16, 8), (64, 4)) for bs in range(1, most + 1)
           for s in (GREEDY, SAMPLED)}
    assert set(default_plan.keys) == gen | pre
    assert len(default_plan.keys) == 8 + 24  # no duplicates
    assert list(default_plan.keys) == sorted(default_plan.keys)
    assert default_plan.max_batch_size == 8
    assert default_plan.max_context_batch_size == 8
    assert default_plan.chunk_sizes == (16, 64)
    assert default_plan.draft_lens == (0,)
    assert default_plan.sampling == (GREEDY, SAMPLED)


def test_example_plan_key_set():
    plan = BucketPlan.from_config(Config.from_yaml(EXAMPLE))
    gen_sizes = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    gen = {GraphKey(bs, 0, 0, s) for bs in gen_sizes for s in (GREEDY, SAMPLED)}
    # context_batch_sizes: auto with max_num_tokens 8192: up to 64 rows of 64, 32 of 256, 16 of 512
    small = (1, 2, 3, 4, 5, 6, 7)
    ctx = {64: small + gen_sizes[3:], 256: small + (8, 16, 24, 32), 512: small + (8, 16)}
    pre = {GraphKey(bs, 0, c, s) for c, sizes in ctx.items() for bs in sizes for s in (GREEDY, SAMPLED)}
    assert set(plan.keys) == gen | pre


def test_plan_with_drafts_and_one_sampling_mode():
    plan = plan_of(batch_sizes=(2, 8), context_batch_sizes=(1,), chunk_sizes=(32,), draft_lens=(0, 3),
                   sampling=(SAMPLED,))
    assert set(plan.keys) == {GraphKey(2, 0, 0, SAMPLED), GraphKey(8, 0, 0, SAMPLED), GraphKey(2, 3, 0, SAMPLED),
                              GraphKey(8, 3, 0, SAMPLED), GraphKey(1, 0, 32, SAMPLED)}
    assert plan.draft_lens == (0, 3)
    assert plan.max_key_batch(draft_len=3) == 8
    assert plan.max_key_batch(chunk_size=32) == 1
    assert plan.max_key_batch(chunk_size=999) == 0


def test_with_keys_keeps_limits_and_rebuilds_the_index(default_plan):
    keys = [k for k in default_plan.keys if k.batch_size != 8]
    smaller = default_plan.with_keys(keys)
    assert set(smaller.keys) == set(keys)
    assert (smaller.max_batch_size, smaller.max_context_batch_size, smaller.chunk_sizes, smaller.draft_lens,
            smaller.sampling) == (8, 8, (16, 64), (0,), (GREEDY, SAMPLED))
    assert select(default_plan, BatchShape(5)) == GraphKey(8)
    with pytest.raises(BucketMissError):
        select(smaller, BatchShape(5))


# ---- select() ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,expected_bs", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8)])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_select_smallest_fitting_generation_key(default_plan, n, expected_bs, sampling):
    assert select(default_plan, BatchShape(n, sampling=sampling)) == GraphKey(expected_bs, 0, 0, sampling)


@pytest.mark.parametrize("n,chunk,expected_bs", [(1, 16, 1), (3, 16, 3), (8, 16, 8), (2, 64, 2), (4, 64, 4)])
def test_select_smallest_fitting_prefill_key(default_plan, n, chunk, expected_bs):
    assert select(default_plan, BatchShape(n, chunk_size=chunk)) == GraphKey(expected_bs, 0, chunk, GREEDY)
    got = select(default_plan, BatchShape(n, chunk_size=chunk, sampling=SAMPLED))
    assert got == GraphKey(expected_bs, 0, chunk, SAMPLED)


def test_select_with_draft_len():
    plan = plan_of(batch_sizes=(1, 4, 8), draft_lens=(0, 2))
    assert select(plan, BatchShape(3, draft_len=2)) == GraphKey(4, 2, 0, GREEDY)
    assert select(plan, BatchShape(3)) == GraphKey(4, 0, 0, GREEDY)
    assert select(plan, BatchShape(6, draft_len=2, sampling=SAMPLED)) == GraphKey(8, 2, 0, SAMPLED)


def test_greedy_batch_prefers_greedy_key_at_equal_size(default_plan):
    # both a greedy and a sampled key of size 4 exist; keys are stored sampled-after-greedy,
    # so insert them in the other order too
    for plan in (default_plan, default_plan.with_keys(reversed(default_plan.keys))):
        assert select(plan, BatchShape(3, sampling=GREEDY)).sampling == GREEDY


def test_greedy_batch_takes_a_smaller_sampled_key_over_a_larger_greedy_one():
    plan = plan_of().with_keys([GraphKey(4, sampling=GREEDY), GraphKey(2, sampling=SAMPLED),
                                GraphKey(8, sampling=SAMPLED)])
    assert select(plan, BatchShape(2, sampling=GREEDY)) == GraphKey(2, sampling=SAMPLED)
    assert select(plan, BatchShape(3, sampling=GREEDY)) == GraphKey(4, sampling=GREEDY)


def test_sampled_batch_never_gets_a_greedy_key():
    plan = plan_of().with_keys([GraphKey(1, sampling=GREEDY), GraphKey(2, sampling=GREEDY),
                                GraphKey(4, sampling=SAMPLED), GraphKey(8, sampling=GREEDY)])
    for n in (1, 2, 3, 4):
        assert select(plan, BatchShape(n, sampling=SAMPLED)) == GraphKey(4, sampling=SAMPLED)
    for n in (5, 8):
        with pytest.raises(BucketMissError):
            select(plan, BatchShape(n, sampling=SAMPLED))


@pytest.mark.parametrize("n", range(1, 9))
def test_greedy_batch_falls_back_to_sampled_key_on_sampled_only_plan(n):
    plan = plan_of(sampling=(SAMPLED,))
    assert all(k.sampling == SAMPLED for k in plan.keys)
    key = select(plan, BatchShape(n, sampling=GREEDY))
    assert key.sampling == SAMPLED
    assert key.batch_size == min(b for b in (1, 2, 4, 8) if b >= n)
    pre = select(plan, BatchShape(min(n, 4), chunk_size=16, sampling=GREEDY))
    assert pre.sampling == SAMPLED and pre.chunk_size == 16


def _greedy_only_plan():
    return plan_of(sampling=(GREEDY,))


MISSES = [
    pytest.param(lambda: Config.default(), BatchShape(9), "(bs=8, decode draft=0, greedy)", id="above-largest"),
    pytest.param(lambda: Config.default(), BatchShape(5, chunk_size=64), "(bs=4, prefill chunk=64, greedy)",
                 id="prefill-above-largest-context"),
    pytest.param(lambda: Config.default(), BatchShape(2, chunk_size=32), "prefill chunk=", id="unknown-chunk"),
    pytest.param(lambda: Config.default(), BatchShape(2, draft_len=3), "decode draft=0", id="draft-not-recorded"),
    pytest.param(lambda: make_config(sampling=(GREEDY,)), BatchShape(2, sampling=SAMPLED),
                 "(bs=2, decode draft=0, greedy)", id="sampled-on-greedy-only"),
    pytest.param(lambda: Config.default(), BatchShape(0), "(bs=1, decode draft=0, greedy)", id="empty-batch"),
    pytest.param(lambda: Config.default(), BatchShape(2, sampling="beam"), "decode draft=0", id="unknown-mode"),
]


@pytest.mark.parametrize("make,batch,near", MISSES)
def test_select_miss_names_batch_and_recorded_keys(make, batch, near):
    plan = BucketPlan.from_config(make())
    with pytest.raises(BucketMissError) as info:
        select(plan, batch)
    assert isinstance(info.value, TrtgraphError)
    msg = str(info.value)
    assert str(batch) in msg, msg
    assert f"batch of {batch.num_seqs}" in msg
    assert "nearest recorded keys" in msg
    listed = [str(k) for k in plan.keys if str(k) in msg]
    assert listed, msg
    assert near in msg, msg
    assert "none" not in msg.split("nearest recorded keys:", 1)[1].split(".", 1)[0]


def test_miss_on_plan_without_keys_says_none():
    plan = plan_of().with_keys([])
    with pytest.raises(BucketMissError, match=r"nearest recorded keys: none"):
        select(plan, BatchShape(1))


# ---- property: select() is the smallest fitting key -------------------------------------------

@st.composite
def plan_and_batch(draw):
    max_bs = draw(st.integers(1, 48))
    sizes = draw(st.sets(st.integers(1, max_bs), max_size=8)) | {max_bs}
    sampling = draw(st.sampled_from([(GREEDY,), (SAMPLED,), (GREEDY, SAMPLED), (SAMPLED, GREEDY)]))
    drafts = draw(st.sets(st.integers(1, 4), max_size=2)) | {0}
    plan = plan_of(max_batch_size=max_bs, batch_sizes=sorted(sizes), context_batch_sizes=(1,), chunk_sizes=(16,),
                   draft_lens=sorted(drafts), sampling=sampling, max_num_tokens=1024)
    n = draw(st.integers(1, max_bs))
    mode = draw(st.sampled_from([GREEDY, SAMPLED]))
    if SAMPLED not in sampling:
        mode = GREEDY  # a greedy-only plan never sees sampled batches (that miss is tested above)
    draft = draw(st.sampled_from(sorted(drafts)))
    return plan, sorted(sizes), BatchShape(n, draft_len=draft, sampling=mode)


def _serves(key: GraphKey, batch: BatchShape) -> bool:
    return (key.chunk_size == batch.chunk_size and key.draft_len == batch.draft_len
            and (key.sampling == SAMPLED or batch.sampling == GREEDY))


@settings(max_examples=200, deadline=None)
@given(plan_and_batch())
def test_select_returns_smallest_fitting_key(case):
    plan, sizes, batch = case
    key = select(plan, batch)
    assert key in plan.keys
    assert _serves(key, batch)
    assert key.batch_size >= batch.num_seqs
    smaller = [k for k in plan.keys if _serves(k, batch) and batch.num_seqs <= k.batch_size < key.batch_size]
    assert not smaller, (key, smaller)
    assert key.batch_size == min(b for b in sizes if b >= batch.num_seqs)
    if batch.sampling == GREEDY and GREEDY in plan.sampling:
        assert key.sampling == GREEDY


@settings(max_examples=50, deadline=None)
@given(plan_and_batch())
def test_plans_with_max_batch_size_are_covered(case):
    plan, _, _ = case
    assert uncovered_shapes(plan) == []


# ---- uncovered_shapes() -----------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    Config.default,
    lambda: Config.from_yaml(EXAMPLE),
    lambda: make_config(max_batch_size=20),
    lambda: make_config(batch_sizes=(3, 8), draft_lens=(0, 1, 4), sampling=(SAMPLED,)),
    lambda: make_config(max_batch_size=1, batch_sizes=(1,), context_batch_sizes=(1,), sampling=(GREEDY,)),
], ids=["default", "example", "auto-20", "drafts-sampled", "single"])
def test_valid_configs_are_covered(make):
    assert uncovered_shapes(BucketPlan.from_config(make())) == []


def test_dropping_largest_generation_keys_reports_the_range(default_plan):
    keys = [k for k in default_plan.keys if not (k.chunk_size == 0 and k.batch_size == 8)]
    misses = uncovered_shapes(default_plan.with_keys(keys))
    assert len(misses) == 2, misses
    assert all("generation batches of 5-8" in m for m in misses)
    assert any(GREEDY in m for m in misses) and any(SAMPLED in m for m in misses)
    assert all("prefill" not in m for m in misses)


def test_dropping_largest_sampled_generation_key_reports_only_sampled(default_plan):
    keys = [k for k in default_plan.keys if k != GraphKey(8, 0, 0, SAMPLED)]
    misses = uncovered_shapes(default_plan.with_keys(keys))
    assert len(misses) == 1, misses
    assert "generation batches of 5-8" in misses[0]
    assert SAMPLED in misses[0] and GREEDY not in misses[0]


def test_dropping_largest_greedy_generation_key_is_still_covered(default_plan):
    # greedy batches of 5-8 fall back to the sampled key of size 8
    keys = [k for k in default_plan.keys if k != GraphKey(8, 0, 0, GREEDY)]
    assert uncovered_shapes(default_plan.with_keys(keys)) == []


def test_dropping_a_middle_generation_key_is_still_covered(default_plan):
    keys = [k for k in default_plan.keys if not (k.chunk_size == 0 and k.batch_size == 2)]
    assert uncovered_shapes(default_plan.with_keys(keys)) == []


def test_dropping_largest_prefill_key_reports_the_range(default_plan):
    keys = [k for k in default_plan.keys if not (k.chunk_size == 64 and k.batch_size in (3, 4))]
    misses = uncovered_shapes(default_plan.with_keys(keys))
    assert len(misses) == 2, misses
    assert all("prefill batches of 3-4" in m and "64" in m for m in misses)
    assert all("generation" not in m for m in misses)


def test_missing_draft_keys_report_the_whole_range():
    plan = plan_of(draft_lens=(0, 2))
    keys = [k for k in plan.keys if k.draft_len != 2]
    misses = uncovered_shapes(plan.with_keys(keys))
    assert len(misses) == 2, misses
    assert all("generation batches of 1-8" in m and "draft_len=2" in m for m in misses)


def test_single_missing_size_is_not_written_as_a_range():
    plan = plan_of(max_batch_size=9, batch_sizes=(1, 8, 9), sampling=(GREEDY,))
    keys = [k for k in plan.keys if k != GraphKey(9)]
    misses = uncovered_shapes(plan.with_keys(keys))
    assert len(misses) == 1 and "generation batches of 9 (" in misses[0], misses
