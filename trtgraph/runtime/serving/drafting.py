"""The drafting steps' proposals: which rows are probed, what the n-gram drafter proposes
for them, and whether the step drafts (the speculation policy decides). `Scheduler` inherits
these methods (`Drafting`), as it does `LaunchAhead`'s:

- `_proposals`: a generation step's drafts, or None for a plain step;
- `_propose`: the probed rows' proposals, scored and decided on (the probe's cost spaces the
  next one when the step does not draft);
- `_deferred_probe`: a probe that fell due at a step launched ahead, made in `postprocess`
  after that launch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Sequence


class Drafting:
    """The scheduler's speculative proposals (mixed into `Scheduler`: its drafter, speculation
    policy, max_seq_len and the probe noted by `LaunchAhead._plain_next`)."""

    def _proposals(self, rows: list[Sequence]) -> dict | None:
        """Drafts by sequence (None where no n-gram matched), or None for a plain step: no
        drafter, a row too close to max_seq_len for K more positions, or the speculation
        policy finds drafting does not pay (no match in any row, or low expected acceptance)
        or makes no proposals this step (a batch that does not draft probes only now and then)."""
        if self.drafter is None or not rows:
            return None
        if not self.speculation.proposes():
            return None
        if any(len(s.all_ids) + self.drafter.k > self.max_seq_len for s in rows):
            if self.speculation.drafting:  # plain from here on: the steps may run ahead again
                self.speculation.drafting = False
                self.speculation.end_episode()
            return None
        return self._propose(rows)

    def _propose(self, rows: list[Sequence]) -> dict | None:
        """The proposals of the rows the policy probes (all of them while drafting), scored
        and decided on; they, or None when the step does not draft."""
        pol = self.speculation
        start = time.perf_counter()
        window, probed = pol.probe_window, pol.probe_rows(rows)
        out = dict(zip(map(id, probed), self.drafter.propose_many([s.all_ids for s in probed],
                                                                   [s.ngram for s in probed], window)))
        if pol.decide(rows, out, probed):
            return out
        pol.spaced(time.perf_counter() - start, rows, probed)
        return None

    def _deferred_probe(self) -> None:
        """The probe `_plain_next` noted, made now that the step it was due at is launched: over
        its rows still running, decided from the tokens known now. A draft decision makes the
        next step planned afresh (`schedule`), drafting."""
        rows, self._probe = [s for s in self._probe if not s.finished], None
        if rows and all(len(s.all_ids) + 1 + self.drafter.k <= self.max_seq_len for s in rows):
            if self._propose(rows) is not None:  # drafting from the step after the one in flight,
                self.speculation.emitted(len(rows))  # whose plain tokens count in the episode
