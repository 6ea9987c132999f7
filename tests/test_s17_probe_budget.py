"""The probe budget (session 17): the probes that hope calls in a batch that does not draft are
bounded with the others to about PROBE_SHARE of the plain steps' measured time, while a batch
whose drafts start matching still probes at every step at first and enters drafting as soon."""

from __future__ import annotations

import math
import random

import pytest

from conftest import tiny_config
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.runtime.serving import speculation
from trtgraph.runtime.serving.requests import Request
from trtgraph.runtime.serving.scheduler import Sequence
from trtgraph.runtime.serving.speculation import PROBE_SHARE, SpeculationPolicy

K = 3
PLAN = BucketPlan.from_config(tiny_config(speculative={"draft_len": K}))
PLAIN, VERIFY = GraphKey(2, 0, 0, "greedy"), GraphKey(2, K, 0, "greedy")
CYCLE = [3, 4, 5, 6, 7, 8, 9]


def _policy(verify_ms: float) -> SpeculationPolicy:
    """A measured policy over 2 rows: plain steps of 1 ms, verify steps of `verify_ms` (frozen)."""
    pol = SpeculationPolicy(PLAN, K, {PLAIN: 1.0, VERIFY: verify_ms})
    pol.measure, pol.wall_ms = True, {PLAIN: 1.0, VERIFY: verify_ms}
    pol.record = lambda *a, **kw: None
    return pol


def _run(pol: SpeculationPolicy, copying: list[bool], steps: int, probe_ms: float = 0.05, seed: int = 0):
    """`steps` generation steps of 2 rows, each row's next token its cycle's successor (copying)
    or a random one; a probe (when `proposes`) offers each row the cycle's next K tokens (the
    n-gram drafter's proposal for a cycle) and costs `probe_ms` of host time when it does not
    draft. Returns (host ms spent on probes that did not draft, probes, hope-called probes,
    the step of the first draft decision or None)."""
    rng = random.Random(seed)
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=tuple(CYCLE * 3)), i, list(CYCLE * 3), seed=0)
            for i in range(2)]
    spent, first = 0.0, None
    probes, hope = pol.probes, pol.hope_probes
    for step in range(steps):
        for s, copies in zip(rows, copying):
            nxt = CYCLE[(CYCLE.index(s.all_ids[-1]) + 1) % len(CYCLE)] if s.all_ids[-1] in CYCLE else CYCLE[0]
            s.all_ids.append(nxt if copies else rng.randrange(10, 40))
        if not pol.proposes():
            continue
        last = [s.all_ids[-1] if s.all_ids[-1] in CYCLE else CYCLE[-1] for s in rows]
        proposals = {id(s): [CYCLE[(CYCLE.index(t) + 1 + j) % len(CYCLE)] for j in range(K)]
                     for s, t in zip(rows, last)}
        if pol.decide(rows, proposals):
            first = step if first is None else first
            continue
        pol.spaced(probe_ms / 1e3, rows, rows)
        spent += probe_ms
    return spent, pol.probes - probes, pol.hope_probes - hope, first


@pytest.mark.parametrize("budget", [1, 0])
def test_hope_called_probes_of_a_batch_that_never_drafts_stay_within_the_probe_share(monkeypatch, budget):
    """One row copies (its proposals accepted in full: each renews hope, so HOPE_LIMIT never
    stops it), the other's proposals are never accepted: drafting never pays (a verify step at
    3.5x a plain one), yet hope (4 tokens a row were the pending proposals accepted) calls a
    full probe at every step. With the budget, all the probes (50 us each
    against 1 ms plain steps: 5% if made at every step) take about PROBE_SHARE of the run's
    plain steps' time, beyond the PROBE_BURST full probes banked; with PROBE_BUDGET = 0 (the
    policy before it) they take 5%."""
    monkeypatch.setattr(speculation, "PROBE_BUDGET", budget)
    pol = _policy(3.5)
    steps = 4000
    spent, probes, hope, first = _run(pol, [True, False], steps)
    assert first is None and hope > 0.5 * probes
    share = spent / steps  # (plain steps of 1 ms)
    if budget:
        burst = speculation.PROBE_BURST * 0.025 * speculation.PROBE_ROWS  # (ms: 25 us a row)
        assert share <= PROBE_SHARE * 1.1 + burst / steps, share
        assert share >= 0.5 * PROBE_SHARE, share  # hope still probes, within its budget
    else:
        assert share > 4 * PROBE_SHARE, share


def test_hope_calls_an_early_full_probe_while_the_budget_allows_and_waits_out_its_debt(monkeypatch):
    """The budget starts full (PROBE_BURST full probes of PROBE_ROWS rows at least): a hopeful
    probe calls the next at the next step; once the probes have spent it, a hope-called probe
    comes at the first step where what the plain steps earned since (PROBE_SHARE of 1 ms each)
    pays the debt, and a prefill (new rows) keeps that wait; a draft decision fills the budget
    again, and the decision that stops drafting is not charged (its episode's cost)."""
    from trtgraph.runtime.serving.speculation import PROBE_BURST, PROBE_ROWS

    pol = _policy(3.5)
    rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(2)]
    proposals = {id(s): [7] * K for s in rows}  # pending, agreeing so far: hope (4 tokens a row would pay 3.5)
    pol.hoped = -1000  # (HOPE_LIMIT aside: as if proposals kept being accepted in full)
    intervals = []
    for _ in range(80):  # (the burst: PROBE_BURST * 8 rows * 25 us; each probe spends 50 us, earns 10)
        assert not pol.decide(rows, proposals) and pol.full_probe
        pol.spaced(0.00005, rows, rows)  # 25 us a row
        intervals.append(pol.interval)
        pol.since = pol.interval  # (the steps until the next probe)
    full = PROBE_BURST * 0.025 * PROBE_ROWS
    want, budget, gap = [], None, 0  # (ms; None: full, the first probe not charged)
    for _ in intervals:  # each probe: the steps since the last one earn PROBE_SHARE * 1 ms, the probe spends 0.05 ms
        budget = full if budget is None else min(budget + gap * PROBE_SHARE, full) - 0.05
        gap = 1 if budget >= 0 else math.ceil(-budget / PROBE_SHARE)
        want.append(gap)
    assert intervals == want and intervals[:PROBE_BURST] == [1] * PROBE_BURST, intervals
    assert intervals[-1] > 1 and pol.wait == intervals[-1]
    assert sum(intervals[-10:]) >= 0.05 * 10 / PROBE_SHARE - 1  # past the burst: 5 steps a probe
    pol.handed_out(None)  # a prefill: the hope-called probe still waits
    assert pol.interval == pol.wait > 1
    pol.wall_ms[VERIFY] = 0.5  # a draft decision: the budget fills again
    pol.since = 0
    assert pol.decide(rows, proposals) and pol.budget is None
    pol.wall_ms[VERIFY] = 3.5
    assert not pol.decide(rows, proposals)  # it stops drafting: that decision is not charged
    pol.spaced(0.00005, rows, rows)
    assert pol.interval == 1 and pol.budget == pytest.approx(full)


@pytest.mark.parametrize("verify_ms", [2.5, 3.4])
def test_a_batch_that_copies_enters_drafting_as_soon_as_without_the_budget(monkeypatch, verify_ms):
    """Both rows copy: hope's probes (at every step: 3 at a verify step of 2.5 plain ones, 10
    at 3.4, where K + 1 = 4 tokens a row barely pay) gather the evidence until drafting pays,
    at the same step with the budget as without it: the banked burst covers them, though
    each probe costs 200 us against 1 ms plain steps (20% of those steps' time)."""
    firsts = []
    for budget in (0, 1):
        monkeypatch.setattr(speculation, "PROBE_BUDGET", budget)
        firsts.append(_run(_policy(verify_ms), [True, True], 200, probe_ms=0.2)[3])
    assert firsts[0] is not None and firsts[0] >= 3 and firsts[1] == firsts[0], firsts
