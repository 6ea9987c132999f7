"""The steps launched ahead: formed and launched before the host has read the tokens of
the step running on the device (the overlap of issue 14). `Scheduler` inherits these
methods (`LaunchAhead`):

- `extend_decode`: the same decode rows again (the fast path), or after a prefill whose rows
  all draw, the decode step they join (`_decode_after_prefill`, their tokens gathered on the
  device);
- `retire_ahead`: every row of the running step ends with it: free their blocks and slots at
  launch, so the next wave can be launched while it runs;
- `settle_ahead`: no row draws in the running prefill step: account it at launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..step.kv_cache import blocks_for_tokens

if TYPE_CHECKING:
    from .scheduler import ScheduledStep, Sequence


class LaunchAhead:
    """The scheduler's launched-ahead steps (mixed into `Scheduler`: its queues, allocator,
    fast-path state and step forming)."""

    def extend_decode(self, step: ScheduledStep) -> ScheduledStep | None:
        """The same generation step again, to launch before `step`'s tokens are read back, when
        it can be (the rows are every running sequence, nothing waits, no preemption is needed):
        each row's block for that next token is reserved, and the step repeats `step` (the fast
        path). A row that finishes in `step` wastes its slot in the next one; its blocks are
        freed when it finishes. None when it cannot be."""
        admissible = self.waiting and len(self.running) < self.plan.max_batch_size
        if step.is_prefill and self.fast_path and not admissible:
            return self._decode_after_prefill(step)
        if not self.fast_path or step.is_prefill or step.drafts is not None or admissible \
                or step.seqs != self.running:
            return None
        need = [blocks_for_tokens(s.num_computed + 2, self.block_size) - len(s.block_table) for s in step.seqs]
        if sum(n for n in need if n > 0) > self.allocator.num_free:
            return None
        if self.drafter is not None and not self._plain_next(step.seqs):
            return None  # drafting: plan the next step afresh from this one's tokens
        for seq, n in zip(step.seqs, need):
            if n > 0:
                seq.block_table += self.allocator.allocate(n)
        from .scheduler import ScheduledStep  # (scheduler.py imports this module)

        ahead = self._handed_out(ScheduledStep(step.key, list(step.seqs), list(step.num_new)), ahead=1)
        assert ahead.repeats, "a step launched ahead repeats the one before it"
        return ahead

    def _plain_next(self, rows: list[Sequence]) -> bool:
        """Whether the step after one over `rows` is a plain step, to launch ahead: the batch
        does not draft. A probe due at that step is not made here, before its launch: it is
        noted (`_probe`) and made by `postprocess` of the step running now, after that launch,
        while the device runs both (from the tokens known then, one step behind); when it finds
        that drafting pays, the step after is planned afresh (`schedule`) and drafts."""
        pol = self.speculation
        if not pol.may_run_ahead():
            return False
        if pol.probe_due():
            self._probe = rows
        return True

    def _decode_after_prefill(self, step: ScheduledStep) -> ScheduledStep | None:
        """The decode step over every running sequence, formed while `step` (a prefill) runs:
        where every row of `step` draws its first token there and every other running row is
        decoding. The rows of `step` take their input from its drawn tokens on the device
        (`gather`). With a drafter too, when the batch does not draft (the policy probes the new
        rows at the step after this one, `_plain_next`). None when it cannot be (a row still in
        its prompt, n > 1, a drafting batch, too many rows or too few blocks)."""
        if (self.drafter is not None and not self.speculation.may_run_ahead()) or step.settled \
                or len(self.running) > self.max_decode_batch:
            return None
        of = {id(s): i for i, s in enumerate(step.seqs)}
        positions = []  # the position each running row feeds next
        for seq in self.running:
            i = of.get(id(seq))
            if i is None and seq.num_pending != 1:
                return None
            if i is not None and (seq.num_computed + step.num_new[i] != len(seq.all_ids) or seq.request.n > 1
                                  or seq.request.max_tokens <= 1):
                return None
            positions.append(len(seq.all_ids) if i is not None else seq.num_computed)
        need = [blocks_for_tokens(p + 1, self.block_size) - len(s.block_table) for s, p in zip(self.running, positions)]
        if not self.running or sum(n for n in need if n > 0) > self.allocator.num_free:
            return None
        for seq, n in zip(self.running, need):
            if n > 0:
                seq.block_table += self.allocator.allocate(n)
        rows = list(self.running)
        from .scheduler import ScheduledStep  # (scheduler.py imports this module)

        nxt = ScheduledStep(self._select(len(rows), 0, rows), rows, [1] * len(rows),
                            gather=[(r, of[id(s)]) for r, s in enumerate(rows) if id(s) in of])
        self._after_prefill = False
        return self._handed_out(nxt)

    def settle_ahead(self, step: ScheduledStep) -> bool:
        """`step` is launched and its tokens not read yet. When no row draws in it (prefill
        chunks that are not their prompt's last), account it now (the KV now holds the fed
        tokens), so the next step can be formed before its tokens are read. True when it did."""
        if not step.is_prefill or step.settled or not self.fast_path:
            return False
        if any(not s.finished and s.num_computed + n >= len(s.all_ids) for s, n in zip(step.seqs, step.num_new)):
            return False
        for seq, n in zip(step.seqs, step.num_new):
            if not seq.finished:
                seq.num_computed += n
        step.settled = True
        return True

    def retire_ahead(self, step: ScheduledStep, ahead: int = 0) -> bool:
        """`step` is launched and its tokens not read yet. When every row of it ends with it for
        sure (its token is the row's max_tokens-th, or the row has finished), free their blocks
        and slots now, so the next step can be formed and launched before `step`'s tokens are
        read: nothing the next step feeds depends on them, and the device runs the steps in
        order, so the next step's writes to those blocks and slots come after `step`'s. The
        rows' tokens are appended by `postprocess` as usual. True when it retired them.
        ahead: tokens each row draws before `step` that are not appended yet (1: `step` was
        launched ahead of the step before it, whose tokens are not read either)."""
        if step.drafts is not None or not self.fast_path:  # (tensor parallelism: no step launched ahead)
            return False
        for seq, n in zip(step.seqs, step.num_new):
            if seq.finished or seq.retired:
                continue
            draws = seq.num_computed + n >= len(seq.all_ids)
            if (not draws or seq.request.n > 1  # (n > 1: the first token forks from the parent's blocks)
                    or len(seq.all_ids) - len(seq.prompt_ids) + ahead + 1 < seq.request.max_tokens):
                return False
        if all(seq.finished or seq.retired for seq in step.seqs):
            return False  # nothing left to retire (called twice)
        for seq in step.seqs:
            if not seq.finished and not seq.retired:
                self._release(seq)
                seq.retired = True
                self._retired.add(seq)
        return True
