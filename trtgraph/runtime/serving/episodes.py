"""Drafting episodes, judged against plain decoding (`Episodes`, mixed into the speculation
policy, which prices steps by its costs and keys).

Each drafting episode (from the decision to draft to the one not to) is judged by what it
emitted per ms of wall time against a plain step's tokens per ms: the price of a verify step
misses costs that only the episode shows (its first proposals' indexing, the return to the
fast path). It is judged at its end and, from its JUDGE_STEPS-th verify step on, at each
verify step: an episode that loses clearly (under JUDGE_SHARE of plain's tokens per ms) stops
there (the batch's rows' estimates may keep promising what its verify steps do not yield);
judged before its end, its one-time work (indexing what the probes skipped: `sunk`) is left
out, since stopping would not undo it. A lost episode doubles the margin its verify key needs
to start drafting again (8x after MAX_LOSSES in a row: never, in practice); a won one clears
it, and so does the end of the sequences that lost (what lost was drafting for them, not for
the ones after).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...buckets import GraphKey

MAX_LOSSES = 3  # drafting episodes in a row that emitted fewer tokens per ms than plain steps: a verify key
#                then needs 2**losses times break-even to start again (8x: more than K + 1 tokens a row, never)
JUDGE_STEPS = 6  # a drafting episode is judged at each of its verify steps from this one on (and at its end) ...
JUDGE_SHARE = 0.75  # ... and stopped there when it emitted less than this share of what plain steps would have


@dataclass(slots=True)
class _Episode:
    """A drafting episode, from the decision to draft (`end_episode` judges it)."""
    key: GraphKey  # its verify key
    plain_ms_per_token: float  # a plain step's measured ms per row when it began
    start: float
    tokens: int  # emitted by its verify steps
    last: float  # when its last verify step's tokens came
    rows: tuple = ()  # its sequences: a loss it leaves is forgotten once they have all finished
    steps: int = 0  # its verify steps read so far
    sunk: float = 0.0  # seconds of one-time work in it (the policy's untimed intervals: indexing what probes skipped)


class Episodes:
    """The policy's drafting episodes (its `costs`, `keys`, `yields`, `drafting`, `losses`,
    `episodes`, `_episode` and `_lost_rows`)."""

    def _start_episode(self, rows: list) -> None:
        costs = self.costs(rows)
        now = time.perf_counter()
        self._episode = _Episode(self.keys(rows)[1], costs[0] / len(rows), now, 0, now, tuple(rows)) if costs else None

    def emitted(self, tokens: int, rows: int = 0) -> None:
        """A verify step over `rows` rows emitted `tokens` (accepted drafts and one more per
        row; rows 0: plain tokens that count in the episode). From its JUDGE_STEPS-th verify
        step on, an episode that has emitted less than JUDGE_SHARE of the tokens per ms plain
        steps would have ends here, lost (a clear loss: a few steps' wall times are noisy; its
        one-time work left out: what is indexed stays indexed, so it is no reason to stop): the
        next step probes afresh at the raised margin."""
        if rows:
            self.yields.got(tokens, rows)
        ep = self._episode
        if ep is not None:
            ep.tokens += tokens
            ep.last = time.perf_counter()
            ep.steps += rows > 0
            if ep.steps >= JUDGE_STEPS and self._lost(ep, ep.last - ep.sunk, JUDGE_SHARE):
                self.end_episode()
                self.drafting = False

    def end_episode(self, rows_changed: bool = False) -> None:
        """The batch stops drafting (or new rows come): judge the episode by what it emitted per
        ms of wall time, from the decision to draft to now (rows_changed: to its last verify
        step's tokens; what came after was not its doing: its rows finished, new ones came), its
        proposals, packing, lost overlap and first-step indexing included, against a plain
        step's tokens per ms. A loss doubles the margin that verify key needs to start again
        (up to 2**MAX_LOSSES: then only full acceptance in every row would start it); a win
        clears it."""
        ep, self._episode = self._episode, None
        if ep is None or ep.tokens == 0:
            return
        lost = self._lost(ep, ep.last if rows_changed else time.perf_counter())
        self.episodes[lost] += 1
        self.losses[ep.key] = min(self.losses.get(ep.key, 0) + 1, MAX_LOSSES) if lost else 0
        if lost:
            self._lost_rows[ep.key] = ep.rows

    @staticmethod
    def _lost(ep: _Episode, until: float, share: float = 1.0) -> bool:
        """Whether the episode emitted fewer tokens by `until` than `share` of what plain steps would have."""
        return ep.tokens * ep.plain_ms_per_token < share * 1e3 * (until - ep.start)

    def _losses(self, verify: GraphKey) -> int:
        """The verify key's lost episodes in a row, forgotten once the rows of the last one have
        all finished: what lost was drafting for those sequences (their acceptance, the price of
        their proposals), not for the ones that came after (a workload that copies, after one
        that did not)."""
        n, rows = self.losses.get(verify, 0), self._lost_rows.get(verify)
        if n and rows and all(s.finished for s in rows):
            self.losses[verify] = n = 0
        return n
