"""The steps launched ahead: formed and launched before the host has read the tokens of
the step running on the device (the overlap of issue 14). `Scheduler` inherits these
methods (`LaunchAhead`):

- `extend_decode`: the same decode rows again (the fast path), or after a prefill whose rows
  all draw, the decode step they join (`_decode_after_prefill`, their tokens gathered on the
  device);
- `retire_ahead`: every row of the running step ends with it: free their blocks and slots at
  launch, so the next wave can be launched while it runs;
- `settle_ahead`: no row draws in the running prefill step: account it at launch;
- `form_ahead`: where the rows change, the step `schedule` would form next, formed from what
  is known before the running step's tokens are read: after a decode step, the next prefill
  chunk (prompt tokens: admission of waiting requests included; rows whose max_tokens-th token
  the running step draws are retired first, so their room and blocks count), or the decode
  step over the rows left (their tokens gathered on the device); after a prefill step, the
  decode step over the rows that are ready then (those that draw in it gathered), while other
  rows are still in their prompts (and a row whose running chunk leaves it one prompt token,
  which feeds that token there, as `schedule` would take it in after the read). A row that
  stops early (a stop id or EOS) in the running step is known only when it is read: the step
  formed ahead carries it (its row wasted) and its room counts from the step after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..step.kv_cache import blocks_for_tokens

if TYPE_CHECKING:
    from .scheduler import ScheduledStep, Sequence


class LaunchAhead:
    """The scheduler's launched-ahead steps (mixed into `Scheduler`: its queues, allocator,
    fast-path state and step forming)."""

    def extend_decode(self, step: ScheduledStep, unread: int = 1) -> ScheduledStep | None:
        """The same generation step again, to launch before `step`'s tokens are read back, when
        it can be (the rows are every running sequence, nothing waits, no preemption is needed):
        each row's block for that next token is reserved, and the step repeats `step` (the fast
        path). A row that finishes in `step` wastes its slot in the next one; its blocks are
        freed when it finishes. None when it cannot be. unread: the steps launched and not read
        whose tokens the rows draw before the new one (2: `step` was itself launched ahead of
        the step before it; `wave_ends_next`)."""
        admissible = self.waiting and len(self.running) < self.plan.max_batch_size
        if step.is_prefill and self.fast_path and not admissible:
            return self._decode_after_prefill(step)
        if not self.fast_path or step.is_prefill or step.drafts is not None or admissible \
                or step.seqs != self.running:
            return None
        need = [blocks_for_tokens(s.num_computed + 1 + unread, self.block_size) - len(s.block_table) for s in step.seqs]
        if sum(n for n in need if n > 0) > self.allocator.num_free:
            return None
        if self.drafter is not None and not self._plain_next(step.seqs):
            return None  # drafting: plan the next step afresh from this one's tokens
        for seq, n in zip(step.seqs, need):
            if n > 0:
                seq.block_table += self.allocator.allocate(n)
        from .scheduler import ScheduledStep  # (scheduler.py imports this module)

        ahead = self._handed_out(ScheduledStep(step.key, list(step.seqs), list(step.num_new)), ahead=unread)
        assert ahead.repeats, "a step launched ahead repeats the one before it"
        return ahead

    def wave_ends_next(self, step: ScheduledStep) -> bool:
        """`step` was launched ahead of the step before it (neither read) and every row of it
        ends with the step after it (its max_tokens-th token): where requests wait, the engine
        launches that last step and the next wave's first step now, three steps ahead of the
        read, so that forming the wave's first step (admission, blocks, packing the prompt
        chunks) has two steps of device time to hide behind. Not with a drafter (speculation
        plans its steps from the tokens read)."""
        return self.drafter is None and self.fast_path and self._all_end(step, 2)

    def _all_end(self, step: ScheduledStep, ahead: int) -> bool:
        """Whether every row of `step` not finished or retired draws its max_tokens-th token
        there, `ahead` tokens drawn before it not appended yet (and some row is left)."""
        left = False
        for seq, n in zip(step.seqs, step.num_new):
            if seq.finished or seq.retired:
                continue
            left = True
            draws = seq.num_computed + n >= len(seq.all_ids)
            if (not draws or seq.request.n > 1  # (n > 1: the first token forks from the parent's blocks)
                    or len(seq.all_ids) - len(seq.prompt_ids) + ahead + 1 < seq.request.max_tokens):
                return False
        return left

    def _plain_next(self, rows: list[Sequence]) -> bool:
        """Whether the step after one over `rows` is a plain step, to launch ahead: the batch
        does not draft. A probe due at that step is not made here, before its launch: it is
        noted (`_probe`) and made by `postprocess` of the step running now, after that launch,
        while the device runs both (from the tokens known then, one step behind); when it finds
        that drafting pays, the step after is planned afresh (`schedule`) and drafts."""
        pol = self.speculation  # (may_run_ahead and probe_due inline: this runs at every plain step)
        if pol.drafting or not pol.replay_ms:
            return False
        pol.since += 1
        if pol.since >= pol.interval:
            self._probe = rows
        return True

    def form_ahead(self, step: ScheduledStep, top_up=None) -> ScheduledStep | None:
        """`step` is launched, its tokens not read, and `extend_decode` found no step to repeat:
        the step `schedule` would hand out once `step` is read, formed now (module doc), or
        None where it needs those tokens (a drafting batch, a verify step) or blocks would run
        out (no preemption while a step is in flight). Nothing after it is chained. top_up: the
        engine's admission of submitted requests up to the free rows, called once the rows that
        end in `step` are retired (their rows count as free, as after `step` is read)."""
        if not self.fast_path or step.settled or step.drafts is not None \
                or (self.drafter is not None and not self.speculation.may_run_ahead()):
            return None
        if step.is_prefill:
            return self._decode_after_prefill(step, partial=True)
        return self._after_decode(step, top_up)

    def _after_decode(self, step: ScheduledStep, top_up=None) -> ScheduledStep | None:
        """After the decode step `step` (in flight): the prefill step over rows still in their
        prompts and the waiting requests there is room for, else the decode step over the rows
        left (`step`'s rows gathered). `schedule` after `step` is read would form the same one,
        but for rows that stop early in `step` (module doc)."""
        bs, free = self.block_size, self.allocator.num_free
        in_prompt = [s for s in self.running if s.num_pending > 1]
        # their reservations may preempt (schedule's _reserve): not while a step is in flight
        if sum(max(blocks_for_tokens(s.num_computed + s.num_pending, bs) - len(s.block_table), 0)
               for s in in_prompt) > free:
            return None
        if self._retire_ending(step) and top_up is not None:
            top_up()
        nxt = self._prefill_step()
        if nxt is not None:
            self._after_prefill = True
            return self._handed_out(nxt)
        rows = list(self.running)
        if not rows or len(rows) > self.max_decode_batch:
            return None
        of = {id(s): i for i, s in enumerate(step.seqs)}
        return self._gathered_decode(rows, [len(s.all_ids) if id(s) in of else s.num_computed for s in rows], of,
                                     probe=True)

    def _gathered_decode(self, rows: list[Sequence], positions: list[int], of: dict[int, int],
                         probe: bool = False, fed: dict[int, int] | None = None) -> ScheduledStep | None:
        """The decode step over `rows` (each feeding the token at its position), launched before
        the step whose rows `of` indexes (by id) is read: those rows' tokens are gathered from
        its drawn tokens on the device. Reserves each row's block for its position; None when
        the blocks would not fit, or (probe) the batch drafts next (`_plain_next`). The very
        rows of that step again take the fast path instead (`repeats`). fed: (by id) the prompt
        tokens that step feeds a row before this one feeds its last (`ScheduledStep.fed_ahead`)."""
        need = [blocks_for_tokens(p + 1, self.block_size) - len(s.block_table) for s, p in zip(rows, positions)]
        if sum(n for n in need if n > 0) > self.allocator.num_free:
            return None
        if probe and self.drafter is not None and not self._plain_next(rows):
            return None
        for seq, n in zip(rows, need):
            if n > 0:
                seq.block_table += self.allocator.allocate(n)
        from .scheduler import ScheduledStep  # (scheduler.py imports this module)

        nxt = ScheduledStep(self._select(len(rows), 0, rows), rows, [1] * len(rows),
                            gather=[(r, of[id(s)]) for r, s in enumerate(rows) if id(s) in of],
                            fed_ahead=[(r, fed[id(s)]) for r, s in enumerate(rows) if fed and id(s) in fed])
        self._after_prefill = False
        nxt = self._handed_out(nxt, ahead=1 if len(nxt.gather) == len(rows) else 0)
        if nxt.repeats:  # the very rows of that step again: the fast path advances them on the device
            nxt.gather = []
        return nxt

    def _retire_ending(self, step: ScheduledStep) -> int:
        """Free the blocks and slots of `step`'s rows whose token drawn there is their last by
        max_tokens (as `retire_ahead` does for a whole step): the step formed next counts their
        room. The device runs `step` before anything launched after it. How many it retired."""
        retired = 0
        for seq in step.seqs:
            if not seq.finished and not seq.retired and seq.request.n == 1 \
                    and len(seq.all_ids) - len(seq.prompt_ids) + 1 >= seq.request.max_tokens:
                seq.retired = True  # (retired before it leaves the running rows: see Scheduler.requeue_all)
                self._retired.add(seq)
                self._release(seq)
                retired += 1
        return retired

    def _decode_after_prefill(self, step: ScheduledStep, partial: bool = False) -> ScheduledStep | None:
        """The decode step over every running sequence, formed while `step` (a prefill) runs:
        where every row of `step` draws its first token there and every other running row is
        decoding. The rows of `step` take their input from its drawn tokens on the device
        (`gather`). With a drafter too, when the batch does not draft (the policy probes the new
        rows at the step after this one, `_plain_next`). None when it cannot be (a row still in
        its prompt, n > 1, a drafting batch, too many rows or too few blocks). partial: rows
        still in their prompts then (in `step` or not) are left out, as `schedule` leaves them
        out of the decode step after a prefill (`_decode_step(ready_only=True)`)."""
        if (self.drafter is not None and not self.speculation.may_run_ahead()) or step.settled:
            return None
        of = {id(s): i for i, s in enumerate(step.seqs)}
        rows, positions, fed = [], [], {}  # the rows, the position each feeds next, rows fed by `step` first
        for seq in self.running:
            i = of.get(id(seq))
            if i is None and seq.num_pending != 1:
                if partial:
                    continue
                return None
            left = 0 if i is None else len(seq.all_ids) - seq.num_computed - step.num_new[i]
            if left == 1 and partial:  # its last prompt token is fed here, as `schedule` would after the read
                fed[id(seq)] = step.num_new[i]
            elif left != 0:
                if partial:  # a prompt chunk that is not its last
                    continue
                return None
            if i is not None and (seq.request.n > 1 or seq.request.max_tokens <= 1):
                return None
            rows.append(seq)
            positions.append(seq.num_computed + fed[id(seq)] if id(seq) in fed
                             else len(seq.all_ids) if i is not None else seq.num_computed)
        if not rows or len(rows) > self.max_decode_batch:
            return None
        return self._gathered_decode(rows, positions, {k: v for k, v in of.items() if k not in fed}, fed=fed)

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
        if not self._all_end(step, ahead):  # (none left: nothing to retire, called twice)
            return False
        rows = [seq for seq in step.seqs if not seq.finished and not seq.retired]
        for seq in rows:  # (retired before they leave the running rows: see Scheduler.requeue_all)
            seq.retired = True
            self._retired.add(seq)
        self._release_all(rows)
        return True
