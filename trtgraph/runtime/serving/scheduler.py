"""Continuous batching over recorded keys.

Each step is either prefill chunks (one recorded chunk size for the whole step) or
generation. Requests wait in a FIFO queue; KV blocks are allocated as sequences grow; when
blocks run out the newest running sequence is preempted (its blocks freed) and later
recomputed from its prompt plus what it has generated. No step is larger than the largest
recorded key, so every step selects a key. Pure host logic: no tensors here.

The scheduler owns every change to a sequence: admission, blocks, preemption, forking, and
after each step `postprocess`: appending the drawn tokens, the stop checks (stop ids, EOS,
max_tokens; what a verify step drew past a stop is dropped) and freeing the blocks of the
sequences that finished. A step it hands out says whether it repeats the rows of the step
handed out before it (`repeats`: the fast path) and which of those rows enter a new block.

n completions of one prompt: the prompt is prefilled once (completion 0, the parent), then
`fork` starts completions 1..n-1, each holding the prompt's full KV blocks by reference and
computing the rest of the prompt (less than one block) itself, so each draws its first token
with its own seed. A completion writes only into blocks it alone holds, so nothing is ever
copied on the device, and preempting one frees only its own holds.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from ...buckets import GREEDY, SAMPLED, BatchShape, BucketPlan, GraphKey, select
from .ahead import LaunchAhead
from .drafting import Drafting
from .outcomes import Outcomes, RowFacts, unchecked_dropped
from .drafter import NgramDrafter, NgramIndex
from .acceptance import Acceptance
from .speculation import SpeculationPolicy
from ..step.kv_cache import BlockAllocator, blocks_for_tokens
from .requests import Request

MAX_PADDING = 0.10  # a prefill step prefers the chunk size that keeps padding at or under this share


@dataclass(eq=False)
class Sequence:
    request: Request
    arrival: float  # order of submission; the newest is preempted first
    prompt_ids: list[int]
    seed: int
    index: int = 0  # which of the request's n completions
    all_ids: list[int] = field(init=False)  # prompt + generated
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_preemptions: int = 0
    finished: bool = False
    finish_reason: str | None = None  # "stop" / "length" where the scheduler finished it (outcomes.py)
    ngram: NgramIndex = field(default_factory=NgramIndex)  # the drafter's index of this sequence
    accept: Acceptance = field(default_factory=Acceptance)  # its drafts' running acceptance (speculation.py)
    first_token_time: float | None = None
    last_token_time: float | None = None
    slot: int | None = None  # the device state slot while running (runtime/step/buffers.py)
    logprobs: list = field(default_factory=list)  # with `logprobs`: (values, ids) per generated token
    step_row: object = field(default=None, repr=False)  # its StepRow, reused step to step (launcher.py)
    retired: bool = False  # its blocks and slot were freed before its last token was read (retire_ahead)
    stop_checked: int = 0  # output tokens found free of its stop strings (deliveries._stop_string)
    stop_floor: int | None = None  # characters of its first min_tokens - 1 tokens' text, once known (same)
    stop_scan: object = field(default=None, repr=False)  # its streaming.StopScan, made at its first check (same)
    checked: int = 0  # output tokens whose step's postprocess is done with it (outcomes.py; requeue_all)
    forked: int = 0  # n > 1, completion 0: completions 1..forked made (fork)
    _facts: RowFacts | None = field(default=None, repr=False)

    def __post_init__(self):
        self.all_ids = list(self.prompt_ids)

    @property
    def facts(self) -> RowFacts:
        """Its request's fields that every step reads, looked up once (outcomes.py)."""
        f = self._facts
        if f is None:
            f = self._facts = RowFacts.of(self.request)
        return f

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[len(self.prompt_ids):]

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next token can be drawn (1 in steady decoding)."""
        return len(self.all_ids) - self.num_computed


@dataclass
class ScheduledStep:
    key: GraphKey
    seqs: list[Sequence]
    num_new: list[int]  # query tokens each sequence feeds this step
    drafts: list[list[int]] | None = None  # verify steps: K drafted tokens per row
    num_proposed: int = 0  # rows whose drafts came from an n-gram match (not filler)
    # The fast path: the same key and generation rows, in the same order, as the step handed out
    # just before, so the device advances the inputs itself ...
    repeats: bool = False
    # ... and writes only these block-table entries: (row, column, block id) of each row whose
    # fed token is the first of a block.
    new_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    # A decode step launched right after a prefill step, before its tokens are read: (row here,
    # row of that prefill's drawn tokens) for each row whose input is that token, gathered on the
    # device; such a row's position is len(all_ids) (the token is not appended yet).
    gather: list[tuple[int, int]] = field(default_factory=list)
    # ... and (row here, prompt tokens that prefill feeds it) for each row whose prompt has one
    # token left after that prefill's chunk: it feeds that token here, at the position where
    # the chunk ends (its num_computed is advanced only when the prefill is read).
    fed_ahead: list[tuple[int, int]] = field(default_factory=list)
    settled: bool = False  # accounted when launched (no row draws in it): postprocess applies nothing

    @property
    def is_prefill(self) -> bool:
        return self.key.is_prefill


class Scheduler(LaunchAhead, Drafting, Outcomes):
    def __init__(self, plan: BucketPlan, num_blocks: int, block_size: int,
                 drafter: NgramDrafter | None = None, max_seq_len: int | None = None,
                 eos_ids: frozenset[int] = frozenset(), replay_ms: dict[GraphKey, float] | None = None):
        """eos_ids: the model's end-of-sequence ids (a request with ignore_eos draws past them).
        replay_ms: each key's replay time (the manifest's), for the speculation policy; without
        it every generation step where a row has an n-gram match drafts."""
        self.plan = plan
        self.eos_ids = frozenset(eos_ids)
        self.drafter = drafter
        self.speculation = SpeculationPolicy(plan, drafter.k, replay_ms) if drafter is not None else None
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.max_decode_batch = min(plan.max_batch_size, plan.max_key_batch(0, 0))
        self.chunk_sizes = sorted({k.chunk_size for k in plan.keys if k.is_prefill})
        # per chunk size, the batch sizes of its prefill keys (greedy; sampled keys have the same)
        self._prefill_sizes = {c: sorted({k.batch_size for k in plan.keys if k.chunk_size == c})
                               for c in self.chunk_sizes}
        self.has_sampled = SAMPLED in {k.sampling for k in plan.keys}
        self.num_preemptions = 0
        self.free_slots = list(range(plan.max_batch_size - 1, -1, -1))  # popped from the end: 0 first
        # May a step repeat the last one's inputs on the device (`repeats`, and extend_decode's
        # step launched ahead)? Off under tensor parallelism: the other ranks get full inputs.
        self.fast_path = True
        self._last: tuple | None = None  # (key, rows) of the last plain generation step handed out
        self._after_prefill = False  # the last step handed out was a prefill step
        self._retired: set[Sequence] = set()  # rows freed before their last token was read (retire_ahead)
        self._probe: list[Sequence] | None = None  # rows of a probe due, made after the next launch (_plain_next)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- forming a step --------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """The next step to launch (the one before it has been postprocessed), or None."""
        if not self.has_work:
            return None
        if self._after_prefill and any(s.num_pending == 1 for s in self.running):
            # Rows that decode never wait behind prefill chunks for more than one step.
            step = self._decode_step(ready_only=True) or self._prefill_step() or self._decode_step()
        else:
            step = self._prefill_step() or self._decode_step()
        self._after_prefill = step is not None and step.is_prefill
        return self._handed_out(step)

    def _handed_out(self, step: ScheduledStep | None, ahead: int = 0) -> ScheduledStep | None:
        """Mark `step` as repeating when it has the last step's key and rows, and remember it.
        ahead: tokens each row is beyond what postprocess has appended (a step launched ahead)."""
        if step is None:
            if self.speculation is not None:
                self.speculation.handed_out(None)
            self._last = None
            return None
        key = step.key
        prefill = key.chunk_size > 0  # (key.is_prefill, read once: this runs at every step)
        if self.speculation is not None:
            self.speculation.handed_out(None if prefill else key)
        plain = self.fast_path and not prefill and step.drafts is None
        rows = (key, tuple(step.seqs)) if plain else None
        if rows is not None and rows == self._last:
            step.repeats = True
            bs = self.block_size
            for row, seq in enumerate(step.seqs):
                pos = seq.num_computed + ahead  # the position this step's fed token takes
                if pos % bs == 0:
                    step.new_blocks.append((row, pos // bs, seq.block_table[pos // bs]))
        self._last = rows
        return step

    def _prefill_step(self) -> ScheduledStep | None:
        room = max(self.plan.max_batch_size - len(self.running), 0)  # sequences that can be admitted now
        candidates = [s for s in self.running if s.num_pending > 1] + list(self.waiting)[:room]
        if not candidates:
            return None
        chunk, max_rows = self._prefill_shape([s.num_pending for s in candidates])
        chosen, num_new = [], []
        for seq in candidates:
            if len(chosen) == max_rows:
                break
            admitting = seq not in self.running
            if admitting and len(self.running) >= self.plan.max_batch_size:
                break
            n = min(seq.num_pending, chunk)
            if n > 1 and seq.num_pending - n == 1 and seq.facts.processors:
                # Not one token left for a decode step to feed: only prefill chunks set a fed
                # token's prompt bit or generated count (the penalties' slot counts).
                n -= 1
            # Admission reserves blocks for every pending token at once, so a prefill never
            # stalls half-way for blocks that older sequences keep taking.
            if not self._reserve(seq, seq.num_pending if admitting else n, protect=chosen,
                                 may_preempt=not admitting):
                if admitting:
                    break  # no room to admit; decode frees blocks as requests finish
                self.preempt(seq)  # nothing newer to take blocks from: step aside for older ones
                continue
            if admitting:  # (running before it leaves the queue: a Ctrl-C between leaves it in both, see requeue_all)
                self._insert_running(seq)
                self.waiting.remove(seq)
                seq.slot = self.free_slots.pop()
            chosen.append(seq)
            num_new.append(n)
        if not chosen:
            return None
        return ScheduledStep(self._select(len(chosen), chunk, chosen), chosen, num_new)

    def _chunk_for(self, pending: list[int]) -> int:
        return self._prefill_shape(pending)[0]

    def _prefill_shape(self, pending: list[int]) -> tuple[int, int]:
        """(chunk size, rows) for a prefill step over the first rows of `pending` (tokens each
        candidate has to feed, in order): among every recorded chunk size and every number of
        leading rows, the one that feeds the most prompt tokens with at most 10% of the step's
        tokens padding (rows padded up to the key's batch size included); when none is that
        tight, the least padded (ties: more tokens, the larger chunk). Rows left out go in a
        later step."""
        best = None
        for c in self.chunk_sizes:
            sizes = self._prefill_sizes[c]
            useful = 0
            for m, p in enumerate(pending[:sizes[-1]], start=1):
                useful += min(p, c)
                waste = 1 - useful / (sizes[bisect_left(sizes, m)] * c)
                score = (0, -useful, -c, 0) if waste <= MAX_PADDING else (1, waste, -useful, -c)
                if best is None or score < best[0]:
                    best = (score, c, m)
        return best[1], best[2]

    def _decode_step(self, ready_only: bool = False) -> ScheduledStep | None:
        """A generation step over the running rows (ready_only: only those with one token to
        feed, while others are still in their prompt's chunks)."""
        rows = [s for s in self.running if s.num_pending == 1] if ready_only else list(self.running)
        proposals = self._proposals(rows[:self.max_decode_batch])
        q = 1 + self.drafter.k if proposals is not None else 1
        chosen, bs, preempted = [], self.block_size, self.num_preemptions
        for seq in rows:
            if self.num_preemptions != preempted and seq not in self.running:  # preempted reserving for an earlier row
                continue
            if len(chosen) == self.max_decode_batch:
                break
            if len(seq.block_table) * bs >= seq.num_computed + q:  # its blocks hold the step's tokens already
                chosen.append(seq)
            elif self._reserve(seq, q, protect=chosen, may_preempt=True):
                chosen.append(seq)
            else:  # nothing newer to take blocks from: step aside, recompute later
                self.preempt(seq)
        if not chosen:
            return None
        drafts = None
        if proposals is not None:
            drafts = [proposals.get(id(s)) or self.drafter.filler(s.all_ids) for s in chosen]
        key = self._select(len(chosen), 0, chosen, draft_len=q - 1)
        return ScheduledStep(key, chosen, [q] * len(chosen), drafts,
                             num_proposed=sum(proposals.get(id(s)) is not None for s in chosen) if drafts else 0)

    def _select(self, n: int, chunk: int, seqs: list[Sequence], draft_len: int = 0) -> GraphKey:
        sampled = any(not s.facts.greedy for s in seqs)
        return select(self.plan, BatchShape(n, draft_len, chunk, SAMPLED if sampled else GREEDY))

    # ---- blocks and preemption ------------------------------------------------------
    def _reserve(self, seq: Sequence, n: int, protect: list[Sequence], may_preempt: bool) -> bool:
        """Blocks for `seq` to hold n more tokens, preempting running sequences newer than
        it (newest first, never one already in this step) until they fit. Only newer ones:
        the oldest sequence always makes progress, so preemption cannot cycle."""
        need = blocks_for_tokens(seq.num_computed + n, self.block_size) - len(seq.block_table)
        while need > self.allocator.num_free:
            victims = [s for s in self.running if s.arrival > seq.arrival and s not in protect]
            if not may_preempt or not victims:
                return False
            self.preempt(max(victims, key=lambda s: s.arrival))
        if need > 0:
            seq.block_table += self.allocator.allocate(need)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free all of `seq`'s blocks; it waits (in arrival order) to be recomputed. (Queued before
        it leaves the running rows: a Ctrl-C between leaves it in both, which `requeue_all` mends.)"""
        pos = next((i for i, w in enumerate(self.waiting) if w.arrival > seq.arrival), len(self.waiting))
        self.waiting.insert(pos, seq)
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        self.free_slots.append(seq.slot)
        seq.block_table, seq.num_computed, seq.slot = [], 0, None
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def requeue_all(self) -> None:
        """A step failed between its forming and its read (Ctrl-C, a device error): the steps in
        flight are lost, so every unfinished sequence that ran is preempted (recomputed from its
        prompt and the tokens appended so far), a retired one included, and no step repeats one
        before; tokens whose postprocess was cut short dropped (`unchecked_dropped`). Rebuilt, not
        moved one by one: after a Ctrl-C inside the bookkeeping (a sequence in two queues, blocks
        or a slot freed or held part-way) every block and slot is free, each sequence waits once."""
        ran = [s for s in self.running if not s.finished]
        seqs = {id(s): s for s in (*self.waiting, *ran, *self._retired) if not s.finished}
        for seq in seqs.values():
            unchecked_dropped(seq)
            seq.block_table, seq.num_computed, seq.slot, seq.retired = [], 0, None, False
        for seq in {id(s): s for s in ran if s not in self.waiting}.values():  # (counted as preempt counts them)
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self.allocator.reset()  # (no sequence holds a block now)
        self.free_slots = list(range(self.plan.max_batch_size - 1, -1, -1))
        self.waiting = deque(sorted(seqs.values(), key=lambda s: s.arrival))
        self.running, self._retired = [], set()
        self._last, self._after_prefill, self._probe = None, False, None

    def _insert_running(self, seq: Sequence) -> None:
        running = self.running
        if not running or running[-1].arrival < seq.arrival:  # the newest (admission in order): at the end
            running.append(seq)
            return
        pos = next((i for i, r in enumerate(running) if r.arrival > seq.arrival), len(running))
        running.insert(pos, seq)

    def fork(self, parent: Sequence, seeds: list[int]) -> list[Sequence]:
        """Completions 1..n-1 of `parent`, which has just drawn its first token: each shares the
        prompt's full blocks and feeds the prompt's remaining tokens (at least the last one)
        itself. They run now where the batch has room; others wait, holding nothing, and
        compute the whole prompt when admitted. Arrival orders them just after the parent."""
        shared = (len(parent.prompt_ids) - 1) // self.block_size  # full blocks before the last prompt token
        children, req = [], parent.request
        # Made already by a fork a Ctrl-C cut short (the parent's first token drawn again since): not again.
        made = {s.index for s in (*self.running, *self.waiting) if s.request is req} | set(range(parent.forked + 1))
        for i, seed in enumerate(seeds, start=1):
            if i in made:  # (counted as made: else a cut fork that had made the last one was called every step)
                parent.forked = i
                continue
            child = Sequence(request=req, arrival=parent.arrival + i / (len(seeds) + 1),
                             prompt_ids=parent.prompt_ids, seed=seed, index=i)
            # Shared blocks skip the prompt's prefill, and with it the in-graph scan that seeds a
            # slot's penalty counts: a request with logits processors computes its prompt itself.
            if len(self.running) < self.plan.max_batch_size and shared and not req.sampling.uses_processors:
                child.block_table = self.allocator.share(parent.block_table[:shared])
                child.num_computed = shared * self.block_size
                child.slot = self.free_slots.pop()
                self._insert_running(child)
            else:
                pos = next((j for j, w in enumerate(self.waiting) if w.arrival > child.arrival), len(self.waiting))
                self.waiting.insert(pos, child)
            parent.forked = i
            children.append(child)
        return children

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: its blocks and slot are freed (already, if it was retired)."""
        seq.finished = True
        if seq.retired:
            self._retired.discard(seq)
            return
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self._release_all([seq])

    def _release_all(self, seqs: list[Sequence]) -> None:
        """Free the blocks and slots of running `seqs` (a wave's rows at once: one pass over the
        running list; the blocks freed sequence by sequence, in order, as one at a time would)."""
        gone = {id(s) for s in seqs}
        left = [s for s in self.running if id(s) not in gone]
        if len(self.running) - len(left) != len(seqs):
            raise ValueError("releasing a sequence that is not running")
        self.running[:] = left
        for seq in seqs:
            self.allocator.free(seq.block_table)
            self.free_slots.append(seq.slot)
            seq.block_table, seq.slot = [], None

    def abort(self, request: Request) -> None:
        """Stop every unfinished sequence of `request` (with n > 1, each completion): running
        ones free their blocks, waiting ones (which hold none) leave the queue."""
        for seq in [s for s in (*self.running, *self.waiting, *self._retired) if s.request is request]:
            if seq in self.running or seq.retired:
                self.finish(seq)
            else:
                self.waiting.remove(seq)
                seq.finished = True
