"""Speculative decoding: prompt-lookup drafts, in-graph verification and acceptance.

Greedy output with speculation is token-for-token the output without it; seeded sampled
output is too (drafts are checked against the very draw plain sampling makes, which accepts
a draft with probability p(draft), as rejection sampling does), so its distribution is kept;
no KV block leaks; stops inside an accepted run are honoured."""

from __future__ import annotations

import math

import pytest
import torch

from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.config import Config
from trtgraph.errors import ConfigError
import oracle
from trtgraph.kernels import sampler_reference as sampler
from trtgraph.runtime.serving.drafter import NgramDrafter, NgramIndex

from conftest import generate_with_scheduler, tiny_config

K = 3


@pytest.fixture(scope="module")
def spec_artifacts(tmp_path_factory):
    from trtgraph.compiler.pipeline import capture

    out = tmp_path_factory.mktemp("spec")
    capture(tiny_config(speculative={"draft_len": K, "ngram_min": 1, "ngram_max": 3}, kv_cache={"num_blocks": 30}), out)
    return out


@pytest.fixture(scope="module")
def engines(spec_artifacts):
    from trtgraph.runtime.serving.engine import Engine

    return Engine(spec_artifacts), Engine(spec_artifacts, speculative=False)


def _prompts():
    repetitive = ["one two three four " * 5, "abcabcabcabcabcabc", "[1, 2, 3, 1, 2, 3, 1, 2, 3",
                  "def f(x):\n    return x\n\ndef f(x):\n    return x\n\ndef f(", "the cat sat on the mat. " * 4]
    plain = ["Random words: quince, harbour, velvet, ozone", "7f3a9c1e", "Zebra?"]
    out = []
    for i, text in enumerate(repetitive + plain):
        for sampled in (False, True):
            out.append({"id": f"{i}-{'s' if sampled else 'g'}", "prompt": text, "max_tokens": 20 + 3 * i,
                        "temperature": 0.8 if sampled else 0.0, "top_k": 40 if sampled else 0, "seed": 100 + i})
    return out


def _run(engine, reqs):
    return generate_with_scheduler(engine, reqs)


def test_capture_adds_verify_keys_for_every_generation_batch(spec_artifacts):
    from trtgraph.artifacts import load_manifest

    keys = load_manifest(spec_artifacts).graph_keys
    for bs in (1, 2, 4, 8):
        for s in ("greedy", "sampled"):
            assert GraphKey(bs, K, 0, s) in keys and GraphKey(bs, 0, 0, s) in keys


def test_outputs_equal_plain_decoding_and_the_oracle(engines):
    spec, plain = engines
    reqs = _prompts()
    got, sched = _run(spec, reqs)
    want, _ = _run(plain, reqs)
    stats = spec.stats.to_json()["speculative"]
    assert stats["verify_steps"] > 0 and stats["acceptance_rate"] > 0  # drafting really happened
    assert spec.stats.preemptions > 0  # and the small cache forced recompute in the middle of it
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]
        assert got[r["id"]].finish_reason == "length" and len(got[r["id"]].token_ids) == r["max_tokens"]
        ids = list(r["prompt"].encode())
        assert got[r["id"]].token_ids == oracle.generate(spec.executor.loaded, ids, r["max_tokens"],
                                                         temperature=r["temperature"], top_k=r["top_k"],
                                                         seed=r["seed"])
    assert sched.allocator.num_free == sched.allocator.num_blocks - 1, "KV blocks leaked"


def test_repetitive_prompts_accept_more_drafts_than_random_ones(engines):
    spec, _ = engines
    reqs = [r for r in _prompts() if r["id"].endswith("g")]
    _run(spec, reqs[:5])
    repetitive = spec.stats.to_json()["speculative"]["mean_tokens_per_row_step"]
    assert repetitive > 1.0  # more than one token per verify row on average


def test_a_stop_token_inside_an_accepted_run_cuts_the_output_there(engines):
    spec, plain = engines
    base = {"id": "a", "prompt": "one two three four " * 5, "max_tokens": 30}
    full = list(plain.generate([base]))[0].token_ids
    stop = full[6]
    first = full.index(stop)
    got = list(spec.generate([{**base, "stop": [stop]}]))[0]
    assert got.finish_reason == "stop" and got.token_ids == full[:first + 1]
    for n in (1, 2, 5, 7):  # max_tokens that end inside a verify step's accepted run
        assert list(spec.generate([{**base, "max_tokens": n}]))[0].token_ids == full[:n]


def test_sequences_near_max_seq_len_fall_back_to_plain_steps(engines):
    spec, plain = engines
    req = {"id": "long", "prompt_token_ids": [65, 66, 67] * 70 + [65], "max_tokens": 45}  # 211 + 45 = 256
    assert [r.token_ids for r in spec.generate([req])] == [r.token_ids for r in plain.generate([req])]


def test_drafter_proposes_what_followed_the_latest_earlier_occurrence():
    d = NgramDrafter(4, 1, 3)
    idx = NgramIndex()
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert d.propose(ids, idx) == [4, 5, 9, 1]
    ids += [7]  # "3 7" never occurred; "7" neither
    assert d.propose(ids, idx) is None
    ids += [1, 2]  # "7 1 2" no, "1 2" yes: latest earlier "1 2" is followed by 3, 7, 1, 2
    assert d.propose(ids, idx) == [3, 7, 1, 2]
    assert d.propose([5, 6], NgramIndex()) is None
    assert d.propose([5, 5], NgramIndex()) == [5, 5, 5, 5]  # short run padded with its last token
    assert d.filler([8, 9]) == [9, 9, 9, 9]


def test_a_step_where_no_row_matches_is_a_plain_decode_step():
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Scheduler, Sequence

    cfg = tiny_config(speculative={"draft_len": K})
    sched = Scheduler(BucketPlan.from_config(cfg), 40, 16, NgramDrafter(K, 1, 3), 256)
    seq = Sequence(Request(id="x", prompt_token_ids=(1, 2, 3)), 0, [1, 2, 3], seed=0)
    sched.add(seq)
    step = sched.schedule()
    assert step.is_prefill
    sched.advance(step, [4])
    step = sched.schedule()  # 1 2 3 4: no earlier occurrence of any suffix
    assert step.key.draft_len == 0 and step.drafts is None
    sched.advance(step, [1])
    step = sched.schedule()  # ... 4 1: "1" occurred, followed by 2 3 4 1
    assert step.key.draft_len == K and step.drafts == [[2, 3, 4, 1][:K]]
    assert step.num_proposed == 1


def test_speculative_config_is_validated():
    d = Config.default().to_dict()
    for bad, path in (({"draft_len": 0}, "speculative.draft_len"), ({"method": "eagle"}, "speculative.method"),
                      ({"ngram_min": 3, "ngram_max": 2}, "speculative.ngram_max"),
                      ({"draftlen": 2}, "speculative.draftlen")):
        with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
            Config.from_dict({**d, "speculative": bad})
    with pytest.raises(ConfigError, match="max_num_tokens"):
        Config.from_dict({**d, "speculative": {"draft_len": 40}})  # 8 rows x 41 tokens > 256


def test_sampled_verification_keeps_the_distribution_on_a_tiny_vocabulary():
    """Over many seeds, the token emitted after verifying a fixed draft has the frequencies of
    plain sampling, and both match the softmax (chi-square, 5 degrees of freedom)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0]])
    p = torch.softmax(logits / 0.9, dim=-1)[0]
    n, draft = 6000, 1
    seeds = torch.arange(n)
    rows = logits.expand(n, -1)
    one = torch.ones(n)
    drawn = sampler.sample(rows, 0.9 * one, torch.zeros(n, dtype=torch.int64), one, seeds, torch.full((n,), 7))
    accepted = drawn == draft
    emitted = torch.where(accepted, torch.full_like(drawn, draft), drawn)  # accepted draft, or the model's draw
    plain = torch.bincount(drawn, minlength=6).float()
    spec = torch.bincount(emitted, minlength=6).float()
    assert torch.equal(plain, spec)
    chi2 = float((((spec - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 20.5, chi2  # p < 0.001 for 5 degrees of freedom
    assert math.isclose(accepted.float().mean().item(), p[draft].item(), abs_tol=0.03)  # accepted w.p. p(draft)


# ---- adaptive speculation (runtime/serving/speculation.py) ----------------------------------
def _priced(engine, monkeypatch, verify_over_plain: float):
    """Give the engine's speculation policy replay times (the CPU's are not used): each plain
    decode key 1 ms, each verify key `verify_over_plain` ms."""
    keys = [k for k in engine.manifest.graph_keys if not k.is_prefill]
    monkeypatch.setattr(engine.scheduler.speculation, "replay_ms",
                        {k: verify_over_plain if k.draft_len else 1.0 for k in keys})


def test_adaptive_policy_falls_back_to_plain_steps_when_drafts_are_not_accepted(engines, monkeypatch):
    spec, plain = engines
    _priced(spec, monkeypatch, 1.5)  # drafting pays from about 30% acceptance on
    reqs = [r for r in _prompts() if r["id"].endswith("s")]  # sampled at 0.8: drafts (almost) never match
    declined = spec.scheduler.speculation.plain_steps
    got, _ = _run(spec, reqs)
    sp = spec.stats.to_json()["speculative"]
    declined = spec.scheduler.speculation.plain_steps - declined
    want, _ = _run(plain, reqs)
    assert declined > 0  # steps where rows had n-gram matches, yet the policy ran the plain key
    assert sp["plain_decode_steps"] > 3 * sp["verify_steps"], sp
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]


def test_adaptive_policy_drafts_when_drafts_are_accepted(engines, monkeypatch):
    spec, plain = engines
    _priced(spec, monkeypatch, 1.5)
    reqs = [r for r in _prompts() if r["id"] in ("0-g", "1-g")]  # this model repeats itself on these
    got, _ = _run(spec, reqs)
    sp = spec.stats.to_json()["speculative"]
    want, _ = _run(plain, reqs)
    assert sp["verify_steps"] > sp["plain_decode_steps"] and sp["acceptance_rate"] > 0.5, sp
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]


def test_plain_steps_of_a_speculative_engine_take_the_fast_path_when_drafting_cannot_pay(engines, monkeypatch):
    spec, plain = engines
    _priced(spec, monkeypatch, 1.0 + K)  # no estimate below certainty makes a verify step pay
    reqs = [r for r in _prompts() if r["id"].endswith("g")]
    got, _ = _run(spec, reqs)
    stats = spec.stats.to_json()
    want, _ = _run(plain, reqs)
    assert stats["speculative"]["verify_steps"] == 0 and stats["fast_path_steps"] > 0
    assert stats["fast_path_steps"] == plain.stats.to_json()["fast_path_steps"]
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]


def test_acceptance_estimate_scores_proposals_against_the_tokens_that_followed():
    from trtgraph.runtime.serving.acceptance import Acceptance

    a = Acceptance()
    assert a.rate == 0.25 and math.isclose(a.expected_tokens(3), 1 + 0.25 + 0.25 ** 2 + 0.25 ** 3)  # pessimistic
    ids = [1, 2, 3]
    a.offer(len(ids), [4, 5, 6])
    a.offer(len(ids), [9, 9, 9])  # one proposal pending at a time
    ids += [4, 5]
    a.observe(ids)
    assert a.pending is not None and a.proposals == 0  # agrees so far: not decided yet
    assert a.agreeing == 2 and a.rate > 0.25  # but its agreeing drafts count already
    ids += [7]
    a.observe(ids)
    assert a.pending is None and (a.proposals, a.drafts_matched) == (1, 2)
    before = a.rate
    for _ in range(6):  # proposals that never match drive the estimate down
        a.offer(len(ids), [0, 0, 0])
        ids += [1]
        a.observe(ids)
    assert a.rate < 0.15 < before
    for _ in range(6):  # and ones that match in full bring it back up
        a.offer(len(ids), [1, 1, 1])
        ids += [1, 1, 1]
        a.observe(ids)
    assert a.rate > 0.7


def test_a_batch_that_does_not_draft_probes_only_now_and_then_and_runs_ahead(engines, monkeypatch):
    """Proposals cost host time on every row: a batch whose drafts do not pay makes them only
    on probes (intervals doubling), and its plain steps are launched ahead on the fast path."""
    spec, plain = engines
    _priced(spec, monkeypatch, 1.5)
    calls = []
    propose = spec.drafter.propose
    monkeypatch.setattr(spec.drafter, "propose", lambda *a, **kw: calls.append(a[0]) or propose(*a, **kw))
    reqs = [{"id": f"r{i}", "prompt_token_ids": [(37 * i + 11 * j) % 200 + 3 for j in range(12)], "max_tokens": 60,
             "temperature": 0.8, "seed": i} for i in range(4)]  # sampled: drafts (almost) never match
    got, _ = _run(spec, reqs)
    st = spec.stats.to_json()
    want, _ = _run(plain, reqs)
    assert st["speculative"]["verify_steps"] == 0
    assert len(calls) <= 4 * 12, len(calls)  # 4 rows x (1, 2, 4, ... 64: at most 7 probes) + slack, not 4 x 60
    assert st["fast_path_steps"] >= 50, st  # launched ahead, repeating the last step's rows
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]


def test_policy_prices_steps_by_measured_wall_times():
    """The costs are the keys' measured wall times once there are some: a verify step that the
    replay times call cheap, but that measures slow (its host work), stops paying."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import SpeculationPolicy

    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    plain_key, verify_key = GraphKey(2, 0, 0, "greedy"), GraphKey(2, K, 0, "greedy")
    pol = SpeculationPolicy(plan, K, {plain_key: 1.0, verify_key: 1.2})
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(2)]
    for s in rows:
        s.accept.accepted, s.accept.rejected = 1.0, 1.0  # a = 0.5: 1.875 tokens per row
    assert pol.costs(rows) == (1.0, 1.2) and pol.pays(rows, [True, True])
    pol.record(plain_key, 0.5)  # measured plain; verify priced by the replay ratio
    assert pol.costs(rows) == (0.5, 0.6) and pol.pays(rows, [True, True])
    pol.record(verify_key, 1.0)  # verify measured at twice the plain step: 1.875 tokens do not pay
    assert pol.costs(rows) == (0.5, 1.0) and not pol.pays(rows, [True, True])
    pol.record(verify_key, 0.0)  # a running mean: one fast step moves it a quarter of the way
    assert pol.costs(rows) == (0.5, 0.75)
    pol.drafting = False
    assert not pol.pays(rows, [True, False])  # one row's drafts do not pay for the other's


def test_probes_index_a_window_and_backfill_what_they_skipped():
    d = NgramDrafter(4, 1, 3)
    ids = [5, 6, 7, 8, 9, 1, 2, 3, 4, 0] * 3
    probed, full = NgramIndex(), NgramIndex()
    assert d.propose(ids, probed, window=4) is None  # "... 3 4 0": its earlier occurrences were skipped
    assert probed.skipped == [(0, len(ids) - 5)]
    assert d.propose(ids, probed) == d.propose(ids, full) == [5, 6, 7, 8]  # backfilled: the latest one
    assert probed.following == full.following and probed.skipped == []


def test_a_proposal_backfills_at_most_backfill_skipped_positions_the_newest_first():
    """The first drafting step after probes does not index a whole long row at once: each
    proposal backfills BACKFILL positions, newest first, until the index is the full one."""
    from trtgraph.runtime.serving.drafter import BACKFILL

    d = NgramDrafter(4, 1, 3)
    ids = [(7 * j * j + 3 * j) % 97 for j in range(5 * BACKFILL)]
    probed, full = NgramIndex(), NgramIndex()
    d.propose(ids, probed, window=4)
    assert probed.skipped == [(0, len(ids) - 5)]
    d.propose(ids, probed)
    assert probed.skipped == [(0, len(ids) - 5 - BACKFILL)]  # the newest BACKFILL positions are in
    for _ in range(5):
        d.propose(ids, probed)
    d.propose(ids, full)
    assert probed.skipped == [] and probed.following == full.following


def test_a_large_batch_that_does_not_draft_probes_a_turning_sample_of_rows():
    from trtgraph.runtime.serving.speculation import PROBE_ROWS, SpeculationPolicy

    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    pol = SpeculationPolicy(plan, K, {GraphKey(1, 0, 0, "greedy"): 1.0})
    rows = list(range(3 * PROBE_ROWS - 2))
    first = pol.probe_rows(rows)
    assert len(first) <= PROBE_ROWS and first == rows[0::3]
    pol.probes += 1
    assert pol.probe_rows(rows) == rows[1::3]  # the next probe samples other rows
    assert pol.probe_rows(rows[:PROBE_ROWS]) == rows[:PROBE_ROWS]  # a small batch: every row
    pol.full_probe = True  # a sample that would pay calls every row to the next probe
    assert pol.probe_rows(rows) == rows
    pol.full_probe, pol.drafting = False, True
    assert pol.probe_rows(rows) == rows
    assert SpeculationPolicy(plan, K).probe_rows(rows) == rows  # no replay times: every row, every step


def test_probes_do_not_stop_the_steps_launched_ahead(engines, monkeypatch):
    """A probe due at a step launched ahead is made after that launch, from the tokens known
    then: when drafting cannot pay, the speculative engine launches exactly as many steps ahead
    as the plain one, decode steps and the decode step after a prefill alike."""
    from trtgraph.runtime.serving.scheduler import Scheduler

    spec, plain = engines
    _priced(spec, monkeypatch, 1.0 + K)  # no estimate below certainty makes a verify step pay
    ahead, after_prefill = {}, {}
    extend = Scheduler.extend_decode

    def counted(self, step):
        out = extend(self, step)
        book = after_prefill if step.is_prefill else ahead
        book[id(self)] = book.get(id(self), 0) + (out is not None)
        return out

    monkeypatch.setattr(Scheduler, "extend_decode", counted)
    reqs = [{"id": f"r{i}", "prompt": "one two three four " * (i + 1), "max_tokens": 50} for i in range(3)]
    probes = spec.scheduler.speculation.probes
    got, _ = _run(spec, reqs)
    want, _ = _run(plain, reqs)
    assert spec.scheduler.speculation.probes - probes >= 5  # it did probe, on steps launched ahead too
    assert ahead[id(spec.scheduler)] == ahead[id(plain.scheduler)] > 30, ahead
    assert after_prefill.get(id(spec.scheduler), 0) == after_prefill[id(plain.scheduler)] > 0, after_prefill
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]


def test_hope_alone_keeps_a_batch_probing_every_step_only_hope_limit_times():
    """Pending proposals that would pay were they accepted call a probe at the next step; when
    they keep doing so without the batch ever drafting (a verify step that costs more than
    the accepted drafts bring), the probes back off after HOPE_LIMIT in a row, and a prefill
    (new rows) gives hope its chances again."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import HOPE_LIMIT, SpeculationPolicy

    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    pol = SpeculationPolicy(plan, K, {GraphKey(2, 0, 0, "greedy"): 1.0, GraphKey(2, K, 0, "greedy"): 1.75})
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(2)]
    proposals = {id(s): [7] * K for s in rows}  # never scored: their tokens are not drawn yet
    intervals = []
    for _ in range(HOPE_LIMIT + 3):
        assert not pol.decide(rows, proposals)  # a = 0.25: 1.33 tokens per row do not pay 1.75
        intervals.append(pol.interval)
    assert intervals == [1] * HOPE_LIMIT + [2, 4, 8]
    pol.handed_out(None)  # a prefill: new rows, hope counts again
    assert pol.decide(rows, proposals) is False and pol.interval == 1
    pol.record(GraphKey(2, 0, 0, "greedy"), 1.0)  # measured: a verify step costs no more than a plain one
    pol.record(GraphKey(2, K, 0, "greedy"), 0.9)
    pol.hoped = HOPE_LIMIT  # then hope keeps the probes at every step, past the limit
    proposals = {}  # no match now (so no draft), the earlier proposals still pending
    assert [pol.decide(rows, proposals) or pol.interval for _ in range(3)] == [1, 1, 1]


def test_a_never_matching_workload_makes_no_more_proposals_than_the_backoff_allows(engines, monkeypatch):
    """Drafts that never match (the drafter finds nothing): after each prefill the probes come at
    intervals 1, 2, 4, ..., so a row makes at most log2(steps) + 2 proposals, each made after the
    launch of a step that runs ahead (none on the path between two launches); the engine
    launches as many steps ahead as the plain one, and emits the same tokens."""
    spec, plain = engines
    _priced(spec, monkeypatch, 1.5)
    calls = []
    monkeypatch.setattr(spec.drafter, "propose", lambda ids, *a, **kw: calls.append(len(ids)) and None)
    rows, max_tokens = 4, 60
    reqs = [{"id": f"n{i}", "prompt_token_ids": [(29 * i + 7 * j) % 250 + 3 for j in range(12)],
             "max_tokens": max_tokens, "ignore_eos": True} for i in range(rows)]
    got, _ = _run(spec, reqs)
    st = spec.stats.to_json()
    prefills = sum(n for k, n in spec.stats.steps_per_key.items() if k.is_prefill)
    want, _ = _run(plain, reqs)
    assert st["speculative"]["verify_steps"] == 0
    assert 0 < len(calls) <= prefills * rows * (math.log2(max_tokens) + 2), (len(calls), prefills)
    assert st["fast_path_steps"] == plain.stats.to_json()["fast_path_steps"] > 40, st
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]


def test_a_drafting_episode_that_loses_doubles_the_margin_its_verify_key_needs(monkeypatch):
    """An episode is judged by its tokens per wall ms against a plain step's: a loss doubles the
    margin that verify key needs to start again (up to 2**MAX_LOSSES), a win clears it."""
    from trtgraph.runtime.serving import speculation
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import MAX_LOSSES, SpeculationPolicy

    clock = [0.0]
    monkeypatch.setattr(speculation.time, "perf_counter", lambda: clock[0])
    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    plain_key, verify_key = GraphKey(2, 0, 0, "greedy"), GraphKey(2, K, 0, "greedy")
    pol = SpeculationPolicy(plan, K, {plain_key: 1.0, verify_key: 1.2})
    pol.measure = True
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(2)]
    for s in rows:
        s.accept.accepted, s.accept.rejected = 1.0, 1.0  # a = 0.5: 1.94 tokens per row against 1.2 ms / 1.0 ms
    proposals = {id(s): [7] * K for s in rows}

    def episode(ms: float, tokens: int) -> None:
        assert pol.decide(rows, proposals) and pol.drafting
        clock[0] += ms / 1e3
        pol.emitted(tokens)
        pol.end_episode()
        pol.drafting = False  # (as decide() leaves it when it ends an episode)

    episode(10.0, 8)  # 8 tokens in 10 ms: plain steps (2 tokens per ms) would have made 20
    assert pol.losses[verify_key] == 1 and pol.episodes == [0, 1]
    assert not pol.pays(rows, [True, True])  # 1.875 tokens a row < 1.2 x 1.05 x 2
    for s in rows:
        s.accept.accepted, s.accept.rejected = 20.0, 0.1  # nearly certain: K + 1 tokens a row
    episode(10.0, 8)  # (3.97 > 2.52: it starts, and loses again)
    assert pol.losses[verify_key] == 2 and not pol.pays(rows, [True, True])  # 3.97 < 1.2 x 1.05 x 4
    for _ in range(MAX_LOSSES):
        pol._start_episode(rows)
        clock[0] += 0.01
        pol.emitted(8)
        pol.end_episode()
    assert pol.losses[verify_key] == MAX_LOSSES and pol.episodes == [0, 2 + MAX_LOSSES]
    pol._start_episode(rows)  # an episode that pays (30 tokens in 10 ms) clears the losses
    clock[0] += 0.01
    pol.emitted(30)
    pol.end_episode()
    assert pol.losses[verify_key] == 0 and pol.episodes == [1, 2 + MAX_LOSSES]
    assert pol.pays(rows, [True, True])


def test_probes_are_spaced_by_their_measured_cost_and_a_prefill_keeps_the_spacing():
    """A probe that did not draft and took 1 ms, against plain steps of 1 ms: the next comes no
    sooner than 100 steps later (PROBE_SHARE = 1%), and a prefill (new rows) does not call one
    at the next step (prompts admitted a chunk of rows at a time would probe at every step).
    One very slow probe moves the cost's running mean, and the spacing is MAX_FLOOR at most."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import MAX_FLOOR, PROBE_SHARE, PROBE_WEIGHT, SpeculationPolicy

    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    pol = SpeculationPolicy(plan, K, {GraphKey(2, 0, 0, "greedy"): 1.0, GraphKey(2, K, 0, "greedy"): 1.5})
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(2)]
    pol.spaced(0.001, rows, rows)
    assert not pol.measure and pol.interval == 1  # (the CPU: no measured times, no spacing)
    pol.measure = True
    pol.spaced(0.001, rows, rows)  # 0.5 ms per row, the next probe has 2 rows
    assert pol.interval == pol.floor == round(1 / PROBE_SHARE) == 100
    pol.handed_out(None)
    assert pol.interval == 100
    assert [pol.probe_due() for _ in range(100)] == [False] * 99 + [True]
    pol.spaced(0.0005 * (1 + 1 / PROBE_WEIGHT), rows, rows[:1])  # 2.5 ms for one row: the mean moves to 1 ms
    assert math.isclose(pol.row_ms, 1.0) and pol.floor == 200
    pol.spaced(10.0, rows, rows)
    assert pol.floor == pol.interval == MAX_FLOOR


def _copying(engine, monkeypatch, cycle: int = 11):
    """The engine's model replaced by one that copies: each token's successor in a cycle of
    `cycle` ids (3 ..), computed from the step's inputs as the graph sees them (the packed ones,
    or on the fast path the last step's tokens), drafts verified as the graph verifies them."""
    from trtgraph.runtime.step.executor import StepOutputs

    ex, b = engine.executor, engine.executor.buffers
    succ = torch.arange(b.vocab_size)
    succ[3:3 + cycle] = torch.roll(torch.arange(3, 3 + cycle), -1)
    fresh = [True]
    prepare, advance = ex.prepare, ex.advance_decode
    monkeypatch.setattr(ex, "prepare", lambda *a, **kw: fresh.__setitem__(0, True) or prepare(*a, **kw))
    monkeypatch.setattr(ex, "advance_decode", lambda *a, **kw: fresh.__setitem__(0, False) or advance(*a, **kw))

    def execute(key, eager=False):
        T, B, q = key.num_tokens, key.batch_size, key.q_len
        if fresh[0]:
            ids = torch.from_numpy(b.host.input_ids[:T].copy())
            src = torch.from_numpy(b.host.gather_src[:B].copy())
            if not key.is_prefill:
                ids[:B] = torch.where(src >= 0, b.next_tokens[src.clamp(min=0)], ids[:B])
        else:
            ids = b.next_tokens[:T].clone()
        tokens = succ[ids]
        if key.is_prefill:
            tokens = tokens[torch.from_numpy(b.host.logits_indices[:B].copy())]
        b.next_tokens[:len(tokens)] = tokens
        if key.draft_len:
            match = ids.view(B, q)[:, 1:] == tokens.view(B, q)[:, :-1]
            b.accepted[:B] = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
        return StepOutputs(None, b.next_tokens, b.accepted)

    monkeypatch.setattr(ex, "execute", execute)


def test_a_batch_whose_drafts_are_accepted_drafts_though_a_verify_step_costs_several_plain_ones(engines, monkeypatch):
    """As on the GPU: a verify step measured at 2.5x a plain step (its host work: no step is
    launched ahead of it), the probes spaced by their measured cost. A model that copies (the
    copy workload: each prompt a cycle the model continues): hope (a pending proposal that
    agrees so far and would pay if accepted in full) keeps probing at every step past the
    spacing, each proposal accepted in full renews it, until the estimate pays; then most
    steps draft, and their drafts are accepted. Outputs equal plain decoding's (the same
    model), and a verify step over the rows of the one before packs only what moved."""
    spec, plain = engines
    pol = spec.scheduler.speculation
    keys = [k for k in spec.manifest.graph_keys if not k.is_prefill]
    for name, value in (("replay_ms", {k: 2.5 if k.draft_len else 1.0 for k in keys}),
                        ("wall_ms", {k: 2.5 if k.draft_len else 1.0 for k in keys}),
                        ("record", lambda *a, **kw: None),  # (the CPU's step times: not the GPU's)
                        ("measure", True), ("losses", {}), ("interval", 1), ("floor", 0), ("row_ms", None)):
        monkeypatch.setattr(pol, name, value)
    for engine in engines:
        _copying(engine, monkeypatch)
    reqs = [{"id": f"c{i}", "prompt_token_ids": [3 + (i + j) % 11 for j in range(30)], "max_tokens": 60,
             "ignore_eos": True} for i in range(2)]
    again = []
    monkeypatch.setattr(spec.executor, "_prepare_verify_again",
                        lambda *a, f=spec.executor._prepare_verify_again: again.append(1) or f(*a))
    got, _ = _run(spec, reqs)
    sp = spec.stats.to_json()["speculative"]
    want, _ = _run(plain, reqs)
    assert pol.floor > 1  # the probes' cost spaces them (a probe of a row: 5+ us against a 1 ms step)
    assert sp["verify_steps"] > sp["plain_decode_steps"] and sp["acceptance_rate"] == 1.0, sp
    assert len(again) >= sp["verify_steps"] - 2
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids == \
            [3 + (int(r["id"][1:]) + 30 + j) % 11 for j in range(60)], r["id"]


def test_a_verify_step_over_the_rows_packed_last_writes_what_the_full_path_would():
    """The same rows (StepRow objects) and verify key as the full-path step packed last: only
    their tokens, positions, slots and tables are written; the staging then holds exactly what a
    full pack of those rows writes."""
    from trtgraph.runtime.step.executor import Executor, StepRow

    config = tiny_config(speculative={"draft_len": K}, kv_cache={"num_blocks": 30})
    ex = Executor.build(config, BucketPlan.from_config(config))
    key = GraphKey(2, K, 0, "greedy")
    rows = [StepRow([5, 6, 7, 8], 14, [3, 4], temperature=0.0, seed=1),
            StepRow([9, 10, 11, 12], 3, [7], seed=2, top_k=5)]
    ex.prepare(key, rows)
    for r, (tokens, start, table) in zip(rows, [([8, 1, 2, 3], 17, [3, 4, 9]), ([12, 4, 4, 4], 5, [7])]):
        r.token_ids, r.start_pos, r.block_table = tokens, start, table
    ex.prepare(key, rows)  # the rows packed last: only what moves is written
    again = (ex.buffers.ints_host.clone(), ex.buffers.floats_host.clone())
    ex.prepare(GraphKey(2, 0, 0, "greedy"), [StepRow([1], 0, [5])])  # something else in between
    ex.prepare(key, rows)  # a full pack
    assert torch.equal(again[0], ex.buffers.ints_host) and torch.equal(again[1], ex.buffers.floats_host)
    rows[1].block_table = [7, 99]  # the checks hold on the short path too
    with pytest.raises(Exception, match="block_table"):
        ex.prepare(key, rows)


def test_a_verify_key_not_measured_yet_is_priced_with_the_host_work_measured_ones_show():
    """On the GPU a verify step's wall time is mostly host work, part per step and part growing
    with its rows (no step is launched ahead of it): a verify key not measured yet costs its
    replay time plus the nearest measured verify key's host work scaled by (rows + 16) / (its
    rows + 16), not the replay times' ratio alone (which priced a 0.38 ms verify step that
    measured 5.6 ms)."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import HOST_STEP_ROWS as C
    from trtgraph.runtime.serving.speculation import SpeculationPolicy

    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    replay = {GraphKey(b, d, 0, "greedy"): (1.0 if d else 0.8) for b in (1, 2, 4, 8) for d in (0, K)}
    pol = SpeculationPolicy(plan, K, replay)
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(8)]
    assert pol.costs(rows[:4]) == (0.8, 1.0)  # nothing measured: the replay times
    pol.record(GraphKey(2, K, 0, "greedy"), 2.0)  # 1 ms beyond its replay over 2 rows
    pol.record(GraphKey(4, 0, 0, "greedy"), 0.8)
    assert pol.costs(rows[:4]) == pytest.approx((0.8, 1.0 + 1.0 * (4 + C) / (2 + C)))  # more than 2 rows' host work
    assert pol.costs(rows[:1]) == pytest.approx((0.8, 1.0 + 1.0 * (1 + C) / (2 + C)))  # (plain: its replay time)
    pol.record(GraphKey(8, K, 0, "greedy"), 1.5)  # 8 rows: 0.5 ms beyond the replay
    assert pol.costs(rows[:4]) == pytest.approx((0.8, 1.0 + 1.0 * (4 + C) / (2 + C)))  # (2 rows are nearer to 4 than 8)
    assert pol.costs(rows) == (1.5 * 0.8 / 1.0, 1.5)  # measured verify, plain scaled by the replay ratio


def test_a_batch_that_copies_drafts_after_single_requests_were_served():
    """Session 17's H200 run: with only the 1-row verify key measured (0.62 ms of wall against a
    0.25 ms replay), scaling its host work by the rows priced an 8-row verify step at 3.2 ms, so
    a batch of 8 whose drafts are 91% accepted (4.6 tokens a step) never drafted (0.35 ms plain
    steps); priced with the per-step part it drafts."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import SpeculationPolicy

    plan = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
    replay = {GraphKey(1, 0, 0, "greedy"): 0.164, GraphKey(1, K, 0, "greedy"): 0.251,
              GraphKey(8, 0, 0, "greedy"): 0.297, GraphKey(8, K, 0, "greedy"): 0.278}
    replay.update({GraphKey(b, d, 0, "greedy"): 0.28 for b in (2, 4) for d in (0, K)})
    pol = SpeculationPolicy(plan, K, replay)
    pol.record(GraphKey(1, K, 0, "greedy"), 0.6185)
    pol.record(GraphKey(8, 0, 0, "greedy"), 0.353)
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(8)]
    for s in rows:  # a = 0.91: 1 + a + ... + a**K = 4.6 tokens a step
        s.accept.accepted, s.accept.rejected = 91.0, 9.0
    plain, verify = pol.costs(rows)
    assert verify < 1.0 and plain == 0.353
    assert pol.pays(rows, [True] * 8)


def test_a_lost_episode_is_forgotten_once_its_rows_have_all_finished():
    """A loss says drafting did not pay for those sequences: once they have all finished, new
    rows (a workload that copies, after one whose drafts failed) start at the plain margin."""
    from trtgraph.runtime.serving.requests import Request
    from trtgraph.runtime.serving.scheduler import Sequence
    from trtgraph.runtime.serving.speculation import SpeculationPolicy

    verify_key = GraphKey(2, K, 0, "greedy")
    pol = SpeculationPolicy(BucketPlan.from_config(tiny_config(speculative={"draft_len": K})), K,
                            {GraphKey(2, 0, 0, "greedy"): 1.0, verify_key: 1.2})
    pol.measure = True
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(2)]
    for s in rows:  # a = 0.5: 1.875 tokens a row, against 1.2 x 1.05
        s.accept.accepted, s.accept.rejected = 1.0, 1.0
    pol._start_episode(rows)
    pol._episode.start -= 1.0  # a second of wall time for 4 tokens: lost
    pol.emitted(4)
    pol.end_episode()
    assert pol.losses[verify_key] == 1 and not pol.pays(rows, [True, True])  # 1.875 < 1.2 x 2.1
    rows[0].finished = True
    assert not pol.pays(rows, [True, True])  # one of its rows still runs: the loss holds
    rows[1].finished = True
    new = [Sequence(Request(id=f"y{i}", prompt_token_ids=(1, 2)), 2 + i, [1, 2], seed=0) for i in range(2)]
    for s in new:
        s.accept.accepted, s.accept.rejected = 1.0, 1.0
    assert pol.pays(new, [True, True]) and pol.losses[verify_key] == 0
