"""The drafting steps' proposals: which rows are probed, what the n-gram drafter proposes
for them, and whether the step drafts (the speculation policy decides). `Scheduler` inherits
these methods (`Drafting`), as it does `LaunchAhead`'s:

- `_proposals`: a generation step's drafts, or None for a plain step;
- `_propose`: the probed rows' proposals, scored and decided on (the probe's cost spaces the
  next one when the step does not draft);
- `_deferred_probe`: a probe that fell due at a step launched ahead, made in `postprocess`
  after that launch;
- `_paced`: whether prefill steps come between the batch's decode steps whatever it drafts
  (then drafting cannot cut a step, and the policy does not draft).

Why `_paced` (issue 14, measured on the H200 with spec_bench's copy set at batch 64): while
requests wait with room in the batch for them, or rows are still in their prompts, the
scheduler alternates a prefill step with a decode step over the ready rows; the number of
those decode steps is set by the prefills, not by the tokens each yields. Drafting there
costs a verify step in place of a plain one (and the overlap of the prefill after it) and
only makes rows finish sooner, so fewer run at once: 64 requests admitted two a step ran
174 verify steps over 19.3 rows on average, plain decoding 64-row steps, and speculation
was 0.90x plain though its drafts yielded 4.8 tokens a row. The run's end (the last rows'
tokens) is what drafting shortens: a ready row is worth drafting for while prefills go on
only if it has more tokens to go than any row still waiting or in its prompt may take.
"""

from __future__ import annotations

import time
from itertools import chain, islice
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
        paced = pol.adaptive and self._paced(rows)
        window, probed = pol.probe_window, pol.probe_rows(rows, paced)
        if window is None and pol.measure and any(s.ngram.skipped for s in probed):
            pol.untimed = True  # these proposals index what the probes skipped: one-time work, not the step's price
        out = dict(zip(map(id, probed), self.drafter.propose_many([s.all_ids for s in probed],
                                                                   [s.ngram for s in probed], window)))
        if pol.decide(rows, out, probed, paced):
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

    def _paced(self, rows: list[Sequence]) -> bool:
        """Whether a decode step over `rows` is one of those the prefills set the number of
        (module doc): requests wait with room for them in the batch, or running rows are still
        in their prompts, and no row of the step has more tokens to go (by max_tokens) than
        the longest of those may take. Not where requests wait for a full batch: there a row
        that finishes sooner lets one in sooner (drafting is priced as usual)."""
        if not self.waiting and len(rows) >= len(self.running):  # (every running row decodes: a drafting batch's case)
            return False
        room = self.plan.max_batch_size - len(self.running)
        if self.waiting and room <= 0:
            return False
        coming = list(chain(islice(self.waiting, max(room, 0)), (s for s in self.running if s.num_pending > 1)))
        if not coming:
            return False
        longest = max(map(_to_go, coming))
        return all(_to_go(s) <= longest for s in rows)


def _to_go(s: Sequence) -> int:
    """Tokens a sequence may still draw, by its max_tokens."""
    return s.facts.max_tokens - len(s.all_ids) + len(s.prompt_ids)
