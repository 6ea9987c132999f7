"""Per-key verification: replay against the eager path on fresh random valid inputs. It can be
launched and read later (`launch_verify`): the capture reads a key's result after it has
launched the next key's work, so the host's launches overlap the device's runs and nothing
waits on the whole queue. A prefill key's verification replay is also its replay time
(compiler/timing.py: `timed_by_verification`, `VerificationTiming`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buckets import SAMPLED, GraphKey
from ..errors import ConfigError
from ..runtime.step.executor import Executor, StepRow
from ..runtime.step.kv_cache import blocks_for_tokens
from ..runtime.warmup import allocated_bytes
from .timing import _spin, _StepClock, timed_by_verification

# Replay and eager run the same kernels on the same inputs; any gap beyond this is a bug.
LOGIT_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


@dataclass
class Parity:
    max_abs_logit_diff: float
    tokens_equal: bool
    ok: bool
    eager_ms: float = 0.0  # the eager step's time (random valid inputs, one run: the manifest's eager_ms)


def random_rows(ex: Executor, key: GraphKey, gen: torch.Generator) -> list[StepRow]:
    """A full batch of valid rows: random tokens, context lengths and scattered blocks, and
    (for sampled keys) random sampling settings, some rows greedy."""
    lim, bs, q = ex.config.limits, ex.block_size, key.q_len
    vocab = ex.loaded.config.vocab_size
    budget = (ex.num_blocks - 1) // key.batch_size  # blocks each row may own
    max_len = min(lim.max_seq_len, budget * bs)
    if max_len < q:
        need = key.batch_size * blocks_for_tokens(q, bs) + 1  # block 0 is reserved
        raise ConfigError(f"kv_cache.num_blocks = {ex.num_blocks} cannot hold the key {key}: its "
                          f"{key.batch_size} rows of {q} tokens need at least {need} blocks of {bs} tokens "
                          f"(capture checks every key on a full batch). Raise kv_cache.num_blocks to {need} or "
                          f"more (or leave it auto), or drop the larger buckets.batch_sizes / chunk_sizes.")
    blocks = (torch.randperm(ex.num_blocks - 1, generator=gen) + 1).tolist()
    rows = []

    def rint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    for i in range(key.batch_size):
        n = q if (not key.is_prefill or i % 2 == 0) else rint(1, q)  # odd prefill rows: a short tail
        start = rint(0, max_len - q)
        table = [blocks.pop() for _ in range(blocks_for_tokens(start + n, bs))]
        row = StepRow(token_ids=torch.randint(0, vocab, (n,), generator=gen).tolist(), start_pos=start,
                      block_table=table)
        if key.sampling == SAMPLED:
            row.temperature = 0.0 if i % 4 == 3 else float(torch.rand((), generator=gen)) + 0.5
            row.top_k = [0, 1, 5, 50][rint(0, 3)]
            row.top_p = [1.0, 0.9, 0.5][rint(0, 2)]
            row.seed = rint(0, 2**31 - 1)
        rows.append(row)
    return rows


def verify_key(ex: Executor, key: GraphKey, seed: int) -> Parity:
    """Eager then replay on identical inputs; compare the real rows' logits and tokens."""
    return launch_verify(ex, key, seed).parity()


@dataclass
class Reference:
    """A key's eager run on the random valid rows of `seed`: its real rows' outputs, what a
    replay on the same rows is compared to, and (on CUDA) the memory the run peaked at and kept."""
    seed: int
    rows: list
    logits: torch.Tensor
    tokens: torch.Tensor
    accepted: torch.Tensor
    clock: "_StepClock"
    peak_bytes: int = 0  # above what was allocated before the run
    kept_bytes: int = 0  # still allocated after it, its outputs and this reference aside (lazy buffers)
    ints: torch.Tensor | None = None  # tokens then accepted, in one tensor (they are views of it)

    @classmethod
    def of(cls, seed: int, rows: list, logits: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor,
           clock: "_StepClock") -> "Reference":
        """Copies of a run's real outputs: the logits, and the tokens and accepted counts in
        one tensor (what the verification compares to in one op, `_compare`)."""
        ints = torch.cat([tokens, accepted])
        return cls(seed, rows, logits.clone(), ints[:len(tokens)], ints[len(tokens):], clock, ints=ints)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.logits, self.ints))


class KeptBlocks:
    """The KV blocks `rows` write (those holding positions start_pos .. start_pos + n - 1),
    copied on creation and written back by `restore()`: a verification run leaves the cache
    as it found it, so a key's rows read the same context whenever they run (at warm-up for
    the eager reference, after capture for the replay), whatever other keys ran between.
    Every layer at once where the caches are views of one allocation (`stacked_kv`): one
    copy out and one back, not one per layer (the capture queues these beside its replays)."""

    def __init__(self, ex: Executor, rows: list[StepRow]):
        bs = ex.block_size
        ids = sorted({b for r in rows
                      for b in r.block_table[r.start_pos // bs:(r.start_pos + len(r.token_ids) - 1) // bs + 1]})
        stacked = stacked_kv(ex.kv_caches)  # [layers, 2, blocks, ...], or None: one per layer
        self.caches, self.dim = ([stacked], 2) if stacked is not None else (ex.kv_caches, 1)
        index = torch.tensor(ids, dtype=torch.int64, pin_memory=ex.device.type == "cuda")
        self.index = index.to(ex.device, non_blocking=True)
        self.saved = [kv.index_select(self.dim, self.index) for kv in self.caches]

    def restore(self) -> None:
        for kv, saved in zip(self.caches, self.saved):
            kv.index_copy_(self.dim, self.index, saved)
        self.saved = []


def stacked_kv(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The per-layer caches as one [layers, ...] view, where they lie evenly spaced in one
    storage with equal shapes and strides (runtime/step/kv_cache.py allocates them so); else None."""
    first = caches[0]
    if len(caches) == 1:
        return first.unsqueeze(0)
    gap, size = caches[1].data_ptr() - first.data_ptr(), first.element_size()
    storage = first.untyped_storage().data_ptr()
    if gap <= 0 or gap % size or any(
            c.untyped_storage().data_ptr() != storage or c.data_ptr() - first.data_ptr() != i * gap
            or c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype
            for i, c in enumerate(caches)):
        return None
    return first.as_strided((len(caches), *first.shape), (gap // size, *first.stride()), first.storage_offset())


def fill_kv_cache(ex: Executor, seed: int) -> None:
    """Random values (seeded) in every KV block, so the verifications' rows read a context
    that is not zeros (a replay reading the wrong blocks would then differ from eager);
    `clear_kv_cache` puts the zeros back after the last verification."""
    gen = torch.Generator(device=ex.device).manual_seed(seed)
    for kv in ex.kv_caches:
        kv.normal_(generator=gen)


def clear_kv_cache(ex: Executor) -> None:
    for kv in ex.kv_caches:
        kv.zero_()


def _real_outputs(ex: Executor, key: GraphKey, out, n: int) -> tuple:
    """The real rows' logits and tokens, and (verify keys only) their accepted counts: other
    keys leave the accepted buffer as the last verify key wrote it, so a replay after another
    key's would differ from its eager reference there without anything being wrong. A greedy
    key writes no logits: they are its head run again on the step's head input (Executor.logits),
    so the comparison covers everything up to the head, and the head's own kernel by the tokens."""
    real = _real_logit_rows(key, n)
    return ex.logits(out)[real], out.tokens[real], out.accepted[:n if key.draft_len else 0]


def eager_reference(ex: Executor, key: GraphKey, seed: int) -> Reference:
    """Run `key` eagerly on the random rows of `seed` (the capture's warm-up run of the key)
    and keep its real rows' outputs; the KV cache is left as found (KeptBlocks). On CUDA
    also how far the run raised allocated memory and what it kept (read after a sync)."""
    rows = random_rows(ex, key, torch.Generator().manual_seed(seed))
    cuda = ex.device.type == "cuda"
    kept = KeptBlocks(ex, rows)
    ex.prepare(key, rows)
    if cuda:
        base = allocated_bytes(ex.device)
        torch.cuda.reset_peak_memory_stats(ex.device)
    clock = _StepClock(ex.device)
    out = ex.execute(key, eager=True)
    clock.stop()
    peak = torch.cuda.max_memory_allocated(ex.device) - base if cuda else 0
    before_copy = torch.cuda.memory_allocated(ex.device) if cuda else 0
    ref = Reference.of(seed, rows, *_real_outputs(ex, key, out, len(rows)), clock)
    copies = torch.cuda.memory_allocated(ex.device) - before_copy if cuda else 0
    del out
    if cuda:  # before the block copies are freed (they were allocated before `base`)
        ref.peak_bytes, ref.kept_bytes = peak, allocated_bytes(ex.device) - base - copies
    kept.restore()
    return ref


class PendingParity:
    """A verification launched (a replay on the rows of an eager reference, the comparison
    queued on the device), read by `parity()`. The reference is the capture's warm-up run of
    the key, or (none given) an eager run made here first on the same rows. On CUDA nothing
    here waits for the device: the comparison goes to pinned memory behind an event, so the
    capture can go on to the next key before this one is read (one wait per key, on this
    key's work only). The KV cache is left as found (KeptBlocks). A prefill key's replay is
    timed here too (`replay_clock`, read by `VerificationTiming`): on CUDA behind a short spin
    of the device (timing.SPIN_CYCLES), between two events."""

    def __init__(self, ex: Executor, key: GraphKey, seed: int, reference: Reference | None = None):
        ref = reference if reference is not None else eager_reference(ex, key, seed)
        rows = ref.rows
        self.clock = ref.clock
        kept = KeptBlocks(ex, rows)
        ex.prepare(key, rows)
        timed = timed_by_verification(key)
        if timed:
            _spin(ex.device)  # the device busy while the host launches the replay
        self.replay_clock = _StepClock(ex.device) if timed else None
        out = ex.execute(key)
        if self.replay_clock is not None:
            self.replay_clock.stop()
        logits, tokens, accepted = _real_outputs(ex, key, out, len(rows))
        pair = _compare(logits, tokens, accepted, ref)
        kept.restore()
        self.tolerance = LOGIT_TOLERANCE[ex.config.dtype]
        self._done = None
        if ex.device.type == "cuda":
            self._host = torch.empty(pair.shape, dtype=pair.dtype, pin_memory=True)
            self._host.copy_(pair, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = pair

    def ready(self) -> bool:
        """The comparison is on the host already (CUDA: its event passed; never on the CPU, where
        the capture keeps its fixed lag), so `parity()` would not wait."""
        return self._done is not None and self._done.query()

    def parity(self) -> Parity:
        """Wait for this key's comparison (not for work launched after it) and read it."""
        if self._done is not None:
            self._done.synchronize()
        low, high, differ = self._host.tolist()
        diff = max(-low, high) + 0.0  # = max |replay - reference| (+0.0 for an exact replay, not -0.0; NaN stays NaN)
        diff = diff if low == low and high == high else float("nan")
        tokens_equal = differ == 0.0
        ok = tokens_equal and diff <= self.tolerance and diff == diff  # NaN never passes
        return Parity(diff, tokens_equal, ok, self.clock.ms())


def _compare(logits, tokens, accepted, ref: Reference) -> torch.Tensor:
    """[lowest, highest] of replay - reference logits and 1.0 where any token or accepted
    count differs (0.0 where all are equal), on the device: five small ops, read by one copy.
    max(-lowest, highest) is max |replay - reference| exactly (NaN propagates through aminmax)."""
    low, high = torch.aminmax(logits - ref.logits)
    differ = torch.cat([tokens, accepted]).ne(ref.ints).any()
    return torch.stack([low, high, differ.to(low.dtype)])


def launch_verify(ex: Executor, key: GraphKey, seed: int, reference: Reference | None = None) -> PendingParity:
    return PendingParity(ex, key, seed, reference)


def _real_logit_rows(key: GraphKey, num_rows: int) -> slice:
    return slice(0, num_rows if key.is_prefill else num_rows * key.q_len)


