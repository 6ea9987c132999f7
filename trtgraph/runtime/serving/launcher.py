"""Launching scheduled steps and reading their tokens back one step late.

A step the scheduler marks `repeats` (the same generation rows as the step launched before
it) takes the fast path: the decode key's graph advances positions, input tokens and slots
itself (kernels/advance.py); the host only stages the block-table entries of the rows the step
says entered a new block. Such a step is one replay, and between two replays the device does
nothing else but copy the tokens back (and at a block boundary copy the staged entries).
Any other step is packed on the host and copied once; a decode step launched right after a
prefill (`gather`) then takes those rows' input tokens from the prefill's drawn tokens, inside
its graph. Either way the tokens (and, for
verify steps, the accepted counts; for rows that asked, the log-probabilities) are copied
without blocking into pinned host buffers used in turn, so a step launched ahead never
overwrites what the host is still reading. `wait` is the one place the host waits for the
device: one CUDA event per step, from a ring made once (no event is created per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ..step.executor import Executor, StepRow
from .scheduler import ScheduledStep, Sequence
from .stats import RunStats

EVENT_RING = 6  # CUDA events in turn: up to four steps in flight, and the one before them for the gap
RESULT_RING = 4  # pinned host result buffers in turn: one per step in flight (up to four: a wave's end)
ROW_FIELDS_KEPT = 4096  # distinct requests' sampling fields kept as StepRow keywords (then afresh)


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet."""
    step: ScheduledStep
    tokens: torch.Tensor  # host view the step's tokens are copied into
    accepted: torch.Tensor | None  # verify steps: host view of the accepted counts
    done: object  # CUDA event recorded after those copies (None on a CPU)
    events: tuple | None  # (begin, end) around the replay, with gpu_timing
    logprobs: tuple | None = None  # (values [rows, 1 + K], ids [rows, K]) on the host, when a row asked


class StepLauncher:
    def __init__(self, executor: Executor, eager: bool = False, broadcast=None):
        """broadcast: with tensor parallelism, rank 0's StepBroadcast (the other ranks get the
        full inputs of every step; the scheduler then never marks a step `repeats`)."""
        self.executor = ex = executor
        self.eager = eager
        self.broadcast = broadcast
        self.timing = False  # CUDA events around each step (generate(gpu_timing=True))
        pin = ex.device.type == "cuda"
        # Pinned host buffer pairs used in turn, one per step in flight: a step's tokens land while
        # an earlier one's are read.
        self._result_bufs = [(torch.zeros(ex.buffers.max_rows, dtype=torch.int64, pin_memory=pin),
                              torch.zeros(ex.buffers.max_seqs, dtype=torch.int64, pin_memory=pin))
                             for _ in range(RESULT_RING)]
        # Their twins for logprobs (values, ids), used in the same turn: nothing allocated per step.
        state = ex.buffers.state
        self._logprob_bufs = [tuple(torch.zeros(state[k].shape, dtype=state[k].dtype, pin_memory=pin)
                                    for k in ("logprob_values", "logprob_ids")) for _ in range(RESULT_RING)]
        self._turn = 0
        # CUDA events made once and used in turn: `done` per step, (begin, end) with timing. A
        # step's events are re-recorded EVENT_RING launches later; at most four steps are in
        # flight and the gap before a step is read from the step before it (scripts/host_step.py).
        cuda = ex.device.type == "cuda"
        self._done_events = [torch.cuda.Event() for _ in range(EVENT_RING)] if cuda else None
        self._timing_events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                               for _ in range(EVENT_RING)] if cuda else None
        self._launches = 0
        # What min_tokens masks, with the stop ids: every EOS id (config.json's and generation_config.json's,
        # which stop a request alike); ids outside the vocabulary are never drawn and never masked.
        self._vocab = ex.loaded.config.vocab_size
        self._masked = sorted(set(ex.loaded.config.eos_token_ids) | set(ex.loaded.generation.eos_token_ids))
        self._row_fields_of: dict[int, tuple] = {}  # id(RowFacts) -> (it, StepRow keywords): `_row_fields`

    def launch(self, step: ScheduledStep, stats: RunStats) -> InFlight:
        """Prepare and enqueue a step, and the non-blocking copies of its results to the host."""
        ex = self.executor
        self._prepare(step, stats)
        if self.broadcast is not None:
            self.broadcast.send(step.key)
        ring = self._launches % EVENT_RING
        self._launches += 1
        events = None
        if self.timing:
            events = self._timing_events[ring]
            events[0].record()
        out = ex.execute(step.key, eager=self.eager)
        if events:
            events[1].record()
        n = len(step.seqs)
        rows = n if step.is_prefill else n * step.key.q_len  # logit rows of the real sequences
        self._turn = (self._turn + 1) % RESULT_RING
        host, host_accepted = self._result_bufs[self._turn]
        host[:rows].copy_(out.tokens[:rows], non_blocking=True)
        if step.drafts is not None:
            host_accepted[:n].copy_(out.accepted[:n], non_blocking=True)
            stats.verify_steps += 1
            stats.verify_rows += n
            stats.drafted_rows += step.num_proposed
            stats.drafts_fed += n * step.key.draft_len
        logprobs = None
        if out.logprob_values is not None and any(q.facts.logprobs for q in step.seqs):
            # copied now (a step launched ahead rewrites the device buffers), into this turn's host pair
            logprobs = tuple(h[:rows].copy_(t[:rows], non_blocking=True)
                             for h, t in zip(self._logprob_bufs[self._turn], (out.logprob_values, out.logprob_ids)))
        done = self._done_events[ring] if self._done_events is not None else None
        if done is not None:
            done.record()
        stats.steps += 1
        stats.steps_per_key[step.key] += 1
        stats.real_tokens += sum(step.num_new)
        stats.padded_tokens += step.key.num_tokens
        return InFlight(step, host[:rows], host_accepted[:n] if step.drafts is not None else None, done, events,
                        logprobs)

    def wait(self, f: InFlight, stats: RunStats) -> tuple[list[int], list[int] | None, tuple | None]:
        """Wait for a launched step; (tokens, accepted counts or None, (logprob values, ids) as
        lists or None), all on the host."""
        if f.done is not None:
            f.done.synchronize()
        if f.events:
            stats.gpu_busy_seconds += f.events[0].elapsed_time(f.events[1]) / 1e3
        accepted = f.accepted.tolist() if f.accepted is not None else None
        if accepted is not None:
            stats.drafts_accepted += sum(accepted)
            stats.verify_tokens += sum(accepted) + len(accepted)
        logprobs = tuple(t.tolist() for t in f.logprobs) if f.logprobs is not None else None
        return f.tokens.tolist(), accepted, logprobs

    # ---- inputs ----------------------------------------------------------------------------
    def _prepare(self, step: ScheduledStep, stats: RunStats) -> None:
        """The fast path for a step that repeats the last one's rows; otherwise pack on the host
        and copy once."""
        ex = self.executor
        if step.repeats:
            ex.advance_decode(len(step.seqs), step.new_blocks)
            stats.fast_path_steps += 1
            return
        for seq in step.seqs if step.is_prefill else ():  # entering its slot: its tables replace the last occupant's
            if seq.num_computed == 0 and seq.facts.processors:
                ex.buffers.write_slot(seq.slot, seq.request.logit_bias, self._masked_ids(seq))
        if step.is_prefill:  # every row's chunk read in one pass: one array, a view per row
            ends = np.cumsum(step.num_new).tolist()
            flat = np.fromiter(chain.from_iterable(s.all_ids[s.num_computed:s.num_computed + n]
                                                   for s, n in zip(step.seqs, step.num_new)), np.int64, ends[-1])
            rows = [self._row(seq, n, fed=flat[e - n:e]) for seq, n, e in zip(step.seqs, step.num_new, ends)]
        else:
            drafts = step.drafts or [None] * len(step.seqs)
            rows = [self._row(seq, n, d) for seq, n, d in zip(step.seqs, step.num_new, drafts)]
        for r, _ in step.gather:  # its token is the prefill's, not appended yet: gathered on the device
            row, seq = rows[r], step.seqs[r]
            row.token_ids, row.start_pos, row.counted = [0], len(seq.all_ids), True
        for r, n in step.fed_ahead:  # its last prompt token, after the chunk the prefill before feeds it
            row, seq = rows[r], step.seqs[r]
            pos = seq.num_computed + n
            row.token_ids, row.start_pos, row.counted = seq.all_ids[pos:pos + 1], pos, True
        ex.prepare(step.key, rows, step.gather)

    def _masked_ids(self, seq: Sequence) -> list[int]:
        """What min_tokens masks: the model's EOS ids and the request's stop ids, those inside
        the vocabulary (a stop id past it can never be drawn; writing it would index past a row)."""
        return sorted(t for t in set(self._masked) | set(seq.request.stop_token_ids) if t < self._vocab)

    def _row(self, seq: Sequence, n: int, drafts: list[int] | None = None, fed=None) -> StepRow:
        """The sequence's row of this step. Its sampling fields do not change while it runs, so
        the row is built once per sequence (and again when its slot changes) and then only its
        tokens, position, block table and `counted` are set: the host packs rows of a full
        step without re-reading every request's sampling parameters. fed: the n tokens it feeds,
        where the caller has them (a prefill step's chunks, read at once)."""
        if fed is None:
            fed = [seq.all_ids[-1]] + drafts if drafts is not None else seq.all_ids[seq.num_computed:seq.num_computed + n]
        row = seq.step_row
        facts = seq.facts
        if row is None or row.slot != (seq.slot if facts.processors else None):
            prompt_len = len(seq.prompt_ids)
            row = seq.step_row = StepRow(
                token_ids=fed, start_pos=0, block_table=[], seed=seq.seed,
                slot=seq.slot if facts.processors else None, prompt_len=prompt_len,
                eos_until=prompt_len + facts.min_tokens if facts.min_tokens and self._masked_ids(seq) else 0,
                **self._row_fields(seq, facts))  # (nothing to mask: no mask, not the slot's padding id 0)
        row.token_ids, row.start_pos, row.block_table = fed, seq.num_computed, seq.block_table
        row.counted = seq.num_computed + len(fed) >= len(seq.all_ids)
        return row

    def _row_fields(self, seq: Sequence, facts) -> dict:
        """A row's sampling fields (StepRow's keywords), read from the request once for every
        sequence that shares its RowFacts (admission hands the same one to requests whose
        sampling fields are equal but for the seed)."""
        kept = self._row_fields_of.get(id(facts))
        if kept is not None and kept[0] is facts:
            return kept[1]
        r, s = seq.request, seq.request.sampling
        fields = dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=s.min_p,
                      processors=facts.processors, repetition_penalty=s.repetition_penalty,
                      presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                      logprobs=facts.logprobs)
        if len(self._row_fields_of) >= ROW_FIELDS_KEPT:
            self._row_fields_of.clear()
        self._row_fields_of[id(facts)] = (facts, fields)
        return fields
