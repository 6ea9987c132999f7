"""The verify step's host work, made O(1) cheap operations per row (issue 14 item 2): the
batched n-gram proposals equal the per-row ones; the postprocess's stop filter (a row whose new
tokens hold no stop id / EOS and do not reach max_tokens skips the walk) decides what the walk
over every token decides; the short verify packing rewrites the block tables that grew."""

from __future__ import annotations

import random

import pytest
import torch

from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.runtime.serving import drafter as drafter_mod
from trtgraph.runtime.serving.drafter import MANY_ROWS, NgramDrafter, NgramIndex

from conftest import tiny_config

K = 3


@pytest.mark.parametrize("seed", range(4))
def test_proposals_for_a_step_s_rows_at_once_equal_each_row_s_own(seed, monkeypatch):
    """propose_many (integer keys, the rows with few new tokens batched) against propose with
    tuple keys, row by row, over random sequences that grow by 0-12 tokens a step (mostly what
    the last proposal said), with and without probe windows: the proposals, what each index has
    indexed and skipped, and its number of n-grams agree at every step; the batched path ran."""
    batched = [0]
    real = NgramDrafter._propose_batch
    monkeypatch.setattr(NgramDrafter, "_propose_batch",
                        lambda self, s, i, batch, out: (batched.__setitem__(0, batched[0] + len(batch)),
                                                        real(self, s, i, batch, out))[1])
    rng = random.Random(seed)
    for trial in range(12):
        k, n_min = rng.choice([1, 2, 4]), rng.choice([1, 1, 2])
        n_max = max(n_min, rng.choice([1, 2, 3, 3]))
        vocab = rng.choice([5, 20, 1000])
        per_row, many = NgramDrafter(k, n_min, n_max), NgramDrafter(k, n_min, n_max, vocab_size=vocab)
        assert per_row.bits is None and many.bits == 63 // n_max
        rows = rng.choice([rng.randint(1, 6), rng.randint(MANY_ROWS, MANY_ROWS + 20)])
        ids = [[rng.randrange(vocab) for _ in range(rng.choice([rng.randint(1, 40), rng.randint(65, 150)]))]
               for _ in range(rows)]  # (over 64 new tokens: coded by numpy)
        ia, ib = [NgramIndex() for _ in ids], [NgramIndex() for _ in ids]
        for step in range(25):
            window = rng.choice([None, None, 16, 2])
            want = [per_row.propose(x, ix, window) for x, ix in zip(ids, ia)]
            assert many.propose_many(ids, ib, window) == want, (trial, step)
            for a, b in zip(ia, ib):
                assert (a.indexed, a.skipped, len(a.following)) == (b.indexed, b.skipped, len(b.following))
            for x, p in zip(ids, want):
                for t in range(rng.choice([0, 1, 1, K + 1, K + 1, 3, 12])):
                    x.append(p[t] if p and t < len(p) and rng.random() < 0.7 else rng.randrange(vocab))
    assert batched[0] > 200


def test_integer_keys_only_where_the_vocabulary_fits():
    assert NgramDrafter(4, 1, 3, vocab_size=128256).bits == 21
    assert NgramDrafter(4, 1, 3, vocab_size=(1 << 21) - 1).bits == 21  # ids + 1 below 2**21
    assert NgramDrafter(4, 1, 3, vocab_size=1 << 21).bits is None
    assert NgramDrafter(4, 1, 4, vocab_size=128256).bits is None  # 4 ids of 15 bits: too few
    top = (1 << 21) - 2  # the largest id of that vocabulary
    d = NgramDrafter(4, 1, 3, vocab_size=top + 1)
    ids = [top, 5, top, 5, 7, top, 5]
    assert d.propose(ids, NgramIndex()) == NgramDrafter(4, 1, 3).propose(ids, NgramIndex()) == [7, top, 5, 5]


def _walk(seq, n_new, eos):
    """The stop rule on every appended token, in order (what `_stop` does for every row)."""
    req, ids, p = seq.request, seq.all_ids, len(seq.prompt_ids)
    num_out = len(ids) - p
    for j in range(num_out - n_new, num_out):
        t = ids[p + j]
        if j + 1 >= req.min_tokens and (t in req.stop_token_ids or (t in eos and not req.ignore_eos)):
            return "stop", p + j + 1
        if j + 1 >= req.max_tokens:
            return "length", p + j + 1
    return None, len(ids)


@pytest.mark.parametrize("seed", range(3))
def test_a_verify_step_s_postprocess_stops_where_the_walk_over_every_token_does(seed):
    """Random accept counts, EOS and stop ids inside and past the accepted runs, min_tokens,
    max_tokens cutting an accepted run, ignore_eos, n > 1: each row's finish reason and kept
    tokens are the walk's; finished rows free their blocks; the other completions of an n > 1
    request start after its first token."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import ScheduledStep, Scheduler, Sequence

    rng = random.Random(seed)
    eos, stop_id = 2, 9
    cfg = tiny_config(speculative={"draft_len": K})
    plan = BucketPlan.from_config(cfg)
    for trial in range(30):
        sched = Scheduler(plan, 200, 16, NgramDrafter(K, 1, 3), 256, eos_ids=frozenset({eos}))
        seqs = []
        for i in range(rng.randint(1, 4)):
            max_tokens = rng.randint(1, 12)
            req = Request(id=f"r{i}", prompt_token_ids=(5, 6, 7), max_tokens=max_tokens,
                          min_tokens=rng.randint(0, min(3, max_tokens)), ignore_eos=rng.random() < 0.3,
                          stop_token_ids=[stop_id] if rng.random() < 0.5 else [], n=rng.choice([1, 1, 2]))
            seq = Sequence(req, i, [5, 6, 7], seed=i)
            sched.add(seq)
            seqs.append(seq)
        step = sched.schedule()
        sched.postprocess(step, [rng.choice([4, eos, stop_id]) for _ in step.seqs])
        for _ in range(6):
            live = [s for s in sched.running if s.num_pending == 1]
            if not live:
                break
            key = GraphKey(len(live), K, 0, "greedy")
            if key not in plan.keys:
                break
            q = K + 1
            step = ScheduledStep(key, live, [q] * len(live), [[4] * K for _ in live])
            tokens = [rng.choice([4, 4, 4, eos, stop_id]) for _ in range(len(live) * q)]
            accepted = [rng.randint(0, K) for _ in live]
            want = {}
            for i, s in enumerate(live):
                new = tokens[i * q:i * q + accepted[i] + 1]
                s2 = Sequence(s.request, s.arrival, s.prompt_ids, s.seed)
                s2.all_ids = s.all_ids + new
                reason, keep = _walk(s2, len(new), {eos})
                want[id(s)] = (reason, s2.all_ids[:keep])
            news = sched.postprocess(step, tokens, accepted)
            assert len(news) == len(live)
            for s, reason in news:
                assert (reason, s.all_ids) == want[id(s)], (trial, s.request)
                assert s.finished == (reason is not None) and (s in sched.running) == (reason is None)
        for s in seqs:  # the prefill drew each first token: an n = 2 request's second completion was forked
            assert sum(c.request is s.request and c.index == 1 for c in sched.waiting) == (s.request.n - 1)


def test_the_short_verify_packing_rewrites_only_the_tables_that_grew_and_checks_them():
    """Over the rows packed last, a row whose table grew gets its whole table written and checked;
    the staging then equals a full pack of the same rows; a bad entry in a table that grew is refused."""
    from trtgraph.runtime.step.executor import Executor, StepRow

    config = tiny_config(speculative={"draft_len": K}, kv_cache={"num_blocks": 30})
    ex = Executor.build(config, BucketPlan.from_config(config))
    key = GraphKey(3, K, 0, "greedy")
    rows = [StepRow([5, 6, 7, 8], 10, [3]), StepRow([9, 10, 11, 12], 3, [7]), StepRow([1, 2, 3, 4], 20, [4, 8])]
    ex.prepare(key, rows)
    writes = []
    real = ex._write_tables
    ex._write_tables = lambda k, rs, at, have: (writes.append(list(at)), real(k, rs, at, have))[1]
    rows[0].token_ids, rows[0].start_pos, rows[0].block_table = [8, 1, 2, 3], 14, [3, 11]
    rows[1].token_ids, rows[1].start_pos = [12, 4, 4, 4], 5
    ex.prepare(key, rows)  # the short path: row 0's table grew
    assert writes == [[0]]
    again = (ex.buffers.ints_host.clone(), ex.buffers.floats_host.clone())
    ex.prepare(GraphKey(1, 0, 0, "greedy"), [StepRow([1], 0, [5])])
    ex.prepare(key, rows)  # a full pack
    assert torch.equal(again[0], ex.buffers.ints_host) and torch.equal(again[1], ex.buffers.floats_host)
    ex.prepare(key, rows)  # the short path again: no table grew, none written (below)
    assert writes[1:] == [[0], [0, 1, 2]]  # (the other step's full pack, then this one's)
    rows[2].block_table = [4, 8, 99]
    with pytest.raises(Exception, match="row 2: block_table holds 99"):
        ex.prepare(key, rows)
    rows[2].block_table = [4, 8]
    rows[1].token_ids = [12, 4, 4]
    with pytest.raises(Exception, match="row 1"):
        ex.prepare(key, rows)


def test_a_verify_key_above_the_measured_ones_is_priced_along_their_per_row_increment():
    """Host work is partly per step: above the largest measured verify key, where two are
    measured, its host work plus the increment per row between the two largest, or that one's
    scaled by (rows + 16) / (its rows + 16) where more (two noisy small batches: session 17's
    H200 figures); below or between them (or with one measured), the nearest one's scaled so."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import SpeculationPolicy

    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    replay = {GraphKey(b, d, 0, "greedy"): (1.0 if d else 0.8) for b in (1, 2, 4, 8) for d in (0, K)}
    pol = SpeculationPolicy(plan, K, replay)
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(8)]
    pol.record(GraphKey(1, K, 0, "greedy"), 1.5)  # 0.5 ms beyond its replay at 1 row
    from trtgraph.runtime.serving.speculation import HOST_STEP_ROWS as C
    assert pol.costs(rows) == pytest.approx((0.8, 1.0 + 0.5 * (8 + C) / (1 + C)))  # one measured: with its per-step part
    pol.record(GraphKey(2, K, 0, "greedy"), 1.7)  # 0.7 at 2 rows: 0.2 ms more a row
    assert pol.costs(rows) == pytest.approx((0.8, 1.0 + 0.7 + 6 * 0.2))  # 8 rows: along the increment
    assert pol.costs(rows[:4]) == pytest.approx((0.8, 1.0 + 0.7 + 2 * 0.2))
    pol.record(GraphKey(2, K, 0, "greedy"), 0.9, n=2)  # its running mean falls to 1.35: 0.35 beyond its replay
    assert pol.costs(rows[:4]) == pytest.approx((0.8, 1.0 + 0.35 * (4 + C) / (2 + C)))  # a negative increment: scaled
    pol = SpeculationPolicy(plan, K, replay)
    pol.record(GraphKey(1, K, 0, "greedy"), 1.0 + 0.37)  # the H200: 0.37 ms beyond the replay at 1 row,
    pol.record(GraphKey(8, K, 0, "greedy"), 1.0 + 0.39)  # 0.39 at 8; 1.14 measured at 64 rows (the plan stops at 8)
    assert pol._host_beyond_replay(GraphKey(64, K, 0, "greedy")) == pytest.approx(0.39 * (64 + C) / (8 + C))  # not 0.55
