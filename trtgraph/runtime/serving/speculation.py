"""Adaptive speculation: which generation steps draft, and which run the plain decode key.

Each sequence keeps a running estimate of how many of its n-gram drafts would be accepted.
Every proposal made is scored, drafted or not: the output is plain decoding's token for
token, so a proposal's accepted length is simply how far its drafts agree with the tokens that
then followed (a verify step's accepted count is the same number). The estimate is a
per-draft acceptance probability a (geometric model: the i-th draft survives with probability
a**i), exponentially weighted over the sequence's last proposals, from a pessimistic prior
(a = 0.25: a sequence shows that its drafts match before the batch drafts for it); the drafts
of a proposal still awaiting its outcome that agree so far count as accepted already.

A step over n rows drafts when its expected tokens per row times the plain step's cost
exceed the verify step's cost: a row with a proposal is expected to emit 1 + a + ... + a**K
tokens, a row without one (filled with copies of its last token) 1. A step where no row has
a match never drafts; a batch that does not draft needs 5% more than break-even to start.
The costs are, per key, the measured wall time between consecutive generation steps (an
EWMA, `measure` on; it holds the host's work too: proposals, the full-path packing of a
verify step, the lost overlap), and the manifest's replay times until a key has been
measured (one measured key prices the other by the replay times' ratio; a verify key not
measured yet costs at least its replay plus the host work that the measured verify keys
show, scaled to its rows with a per-step part: that host work, not the replay, is most of a
verify step's cost).

Proposals cost host time on every row, so a batch that does not draft makes none: it runs
plain steps on the fast path, launched ahead of the last one's tokens, and probes (makes
proposals, scores the earlier ones, decides) only every `interval` generation steps, for
a sample of about PROBE_ROWS rows in a larger batch (a hopeful sample calls a full probe at
the next step, which may draft), indexing at most PROBE_WINDOW new tokens per row; the
interval doubles after each probe that does not draft (1, 2, 4, ... MAX_INTERVAL), unless
the proposals awaiting their outcome (which agree so far) would make drafting pay were they
accepted in full (at most HOPE_LIMIT probes in a row where a verify step costs more than a
plain one, unless proposals keep being accepted in full: a batch whose proposals look hopeful
but fail does not make proposals at every step, one that copies gathers the evidence until
its estimate pays), and it returns to 1 while drafting and after a prefill step (new rows;
hope survives it). With `measure`, each probe
that does not draft is timed, and the next comes no sooner than keeps probes within
PROBE_SHARE of the plain steps' measured time (a full probe of 64 rows is rare; after a
prefill, too: prompts admitted a chunk of rows at a time do not call a probe at every decode
step in between), unless the probe was hopeful. The probes that hope calls are bounded by a
budget instead (`spaced`): each plain step earns PROBE_SHARE of the plain key's measured time,
each probe that does not draft spends its host time, the budget banks PROBE_BURST full probes
at most (of PROBE_ROWS rows at least; it starts full, and again when the batch stops drafting:
the decisions of a drafting batch, the one that stops it included, are its episode's cost),
and a probe that hope calls comes
at the next step while the budget is not in debt, else at the first step where it is out of
debt: all the probes of a batch that does not draft, hope's included, take about PROBE_SHARE
of its steps' time beyond the banked burst, and a batch whose drafts start matching still
probes at every step at first (on the H200 before the budget, hope-called probes of batches
that never drafted took 0.8-2.5% of the run's time, which ran 1-4% slower than plain
decoding; PROBE_BUDGET = 0 restores that behaviour). A probe due at a step
launched ahead is made after that launch (the scheduler's postprocess of the step before), so
a batch that does not draft runs the plain engine's path: the same steps launched ahead (the
decode step after a prefill included), no proposal before a launch, and per step only a clock
read and a count (consecutive steps of one key are timed as one run).

Each drafting episode is judged against plain steps (episodes.py): a lost one stops drafting
(at its end, or at a verify step once it has run JUDGE_STEPS of them) and raises the margin its
verify key needs. What verify steps really emitted per row, against what the rows' estimates
promised, scales those estimates (`acceptance.Yields`, at most 1): a step is priced by what
steps like it yielded. A decode step that prefill steps pace (requests wait with room in the
batch, or rows are in their prompts: the number of those decode steps is set by the prefills)
never drafts (`Drafting._paced`: drafting there would cut no step); its probes are samples
(a full probe that hope calls is made at the first unpaced step).

Without replay times (a scheduler built without them) every step proposes, and every step
with a match drafts. Which steps draft depends on measured times; what every row emits does
not (verification).
"""

from __future__ import annotations

import math
import sys
import time

from ...buckets import BucketPlan, GraphKey
from .acceptance import Yields
from .episodes import JUDGE_STEPS, MAX_LOSSES, Episodes  # noqa: F401 (re-exported: the policy's constants)
from .step_prices import HOST_STEP_ROWS, WALL_WEIGHT, StepPrices, _Run  # noqa: F401 (re-exported)

ENTER_MARGIN = 1.05  # a batch that does not draft starts when drafting pays 5% over break-even
MAX_INTERVAL = 64  # generation steps between probes of a batch that does not draft, at most
PROBE_WINDOW = 16  # a probe indexes at most this many of a row's not yet indexed tokens
PROBE_ROWS = 8  # a probe of a larger batch that does not draft samples about this many rows
PROBE_SHARE = 0.01  # a batch that does not draft spends at most about this share of its steps' time on probes
PROBE_WEIGHT = 0.25  # weight of the newest probe's cost per row in its running mean
MAX_FLOOR = 4 * MAX_INTERVAL  # generation steps between probes that their cost may call for, at most
HOPE_LIMIT = 4  # probes in a row that hope alone (pending proposals that would pay if accepted) keeps every step
#                where a verify step costs more than a plain one (each one also waits for the probe budget)
PROBE_BUDGET = 1  # 1: the probes that hope calls wait while the probes' budget (PROBE_SHARE of the plain steps'
#                   time, earned step by step) is in debt; 0: they come at the next step (before session 17)
PROBE_BURST = 8  # the probe budget banks at most this many full probes of the batch, of PROBE_ROWS rows at least
#                 (hope's early probes)


class SpeculationPolicy(Episodes, StepPrices):
    """Decides, per generation step, whether it makes proposals and whether it drafts, from
    the rows' estimates and the costs of the plain and verify keys they would select."""

    def __init__(self, plan: BucketPlan, draft_len: int, replay_ms: dict[GraphKey, float] | None = None):
        self.plan, self.k = plan, draft_len
        self.replay_ms = dict(replay_ms or {})
        self.measure = False  # time generation steps (the engine turns it on for CUDA)
        self.wall_ms: dict[GraphKey, float] = {}  # running mean of each key's measured step time
        self.drafted_steps = 0  # decisions to draft
        self.plain_steps = 0  # steps with a match that ran the plain key (drafting did not pay)
        self.probes = 0  # decisions made (steps that computed proposals)
        self.probe_seconds = 0.0  # host time of the probes that did not draft (`spaced`), all told
        self.hope_probes = 0  # decisions at a probe the last one's hope called (`full_probe`): the budget spaces those
        self.drafting = False  # the last decision drafted
        self.interval = 1  # generation steps from one decision to the next
        self.floor = 0  # generation steps from one probe to the next, at least, for the probes' cost (`spaced`)
        self.row_ms: float | None = None  # running mean of a probe's host ms per probed row
        self.budget: float | None = None  # ms of probe time the batch may spend (`spaced`; < 0: in debt; None: full)
        self.wait = 0  # generation steps from the last probe until the budget is out of debt (a hope-called probe's)
        self._gap = 0  # generation steps from the decision before the last one to the last (what the budget earned)
        self.since = 0  # generation steps handed out since the last decision
        self.full_probe = False  # the next probe makes proposals for every row (a sample was hopeful)
        self.hoped = 0  # probes in a row since the last draft or prefill that hope alone kept at interval 1
        self.losses: dict[GraphKey, int] = {}  # verify key -> its last drafting episodes that lost, in a row
        self.episodes = [0, 0]  # drafting episodes judged: (won, lost)
        self._episode = None  # the drafting episode under way (episodes.py)
        self._lost_rows: dict[GraphKey, tuple] = {}  # verify key -> the rows of its last lost episode
        self._host_ms: dict[tuple, float] = {}  # (sampling, batch size) -> a measured verify step's ms beyond its replay
        self._run: _Run | None = None  # the current run of one generation key's steps
        self._keys: dict = {}  # (rows, sampling) -> (plain key, verify key), or None (no such keys)
        self.yields = Yields()  # per verify key: tokens its steps emitted against the estimates' expectation
        self.paced_steps = 0  # decisions at steps the prefills pace (Drafting._paced): never drafted
        self.untimed = False  # the interval ending at the next hand-out holds one-time work: not a step's price
        self._seen: set = set()  # verify keys handed out so far (the first replay of a graph uploads it)
        self._raw = 0.0  # the last `pays`'s expected tokens per row, before the yield factor

    @property
    def adaptive(self) -> bool:
        """With replay times the policy prices steps (and probes); without, it drafts on any match."""
        return bool(self.replay_ms)

    # ---- costs ---------------------------------------------------------------------------
    def handed_out(self, key: GraphKey | None) -> None:
        """A step was handed out (key None: a prefill step, or none). After a prefill the
        probes start again from an interval of 1, or the floor their measured cost sets, or (a
        probe that hope called) the wait the probe budget set (its new rows have no estimate
        yet; a prefill of a few rows at a time among decode steps does not call a probe at
        every decode step between them). With
        `measure`, the time from one generation step's hand-out to the next one's is that step's
        wall time: consecutive steps of one key are a run, timed as a whole (a clock read and a
        count per step; the key's mean is updated when the run ends or a decision needs it). An
        interval marked `untimed` is left out of the means (and of the drafting episode's time
        when it is judged before its end): one-time work, not what a step of that key costs
        while the batch drafts on — a verify key's first step (its graph's first replay) and a
        step whose proposals index what the probes skipped (the first drafting steps of an
        episode: at 64 rows on the H200 those measured 4-6 ms a step, and a mean started there
        kept the batch from drafting again). The common case, a step of the run's key again
        (a plain batch's every fast-path step), is a clock read and a count."""
        run = self._run
        if run is not None and key is run.key and not self.untimed and self.measure:  # (run.key: handed out, seen)
            run.steps += 1
            run.last = time.perf_counter()
            return
        if key is None:  # new rows (a prefill): probe soon (the next generation step, or as soon as the probes'
            # cost allows, or where proposals awaiting their outcome hope, as soon as the probe budget allows:
            # `wait`, `spaced`), backing off afresh
            self.interval, self.hoped = max(self.wait, 1) if self.full_probe else max(self.floor, 1), 0
            if self._episode is not None:
                self.end_episode(rows_changed=True)
        if not self.measure:
            return
        now = time.perf_counter()
        if key is not None and key.draft_len and key not in self._seen:
            self._seen.add(key)
            untimed, self.untimed = self.untimed, True  # (its own step: the interval ending at the next hand-out)
        else:
            untimed, self.untimed = self.untimed, False
        if untimed and run is not None:  # the interval ending now held one-time work
            self._flush()
            if self._episode is not None:
                self._episode.sunk += now - run.last
            self._run = _Run(key, now, 1, now) if key is not None else None
            return
        if run is not None and key is not None:
            run.steps += 1  # a step of the run is handed out, or (another key) the run's last step ends now
            run.last = now
            if key is run.key or key == run.key:
                return
        self._flush()
        self._run = _Run(key, now, 1, now) if key is not None else None

    # ---- decisions -----------------------------------------------------------------------
    def pays(self, rows: list, matched: list[bool], hope: bool = False, n: int | None = None) -> bool:
        """Whether a verify step over `rows` (Sequences; matched: which have a proposal) is
        expected to emit more tokens per millisecond than a plain step over them (a batch
        not drafting now: by ENTER_MARGIN more). hope: were the pending proposals accepted.
        n: the rows are a sample of a batch of n rows like them."""
        self._raw = 0.0
        if not any(matched):
            return False
        n = len(rows) if n is None else n
        keys = self.keys(rows, n)  # (looked up once: a probe calls this twice, at every row)
        costs = self._costs_of(keys)
        if costs is None:
            return True  # no replay times: draft whenever a row matches
        t_plain, t_verify = costs
        k = self.k
        tokens = sum(s.accept.expected_tokens(k, hope) if m else 1.0 for s, m in zip(rows, matched))
        self._raw = tokens / len(rows)
        verify = keys[1]
        margin = 1.0 if self.drafting else ENTER_MARGIN * 2 ** self._losses(verify)
        return tokens * self.yields.factor(verify) * n / len(rows) * t_plain > n * t_verify * margin

    def proposes(self) -> bool:
        """Count a generation step formed afresh; whether it makes proposals: always without
        replay times, else while drafting or when a probe is due."""
        if not self.adaptive:
            return True
        self.since += 1
        return self.drafting or self.since >= self.interval

    def probe_due(self) -> bool:
        """Count a plain generation step launched ahead (`may_run_ahead`); whether a probe is due at it."""
        self.since += 1
        return self.since >= self.interval

    def probe_rows(self, rows: list, paced: bool = False) -> list:
        """The rows that make proposals at this step: all of them while drafting, at a full
        probe, or in a batch of at most PROBE_ROWS; else a sample (every stride-th row, from an
        offset that turns with each probe). paced: the step does not draft (`decide`), so a
        sample (a full probe called waits for the first unpaced step)."""
        if not self.adaptive or len(rows) <= PROBE_ROWS or not paced and (self.drafting or self.full_probe):
            return rows
        stride = -(-len(rows) // PROBE_ROWS)
        return rows[self.probes % stride::stride]

    def decide(self, rows: list, proposals: dict, probed: list | None = None, paced: bool = False) -> bool:
        """Score each probed row's earlier proposal, offer its new one (probed: the rows that
        proposed, `probe_rows`; default all); whether this step drafts. A sample never drafts:
        it calls a full probe at the next step when the batch it stands for would pay. A paced
        step (prefill steps come between the batch's decode steps whatever it drafts, so
        drafting cuts none: `Drafting._paced`) never drafts; hope goes on as at any probe, its
        full probe made at the first unpaced step (`probe_rows`), and there only a proposal
        scored short of full acceptance uses up HOPE_LIMIT (paced decode steps come one in two:
        a proposal's K tokens take twice the probes to decide)."""
        probed = rows if probed is None else probed
        self.hope_probes += self.full_probe
        matched, confirmed, scored = [], False, 0
        for s in probed:  # (observe and offer called only where they have work: a probe's per-row cost)
            a = s.accept
            if a.pending is not None:
                scored -= a.proposals
                confirmed |= a.observe(s.all_ids)
                scored += a.proposals
            d = proposals.get(id(s))
            if d is not None:
                a.offer(len(s.all_ids), d)
            matched.append(d is not None)
        full = len(probed) == len(rows)
        draft = full and not paced and self.pays(rows, matched)
        if draft:
            self.yields.expect(self.keys(rows)[1], self._raw)
            self.drafted_steps += 1
        elif any(matched):
            self.plain_steps += 1
        self.probes += 1
        self._gap, self.since = self.since, 0
        # Probe again (all rows) at the next step while drafting, or while the proposals
        # awaiting their outcome would make drafting pay if accepted in full (HOPE_LIMIT times
        # in a row at most, unless proposals keep being accepted in full: evidence that
        # gathers until the estimate pays, or shows it does not); else back off.
        if confirmed:
            self.hoped = 0
        self.paced_steps += paced
        hopeful = draft or ((self.hoped < HOPE_LIMIT or self._verify_is_cheap(rows)) and self.pays(
            probed, [s.accept.pending is not None for s in probed], hope=True, n=len(rows)))
        self.hoped = 0 if draft else self.hoped + (hopeful and (not paced or scored > confirmed))
        self.interval = 1 if hopeful else min(2 * self.interval, MAX_INTERVAL)
        self.full_probe = hopeful and not draft
        if draft != self.drafting and self.measure:
            self._start_episode(rows) if draft else self.end_episode()
        if draft or self.drafting:  # (the budget is full again once the batch stops drafting: its decisions,
            self.budget = None  # the one that stops it included, are its episode's cost, judged there)
        self.drafting = draft
        return draft

    def spaced(self, seconds: float, rows: list, probed: list) -> None:
        """A probe that did not draft took `seconds` of host time for its `probed` rows: the next
        one comes no sooner than keeps probing under PROBE_SHARE of a plain step's measured time,
        priced at the running mean cost per probed row (one slow probe, a GC pause say, moves it
        a quarter of the way) times the next probe's rows (a full probe of a large batch: rarely;
        of one row: every few steps at most), and MAX_FLOOR steps at most.
        A probe that hope calls (`full_probe`) is not spaced so; the probe budget bounds it: each
        plain step since the last probe earned PROBE_SHARE of the plain key's measured time,
        each probe that does not draft spends its host time, the budget banks PROBE_BURST full
        probes at most (of PROBE_ROWS rows at least: a batch admitted a few rows at a time
        grows; a long quiet run does not bank more; full at the first timed probe and when the
        batch stops drafting, that decision not charged: `decide`), and the probe
        that hope calls comes at the first step where the budget is out of debt (the next step
        when it is not in debt: hope's early probe), MAX_FLOOR steps at most (a debt beyond what
        MAX_FLOOR plain steps earn is forgiven: one slow probe, a GC pause say, does not hold
        every hope-called probe after it at MAX_FLOOR until the plain steps have earned it
        back). So all the probes of a batch that does not draft, those that hope calls included, take about PROBE_SHARE
        of its steps' time beyond the banked burst (PROBE_BUDGET 0: hope's are not bounded so).
        Arithmetic at probes only: the steps between them are counted by `since` anyway."""
        self.probe_seconds += seconds
        self.wait = 0
        costs = self.costs(rows) if self.measure else None
        if costs is None or costs[0] <= 0:
            return
        ms = 1e3 * seconds / max(len(probed), 1)
        self.row_ms = ms if self.row_ms is None else self.row_ms + PROBE_WEIGHT * (ms - self.row_ms)
        nxt = len(self.probe_rows(rows))
        earn = PROBE_SHARE * costs[0]  # ms of probe time a plain step earns
        self.floor = min(math.ceil(self.row_ms * nxt / earn), MAX_FLOOR)
        burst = PROBE_BURST * self.row_ms * max(len(rows), PROBE_ROWS)
        # (None: the first timed probe, or the decision that stopped drafting: not charged)
        left = burst if self.budget is None else min(self.budget + self._gap * earn, burst) - 1e3 * seconds
        self.budget = max(left, -MAX_FLOOR * earn)  # (a debt beyond what MAX_FLOOR steps earn: forgiven)
        if not self.full_probe:  # (a hopeful probe calls the next at the next step, the budget allowing)
            self.interval = max(self.interval, self.floor)
        elif PROBE_BUDGET and self.budget < 0:
            self.wait = self.interval = min(math.ceil(-self.budget / earn), MAX_FLOOR)

    def _verify_is_cheap(self, rows: list) -> bool:
        """A verify step over `rows` costs no more than a plain one (then HOPE_LIMIT does not stop
        hope: probing at every step that hope calls for is worth it however long it lasts, as
        far as the probe budget allows: `spaced`)."""
        costs = self.costs(rows)
        return costs is not None and costs[1] <= costs[0]

    @property
    def probe_window(self) -> int | None:
        """How many not yet indexed tokens a proposal indexes (None: all): a probe of a batch
        that does not draft indexes only the newest ones, so probing stays cheap."""
        return None if not self.adaptive or self.drafting else PROBE_WINDOW

    def may_run_ahead(self) -> bool:
        """Whether the next step may be launched before the last one's tokens are known: a
        batch that does not draft (a probe due then is made from the tokens known so far,
        without waiting: the scheduler's extend_decode)."""
        return self.adaptive and not self.drafting


def set_constant(name: str, value: str) -> int | float:
    """Set one of the policy's numeric constants to `value` in the module that reads it (this one or
    step_prices.py), for A/B runs (the benches' --policy NAME=VALUE); episodes.py's are read there and
    are not set here. Returns the value set; ValueError names what is settable."""
    from . import episodes, step_prices
    home = step_prices if name in vars(step_prices) else sys.modules[__name__]
    old = vars(home).get(name)
    if not name.isupper() or isinstance(old, bool) or not isinstance(old, (int, float)) or name in vars(episodes):
        raise ValueError(f"{name!r} is not a numeric constant of trtgraph/runtime/serving/speculation.py or "
                         "step_prices.py (episodes.py's are not settable)")
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name}={value!r}: the value is not a number >= 0")
    setattr(home, name, type(old)(number))
    return getattr(home, name)
