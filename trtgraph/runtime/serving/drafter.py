"""Prompt-lookup drafting: propose the K tokens that followed the most recent earlier
occurrence of the sequence's last n tokens (n from ngram_max down to ngram_min), in its
prompt or its output. Host-side, no second model, O(new tokens) per step: each sequence
keeps an index from n-gram to where its latest earlier occurrence ended.

Policy for a sequence with no match: `propose` returns None. A step where no row has a
match runs as a plain decode step (no drafts, no wasted verification); in a step where
some rows match, a row without one is filled with copies of its last token (every row of
a uniform step needs K drafts); verification makes any draft safe. Whether a step with
matches drafts at all is the speculation policy's decision (speculation.py).

An n-gram's key is one integer where the vocabulary allows (`bits` per token, ngram_max of
them in 63 bits: ngram_max 3 takes a vocabulary of up to 2**21 - 1 ids), else its tuple. With integer keys
`propose_many` proposes for a step's rows at once: the n-grams that the rows' few new tokens
end (a verify step's accepted run and bonus token) are coded for all rows by a handful of
numpy operations and enter each row's index by one `dict.update` (in C); per row what is
left is that update, its K + 1 lookups' worth of work and its drafts' slice. Its proposals are
`propose`'s, row by row (rows with many new tokens, a window to skip or skipped positions to
index take `propose`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

# A proposal without a window indexes at most this many of the positions earlier probes skipped
# (the newest first; the rest at the next proposals): the first drafting step of a large batch
# would otherwise index every row's whole prompt and output at once (tens of ms at 64 rows).
BACKFILL = 32
BIG = 64  # _index_codes codes longer stretches than this with numpy (list comprehensions below)
MANY_NEW = 8  # propose_many codes the n-grams of rows with at most this many new positions at once ...
MANY_ROWS = 16  # ... when there are at least this many (its numpy work costs ~20 us whatever the rows, and saves
#                 ~2 us a row: per row it is 3.5 us against 5.5 at 64 rows, 5.9 against 5.6 at 8, on the 2-core CPU)


@dataclass
class NgramIndex:
    """Per sequence: n-gram key -> index of the token that followed its latest occurrence."""
    following: dict = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `following`
    skipped: list = field(default_factory=list)  # (start, stop) of positions a probe left out


class NgramDrafter:
    def __init__(self, draft_len: int, ngram_min: int, ngram_max: int, vocab_size: int | None = None):
        """vocab_size: token ids are below it; where ngram_max of them fit in 63 bits (with one
        more value per token), n-grams are keyed by integers (`propose_many` batches them)."""
        self.k, self.n_min, self.n_max = draft_len, ngram_min, ngram_max
        bits = 63 // ngram_max
        self.bits = bits if vocab_size is not None and vocab_size < 1 << bits else None  # (id + 1 < 2**bits)

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
        if index.indexed < L - 1:
            self._index(ids, index, L - 1)
        get = index.following.get
        if self.bits is None:
            tail = tuple(ids[-self.n_max:])
            keys = (tail[-n:] for n in range(min(self.n_max, L), self.n_min - 1, -1))
        else:
            keys = self._suffix_codes(ids, min(self.n_max, L))
        for key in keys:
            start = get(key)
            if start is not None:
                return self._drafts(ids, start)
        return None

    def propose_many(self, seqs_ids: list[list[int]], indexes: list[NgramIndex],
                     window: int | None = None) -> list[list[int] | None]:
        """`propose` for each row (ids, index), the rows with few new tokens batched (module doc)."""
        if self.bits is None or len(seqs_ids) < MANY_ROWS:
            return [self.propose(ids, ix, window) for ids, ix in zip(seqs_ids, indexes)]
        out, batch, W = [None] * len(seqs_ids), [], self.n_max - 1 + MANY_NEW
        for i, (ids, ix) in enumerate(zip(seqs_ids, indexes)):
            m = len(ids) - 1 - ix.indexed  # new positions: the n-grams ending there are not indexed yet
            if 0 <= m <= MANY_NEW and len(ids) > W and (ix.skipped == [] if window is None else m <= window):
                batch.append(i)
            else:
                out[i] = self.propose(ids, ix, window)
        if len(batch) >= MANY_ROWS:
            self._propose_batch(seqs_ids, indexes, batch, out)
        else:
            for i in batch:
                out[i] = self.propose(seqs_ids[i], indexes[i], window)
        return out

    def _propose_batch(self, seqs_ids: list, indexes: list, batch: list[int], out: list) -> None:
        """The rows `batch` (each with at most MANY_NEW new positions, more than ngram_max - 1 +
        MANY_NEW tokens, nothing to skip or backfill): their last W + 1 tokens as one matrix,
        every n-gram ending at the last MANY_NEW + 1 positions coded at once."""
        B, M, W = self.bits, MANY_NEW, self.n_max - 1 + MANY_NEW
        ns = range(self.n_min, self.n_max + 1)
        w = np.fromiter(chain.from_iterable(seqs_ids[i][-W - 1:] for i in batch), np.int64,
                        len(batch) * (W + 1)).reshape(len(batch), W + 1) + 1  # [b, W + 1]
        lens = np.fromiter((len(seqs_ids[i]) for i in batch), np.int64, len(batch))
        codes, c = {}, w  # n -> [b, M + 1]: the n-grams ending at the last M + 1 positions
        for n in range(1, self.n_max + 1):
            if n > 1:
                c = (c[:, :-1] << B) | w[:, n - 1:]
            if n >= self.n_min:
                codes[n] = c[:, -M - 1:]
        # Row-major by position, then n ascending (the order `_index` writes in: a later position wins).
        new = np.stack([codes[n][:, :-1] for n in ns], axis=2).reshape(len(batch), -1).tolist()
        at = np.repeat(lens[:, None] - M + np.arange(M)[None, :], len(ns), axis=1).tolist()  # following position
        sfx = np.stack([codes[n][:, -1] for n in reversed(ns)], axis=1).tolist()  # the suffix, longest first
        per = len(ns)
        for r, i in enumerate(batch):
            ids, ix = seqs_ids[i], indexes[i]
            f, m = ix.following, len(ids) - 1 - ix.indexed
            if m:
                f.update(zip(new[r][-m * per:], at[r][-m * per:]))
                ix.indexed = len(ids) - 1
            get = f.get
            for key in sfx[r]:
                start = get(key)
                if start is not None:
                    out[i] = self._drafts(ids, start)
                    break

    def _drafts(self, ids: list[int], start: int) -> list[int]:
        drafts = ids[start:start + self.k]
        return drafts + [drafts[-1]] * (self.k - len(drafts)) if len(drafts) < self.k else drafts

    def _suffix_codes(self, ids: list[int], longest: int) -> list[int]:
        """The integer keys of the last n tokens, n from `longest` down to ngram_min."""
        B, out, code = self.bits, [], 0
        for n in range(1, longest + 1):
            code |= (ids[-n] + 1) << (B * (n - 1))
            out.append(code)
        return out[self.n_min - 1:][::-1]

    def _index(self, ids: list[int], index: NgramIndex, stop: int) -> None:
        """Index every n-gram ending at positions index.indexed .. stop - 1 (its following
        token exists; the suffix itself is left out), the latest occurrence winning."""
        a, f = index.indexed, index.following
        if self.bits is not None:
            self._index_codes(ids, a, stop, f)
        elif stop - a > 8:  # many at once (a prompt): built by zip, C-speed per n-gram
            for n in range(self.n_min, self.n_max + 1):
                lo = max(a, n - 1)
                if lo < stop:
                    f.update(zip(zip(*[ids[lo - n + 1 + j:stop - n + 1 + j] for j in range(n)]),
                                 range(lo + 1, stop + 1)))
        elif a < stop:  # a few new positions (a decode or verify step's): n-grams sliced from one tuple
            lo = max(a - self.n_max + 1, 0)
            t, ns = tuple(ids[lo:stop]), range(self.n_min, self.n_max + 1)
            for e in range(a - lo, stop - lo):  # position lo + e, its following token at lo + e + 1
                for n in ns:  # (e >= n - 1 always but near the start of ids, where lo is 0)
                    if e >= n - 1:
                        f[t[e - n + 1:e + 1]] = lo + e + 1
        index.indexed = max(a, stop)

    def _index_codes(self, ids: list[int], a: int, stop: int, f: dict) -> None:
        """`_index` with integer keys: the codes of each n from those of n - 1 (a token
        shorter), for all the positions at once (numpy for a long stretch, a prompt; list
        comprehensions for a few), entered by one update per n (the n-grams of one n in
        position order: a later occurrence wins; codes of different n never collide)."""
        if a >= stop:
            return
        B, lo = self.bits, max(a - self.n_max + 1, 0)
        if stop - a <= 8:  # a few (a decode or verify step's): each end's codes from one token to n_max
            t, n_min, n_max = ids[lo:stop], self.n_min, self.n_max
            for e in range(a - lo, stop - lo):
                code, pos = 0, lo + e + 1
                for n in range(1, min(n_max, e + 1) + 1):
                    code |= (t[e - n + 1] + 1) << (B * (n - 1))
                    if n >= n_min:
                        f[code] = pos
            return
        big = stop - lo > BIG
        w = np.asarray(ids[lo:stop], dtype=np.int64) + 1 if big else [t + 1 for t in ids[lo:stop]]
        c = w  # c[j]: the code of the n-gram ending at position lo + j + n - 1
        for n in range(1, self.n_max + 1):
            if n > 1:
                c = (c[:-1] << B) | w[n - 1:] if big else [(x << B) | y for x, y in zip(c, w[n - 1:])]
            first = max(a, n - 1)  # the first end position of an n-gram here
            if n >= self.n_min and first < stop:
                part = c[first - (lo + n - 1):]
                f.update(zip(part.tolist() if big else part, range(first + 1, stop + 1)))

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
