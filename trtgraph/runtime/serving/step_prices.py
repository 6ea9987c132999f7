"""What a generation step costs, for the speculation policy (`StepPrices`, mixed into
`SpeculationPolicy`): each key's measured wall time between consecutive generation steps (a running
mean over runs of one key's steps, `handed_out` in speculation.py times them), the manifest's replay
times until a key has been measured, and for a verify key not measured yet its replay plus the host
work the measured verify keys show, scaled to its rows with a per-step part (`_host_beyond_replay`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...buckets import GREEDY, SAMPLED, BatchShape, GraphKey, select
from ...errors import BucketMissError

WALL_WEIGHT = 0.25  # weight of the newest wall time in a key's running mean
HOST_STEP_ROWS = 16  # a verify step's per-step host work, in rows' worth of its per-row work (`_host_beyond_replay`)


@dataclass(slots=True)
class _Run:
    """Consecutive generation steps of one key, timed as a whole (`handed_out`)."""
    key: GraphKey
    first: float  # hand-out of the run's first step not yet folded into the key's mean
    steps: int  # steps handed out since `first`, that one included
    last: float  # the latest hand-out


class StepPrices:
    """The policy's step costs (state in SpeculationPolicy.__init__: plan, k, replay_ms, wall_ms,
    _host_ms, _keys, _run)."""

    def _flush(self) -> None:
        """Fold the current run's timed steps into its key's mean; the run goes on from its last step."""
        run = self._run
        if run is not None and run.steps > 1:
            self.record(run.key, 1e3 * (run.last - run.first) / (run.steps - 1), run.steps - 1)
            run.first, run.steps = run.last, 1

    def record(self, key: GraphKey, ms: float, n: int = 1) -> None:
        """Fold n steps of `key` that took `ms` each into its running mean (a verify key's: also
        what it costs beyond its replay, which prices the verify keys not measured yet)."""
        old = self.wall_ms.get(key)
        self.wall_ms[key] = ms if old is None else old + (1 - (1 - WALL_WEIGHT) ** n) * (ms - old)
        if key.draft_len and self.replay_ms.get(key):
            self._host_ms[key.sampling, key.batch_size] = max(self.wall_ms[key] - self.replay_ms[key], 0.0)

    def keys(self, rows: list, n: int | None = None) -> tuple[GraphKey, GraphKey] | None:
        """(plain, verify) keys of a step over `rows` (or over n rows like them), None where the
        plan has none (looked up once per batch size and sampling)."""
        s = GREEDY
        for q in rows:
            a = q.accept
            if a.sampled is None:
                a.sampled = not q.request.is_greedy
            if a.sampled:
                s = SAMPLED
                break
        n = len(rows) if n is None else n
        keys = self._keys.get((n, s), False)
        if keys is False:
            try:
                keys = self._keys[n, s] = (select(self.plan, BatchShape(n, 0, 0, s)),
                                           select(self.plan, BatchShape(n, self.k, 0, s)))
            except BucketMissError:
                keys = self._keys[n, s] = None
        return keys

    def costs(self, rows: list, n: int | None = None) -> tuple[float, float] | None:
        """(plain, verify) cost in ms of a step over `rows` (or over n rows like them):
        measured wall times; a key not measured yet, the other one measured scaled by the replay
        times' ratio, else its replay time; a verify key not measured yet costs at least its
        replay time plus the host work that measured verify keys show, scaled to its rows
        (`_host_beyond_replay`)."""
        return self._costs_of(self.keys(rows, n))

    def _costs_of(self, keys: tuple[GraphKey, GraphKey] | None) -> tuple[float, float] | None:
        """`costs` of the (plain, verify) keys `keys` (None: no such keys)."""
        if keys is None:
            return None
        plain, verify = keys
        self._flush()
        rp, rv = self.replay_ms.get(plain), self.replay_ms.get(verify)
        if not (rp and rv):
            return None
        wp, wv = self.wall_ms.get(plain), self.wall_ms.get(verify)
        if wp and wv:
            return wp, wv
        if wv:
            return wv * rp / rv, wv
        base, host = (wp * rv / rp if wp else rv), self._host_beyond_replay(verify)
        return wp or rp, max(base, rv + host) if host else base

    def _host_beyond_replay(self, verify: GraphKey) -> float:
        """What a verify key not measured yet is expected to cost beyond its replay: the host's
        work of the measured verify keys (same sampling); 0 when none is. That work is part per
        step and part per row (proposals, packing and bookkeeping go by rows): on the H200
        (spec_bench, the stdlib model, session 17) a verify step's wall beyond its replay was
        0.20-0.37 ms at 1 row, 0.38-0.39 at 8 and 1.14 at 64 (`scripts/spec_host.py`'s copy
        workload on the CPU: 226 us a step at 1 row, 334 at 8, 641 at 64). Above the largest
        measured batch size, where two are measured, the largest one's host work plus the rows
        beyond it at the per-row increment between the two largest, or, where more, that
        largest one's scaled by (rows + HOST_STEP_ROWS) / (its rows + HOST_STEP_ROWS) (two noisy
        small batches' increment says little: 0.37 ms at 1 row and 0.39 at 8 extrapolate to 0.55
        at 64 rows against 1.14 measured; scaled, 1.30); else the nearest measured one's scaled
        so: the per-step part counted as HOST_STEP_ROWS rows. (Scaled by the rows
        alone, as before session 17, 1 row's 0.37 ms priced an 8-row verify step's host work at
        2.9 ms against 0.39 measured, and a batch that copies never drafted after single
        requests had been served.)"""
        measured = sorted((b, ms) for (s, b), ms in self._host_ms.items() if s == verify.sampling)
        if not measured:
            return 0.0
        n = verify.batch_size
        _, b, ms = min((abs(b - n), b, ms) for b, ms in measured)
        scaled = ms * (n + HOST_STEP_ROWS) / (b + HOST_STEP_ROWS)
        if len(measured) > 1 and n > measured[-1][0]:
            (b0, ms0), (b1, ms1) = measured[-2:]
            return max(ms1 + max((ms1 - ms0) / (b1 - b0), 0.0) * (n - b1), scaled)
        return scaled
