"""Per sequence: the running estimate of how many of its n-gram drafts would be accepted
(speculation.py decides from it). Every proposal is scored against the tokens that then
followed, drafted or not: a per-draft acceptance probability a (the i-th draft survives with
probability a**i), exponentially weighted over the sequence's last proposals, from a
pessimistic prior (a = 0.25)."""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.75  # weight of a sequence's earlier proposals against its newest one
PRIOR = (0.5, 1.5)  # (accepted, rejected) pseudo-counts of a new sequence: a = 0.25


@dataclass
class Acceptance:
    """Per sequence: decayed counts of accepted drafts and of rejections (a proposal whose
    drafts were not all accepted ends in one), and the proposal awaiting its outcome."""
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    pending: tuple[int, list[int]] | None = None  # (position of the first draft, drafts)
    proposals: int = 0  # proposals scored so far
    drafts_matched: int = 0  # their drafts that the following tokens agreed with
    agreeing: int = 0  # drafts of the pending proposal that agree so far (counted as accepted)
    sampled: bool | None = None  # whether its request runs on the sampled keys (looked up once)

    @property
    def rate(self) -> float:
        accepted = self.accepted + self.agreeing
        return accepted / (accepted + self.rejected)

    def expected_tokens(self, k: int, hope: bool = False) -> float:
        """Tokens a verify row of this sequence is expected to emit: 1 + a + ... + a**k
        (hope: K + 1 where its pending proposal, which agrees so far, may yet be accepted in full)."""
        if hope and self.pending is not None:
            return k + 1.0  # (a pending proposal agrees so far: its best case)
        a = self.rate
        return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0

    def observe(self, ids: list[int]) -> bool:
        """Score the pending proposal against `ids` (prompt + output so far) once its outcome
        is known: a draft that disagrees with the token at its position, or all K agreeing.
        True when it was scored with all K agreeing."""
        if self.pending is None:
            return False
        start, drafts = self.pending
        k = len(drafts)
        if ids[start:start + k] == drafts:  # all K agree (the common case of a copying sequence): one compare
            n = k
        else:
            n = 0
            while n < k and start + n < len(ids) and ids[start + n] == drafts[n]:
                n += 1
        if n < len(drafts) and start + n >= len(ids):
            self.agreeing = n  # agrees so far; the tokens that decide it are not drawn yet
            return False
        self.agreeing = 0
        self.accepted = DECAY * self.accepted + n
        self.rejected = DECAY * self.rejected + (n < len(drafts))
        self.proposals += 1
        self.drafts_matched += n
        self.pending = None
        return n == len(drafts)

    def offer(self, position: int, drafts: list[int] | None) -> None:
        """The proposal made at `position` (len of ids), scored later unless one is pending."""
        if drafts is not None and self.pending is None:
            self.pending = (position, list(drafts))


YIELD_WEIGHT = 0.25  # weight of the newest verify step in a key's running mean of yield / expectation


class Yields:
    """Per verify key: what its verify steps actually emitted per row against what the
    policy expected when it decided to draft them (the rows' `expected_tokens`), as a
    running mean of the ratio. The policy scales its expectation by it where it is below 1:
    a step is priced by what steps like it yielded, not by the estimates alone (a row's
    estimate does not see what the batch loses: a row cut by max_tokens, a filler row)."""

    def __init__(self):
        self.ratio: dict = {}  # verify key -> running mean of emitted / expected tokens per row
        self._expected: tuple | None = None  # (verify key, expected tokens per row) of the step drafted last

    def expect(self, key, per_row: float) -> None:
        """A verify step over `key` was decided on, expected to emit `per_row` tokens a row."""
        self._expected = (key, per_row) if per_row > 0 else None

    def got(self, tokens: int, rows: int) -> None:
        """The verify step decided last emitted `tokens` over `rows` rows."""
        if self._expected is None or rows <= 0:
            return
        (key, per_row), self._expected = self._expected, None
        r, old = tokens / rows / per_row, self.ratio.get(key)
        self.ratio[key] = r if old is None else old + YIELD_WEIGHT * (r - old)

    def factor(self, key) -> float:
        """What the estimates are scaled by for `key`: its running ratio, at most 1."""
        return min(self.ratio.get(key, 1.0), 1.0)
