"""Graph keys, the bucket plan, `select()` and the coverage proof.

A GraphKey names one recorded graph. Every sequence in its step has the same query
length q = chunk_size or 1 + draft_len, so num_tokens = batch_size * q. `select()` is one
pure function: the smallest recorded key that fits a batch; a miss raises BucketMissError.
The coverage proof shows that every batch the scheduler may form maps to a key.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .errors import BucketMissError

GREEDY, SAMPLED = "greedy", "sampled"


@dataclass(frozen=True, order=True)
class GraphKey:
    batch_size: int
    draft_len: int = 0
    chunk_size: int = 0  # 0: generation step; C: prefill chunk of C query tokens per sequence
    sampling: str = GREEDY

    @property
    def q_len(self) -> int:
        return self.chunk_size or 1 + self.draft_len

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.q_len

    @property
    def is_prefill(self) -> bool:
        return self.chunk_size > 0

    @property
    def num_logit_rows(self) -> int:
        """Rows the step scores: every token of a generation step, the last of each prefill row."""
        return self.batch_size if self.is_prefill else self.num_tokens

    def as_dict(self) -> dict:
        return {"batch_size": self.batch_size, "draft_len": self.draft_len,
                "chunk_size": self.chunk_size, "sampling": self.sampling}

    def __str__(self) -> str:
        kind = f"prefill chunk={self.chunk_size}" if self.is_prefill else f"decode draft={self.draft_len}"
        return f"(bs={self.batch_size}, {kind}, {self.sampling})"


@dataclass(frozen=True)
class BatchShape:
    """What the scheduler formed: `num_seqs` rows of one query length."""
    num_seqs: int
    draft_len: int = 0
    chunk_size: int = 0
    sampling: str = GREEDY

    def __str__(self) -> str:
        kind = f"prefill chunk={self.chunk_size}" if self.chunk_size else f"decode draft={self.draft_len}"
        return f"batch of {self.num_seqs} ({kind}, {self.sampling})"


@dataclass(frozen=True)
class BucketPlan:
    """The recorded keys plus the runtime limits they must cover."""
    keys: tuple[GraphKey, ...]
    max_batch_size: int
    max_context_batch_size: int
    chunk_sizes: tuple[int, ...]
    draft_lens: tuple[int, ...]
    sampling: tuple[str, ...]
    chunk_rows: tuple[tuple[int, int], ...] = ()  # (chunk size, most rows a prefill step of it may hold)
    _index: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        index: dict[tuple, list[tuple[int, int, GraphKey]]] = {}
        for key in self.keys:
            for need in (GREEDY, SAMPLED):
                if need == SAMPLED and key.sampling != SAMPLED:
                    continue  # a greedy graph cannot serve sampled rows
                prefer = 0 if key.sampling == need else 1
                index.setdefault((key.draft_len, key.chunk_size, need), []).append(
                    (key.batch_size, prefer, key))
        for rows in index.values():
            rows.sort(key=lambda r: (r[0], r[1]))
        object.__setattr__(self, "keys", tuple(sorted(set(self.keys))))
        object.__setattr__(self, "_index", {k: ([r[0] for r in v], [r[2] for r in v]) for k, v in index.items()})

    @classmethod
    def from_config(cls, cfg) -> "BucketPlan":
        """Every key the config asks for: generation keys for each batch size, draft length
        and sampling mode; prefill keys for each chunk size and its context batch sizes."""
        b = cfg.buckets
        gen_sizes = b.generation_batch_sizes(cfg.limits.max_batch_size)
        keys = [GraphKey(bs, d, 0, s) for bs in gen_sizes for d in b.draft_lens for s in b.sampling]
        prefill = {c: b.prefill_batch_sizes(c, cfg.limits) for c in b.chunk_sizes}
        keys += [GraphKey(bs, 0, c, s) for c, sizes in prefill.items() for bs in sizes for s in b.sampling]
        return cls(keys=tuple(keys), max_batch_size=cfg.limits.max_batch_size,
                   max_context_batch_size=max(max(v) for v in prefill.values()), chunk_sizes=tuple(b.chunk_sizes),
                   draft_lens=tuple(b.draft_lens), sampling=tuple(b.sampling),
                   chunk_rows=tuple((c, max(v)) for c, v in prefill.items()))

    def with_keys(self, keys) -> "BucketPlan":
        return BucketPlan(keys=tuple(keys), max_batch_size=self.max_batch_size,
                          max_context_batch_size=self.max_context_batch_size, chunk_sizes=self.chunk_sizes,
                          draft_lens=self.draft_lens, sampling=self.sampling, chunk_rows=self.chunk_rows)

    def max_key_batch(self, chunk_size: int = 0, draft_len: int = 0) -> int:
        sizes = [k.batch_size for k in self.keys if k.chunk_size == chunk_size and k.draft_len == draft_len]
        return max(sizes, default=0)


def select(plan: BucketPlan, batch: BatchShape) -> GraphKey:
    """The smallest recorded key that fits `batch`; a greedy batch prefers a greedy key at
    equal size. Raises BucketMissError naming the batch and the nearest recorded keys."""
    entry = plan._index.get((batch.draft_len, batch.chunk_size, batch.sampling))
    if entry is not None and batch.num_seqs >= 1:
        sizes, keys = entry
        i = bisect.bisect_left(sizes, batch.num_seqs)
        if i < len(keys):
            return keys[i]
    raise BucketMissError(f"no recorded graph fits a {batch}; nearest recorded keys: "
                          f"{_nearest(plan, batch)}. Recapture with a bucket plan that covers it "
                          f"(buckets.batch_sizes / context_batch_sizes / chunk_sizes / sampling).")


def _nearest(plan: BucketPlan, batch: BatchShape, n: int = 4) -> str:
    def distance(k: GraphKey):
        return (k.chunk_size != batch.chunk_size, k.draft_len != batch.draft_len,
                k.sampling != batch.sampling, abs(k.batch_size - batch.num_seqs))

    near = sorted(plan.keys, key=distance)[:n]
    return ", ".join(str(k) for k in near) if near else "none"


def uncovered_shapes(plan: BucketPlan) -> list[str]:
    """Every batch the scheduler may form under the plan's limits that no key serves,
    compressed into ranges. Empty means the plan is covered."""
    misses: list[str] = []

    def check(kind: str, sizes: range, **shape):
        bad = []
        for n in sizes:
            try:
                select(plan, BatchShape(n, **shape))
            except BucketMissError:
                bad.append(n)
        if bad:
            misses.append(f"{kind} batches of {_ranges(bad)} ({', '.join(f'{k}={v}' for k, v in shape.items())})")

    for s in plan.sampling:
        for d in plan.draft_lens:
            check("generation", range(1, plan.max_batch_size + 1), draft_len=d, sampling=s)
        for c in plan.chunk_sizes:  # up to the most rows the config gives this chunk size
            most = dict(plan.chunk_rows).get(c, plan.max_context_batch_size)
            check("prefill", range(1, most + 1), chunk_size=c, sampling=s)
    return misses


def _ranges(ns: list[int]) -> str:
    out, start = [], ns[0]
    for a, b in zip(ns, ns[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)
