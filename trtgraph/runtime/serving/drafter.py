"""Prompt-lookup drafting: propose the K tokens that followed the most recent earlier
occurrence of the sequence's last n tokens (n from ngram_max down to ngram_min), in its
prompt or its output. Host-side, no second model, O(new tokens) per step: each sequence
keeps an index from n-gram to where its latest earlier occurrence ended.

Policy for a sequence with no match: `propose` returns None. A step where no row has a
match runs as a plain decode step (no drafts, no wasted verification); in a step where
some rows match, a row without one is filled with copies of its last token (every row of
a uniform step needs K drafts); verification makes any draft safe. Whether a step with
matches drafts at all is the speculation policy's decision (speculation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """Per sequence: n-gram -> index of the token that followed its latest occurrence."""
    following: dict = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `following`


class NgramDrafter:
    def __init__(self, draft_len: int, ngram_min: int, ngram_max: int):
        self.k, self.n_min, self.n_max = draft_len, ngram_min, ngram_max

    def propose(self, ids: list[int], index: NgramIndex) -> list[int] | None:
        """K draft tokens to follow `ids`, or None when its suffix occurs nowhere earlier."""
        L = len(ids)
        # Index every n-gram whose following token exists, excluding the suffix itself.
        for end in range(index.indexed, L - 1):
            for n in range(self.n_min, self.n_max + 1):
                if end - n + 1 >= 0:
                    index.following[tuple(ids[end - n + 1:end + 1])] = end + 1
        index.indexed = max(index.indexed, L - 1)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            start = index.following.get(tuple(ids[L - n:]))
            if start is not None:
                drafts = ids[start:start + self.k]
                return drafts + [drafts[-1]] * (self.k - len(drafts))
        return None

    def filler(self, ids: list[int]) -> list[int]:
        return [ids[-1]] * self.k
