"""Adaptive speculation: which generation steps draft, and which run the plain decode key.

Each sequence keeps a running estimate of how many of its n-gram drafts would be accepted.
Every proposal is scored, drafted or not: the output is plain decoding's token for token, so
a proposal's accepted length is simply how far its drafts agree with the tokens that then
followed (a verify step's accepted count is the same number). The estimate is a per-draft
acceptance probability a (geometric model: the i-th draft survives with probability a**i),
exponentially weighted over the sequence's last proposals, so a sequence that stops matching
falls back to plain steps within a few proposals and one that starts matching drafts again.

A step over n rows drafts when the expected tokens per row times the plain key's replay time
exceeds the verify key's replay time (both from the manifest, for the keys these n rows
select): a row with a proposal is expected to emit 1 + a + a**2 + ... + a**K tokens, a row
without one (filled with copies of its last token) 1. A step where no row has a match never
drafts. Without replay times (a scheduler built without them) every step with a match
drafts. Only token ids and the manifest enter the decision, so steps are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...buckets import GREEDY, SAMPLED, BatchShape, BucketPlan, GraphKey, select
from ...errors import BucketMissError

DECAY = 0.75  # weight of a sequence's earlier proposals against its newest one
PRIOR = (1.0, 1.0)  # (accepted, rejected) pseudo-counts of a new sequence: a = 0.5


@dataclass
class Acceptance:
    """Per sequence: decayed counts of accepted drafts and of rejections (a proposal whose
    drafts were not all accepted ends in one), and the proposal awaiting its outcome."""
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    pending: tuple[int, list[int]] | None = None  # (position of the first draft, drafts)
    proposals: int = 0  # proposals scored so far
    drafts_matched: int = 0  # their drafts that the following tokens agreed with

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify row of this sequence is expected to emit: 1 + a + ... + a**k."""
        a = self.rate
        return sum(a ** i for i in range(k + 1))

    def observe(self, ids: list[int]) -> None:
        """Score the pending proposal against `ids` (prompt + output so far) once its outcome
        is known: a draft that disagrees with the token at its position, or all K agreeing."""
        if self.pending is None:
            return
        start, drafts = self.pending
        n = 0
        while n < len(drafts) and start + n < len(ids) and ids[start + n] == drafts[n]:
            n += 1
        if n < len(drafts) and start + n >= len(ids):
            return  # agrees so far; the tokens that decide it are not drawn yet
        self.accepted = DECAY * self.accepted + n
        self.rejected = DECAY * self.rejected + (n < len(drafts))
        self.proposals += 1
        self.drafts_matched += n
        self.pending = None

    def offer(self, position: int, drafts: list[int] | None) -> None:
        """The proposal made at `position` (len of ids), scored later unless one is pending."""
        if drafts is not None and self.pending is None:
            self.pending = (position, list(drafts))


class SpeculationPolicy:
    """Decides, per generation step, whether it drafts, from the rows' estimates and the
    replay times of the plain and verify keys they would select (milliseconds by key)."""

    def __init__(self, plan: BucketPlan, draft_len: int, replay_ms: dict[GraphKey, float] | None = None):
        self.plan, self.k = plan, draft_len
        self.replay_ms = dict(replay_ms or {})
        self.drafted_steps = 0  # decisions to draft
        self.plain_steps = 0  # steps with a match that ran the plain key (drafting did not pay)

    def _times(self, rows: list, sampled: bool) -> tuple[float, float] | None:
        s = SAMPLED if sampled else GREEDY
        try:
            plain = select(self.plan, BatchShape(len(rows), 0, 0, s))
            verify = select(self.plan, BatchShape(len(rows), self.k, 0, s))
        except BucketMissError:
            return None
        tp, tv = self.replay_ms.get(plain), self.replay_ms.get(verify)
        return (tp, tv) if tp and tv else None

    def pays(self, rows: list, matched: list[bool]) -> bool:
        """Whether a verify step over `rows` (Sequences; matched: which have a proposal) is
        expected to emit more tokens per millisecond than a plain step over them."""
        if not any(matched):
            return False
        times = self._times(rows, any(not s.request.is_greedy for s in rows))
        if times is None:
            return True  # no replay times: draft whenever a row matches
        t_plain, t_verify = times
        tokens = sum(s.accept.expected_tokens(self.k) if m else 1.0 for s, m in zip(rows, matched))
        return tokens * t_plain > len(rows) * t_verify

    def decide(self, rows: list, proposals: dict) -> bool:
        """Score every row's earlier proposal, offer its new one; whether this step drafts."""
        matched = []
        for s in rows:
            s.accept.observe(s.all_ids)
            d = proposals.get(id(s))
            s.accept.offer(len(s.all_ids), d)
            matched.append(d is not None)
        draft = self.pays(rows, matched)
        if draft:
            self.drafted_steps += 1
        elif any(matched):
            self.plain_steps += 1
        return draft

    def may_run_ahead(self, rows: list) -> bool:
        """Whether a plain step over `rows` may be launched before the last one's tokens are
        known: only when drafting would not pay even if every row had a proposal."""
        if not self.replay_ms:
            return False
        return not self.pays(rows, [True] * len(rows))
