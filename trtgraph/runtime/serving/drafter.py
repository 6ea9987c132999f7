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

# A proposal without a window indexes at most this many of the positions earlier probes skipped
# (the newest first; the rest at the next proposals): the first drafting step of a large batch
# would otherwise index every row's whole prompt and output at once (tens of ms at 64 rows).
BACKFILL = 32


@dataclass
class NgramIndex:
    """Per sequence: n-gram -> index of the token that followed its latest occurrence."""
    following: dict = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `following`
    skipped: list = field(default_factory=list)  # (start, stop) of positions a probe left out


class NgramDrafter:
    def __init__(self, draft_len: int, ngram_min: int, ngram_max: int):
        self.k, self.n_min, self.n_max = draft_len, ngram_min, ngram_max

    def propose(self, ids: list[int], index: NgramIndex, window: int | None = None) -> list[int] | None:
        """K draft tokens to follow `ids`, or None when its suffix occurs nowhere earlier.
        window: index at most this many of the n-grams not indexed yet (the newest) and note
        the older ones as skipped: a cheap probe (any draft is safe; a skipped one is just not
        found). A proposal without a window first indexes up to BACKFILL of the positions the
        probes skipped, the newest first."""
        L = len(ids)
        if window is not None and L - 1 - window > index.indexed:
            index.skipped.append((index.indexed, L - 1 - window))
            index.indexed = L - 1 - window
        elif window is None and index.skipped:
            self._backfill(ids, index)
        self._index(ids, index, L - 1)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            start = index.following.get(tuple(ids[L - n:]))
            if start is not None:
                drafts = ids[start:start + self.k]
                return drafts + [drafts[-1]] * (self.k - len(drafts))
        return None

    def _index(self, ids: list[int], index: NgramIndex, stop: int) -> None:
        """Index every n-gram ending at positions index.indexed .. stop - 1 (its following
        token exists; the suffix itself is left out), the latest occurrence winning."""
        a, f = index.indexed, index.following
        if stop - a > 8:  # many at once (a prompt): built by zip, C-speed per n-gram
            for n in range(self.n_min, self.n_max + 1):
                lo = max(a, n - 1)
                if lo < stop:
                    f.update(zip(zip(*[ids[lo - n + 1 + j:stop - n + 1 + j] for j in range(n)]),
                                 range(lo + 1, stop + 1)))
        else:
            for end in range(a, stop):
                for n in range(self.n_min, self.n_max + 1):
                    if end - n + 1 >= 0:
                        f[tuple(ids[end - n + 1:end + 1])] = end + 1
        index.indexed = max(a, stop)

    def _backfill(self, ids: list[int], index: NgramIndex, budget: int = BACKFILL) -> None:
        """Index up to `budget` skipped positions, the newest first (what is left stays
        skipped); an n-gram already indexed keeps its later occurrence."""
        f = index.following
        while index.skipped and budget > 0:
            start, stop = index.skipped[-1]
            lo = max(start, stop - budget)
            part = NgramIndex(indexed=lo)
            self._index(ids, part, stop)
            for key, pos in part.following.items():
                if f.get(key, -1) < pos:
                    f[key] = pos
            budget -= stop - lo
            if lo == start:
                index.skipped.pop()
            else:
                index.skipped[-1] = (start, lo)

    def filler(self, ids: list[int]) -> list[int]:
        return [ids[-1]] * self.k
