"""What a finished step changes in its sequences. `Scheduler` inherits these methods
(`Outcomes`), as it does `LaunchAhead`'s and `Drafting`'s:

- `advance`: KV now holds the fed tokens; the drawn tokens (a verify step: accepted drafts and
  the bonus token) are appended;
- `postprocess`: `advance`, the rows' log-probabilities, the other completions of an n > 1
  request started after its first token, the stop checks (`_stop`) and the finished
  sequences' blocks freed.

The per-row work of a step is O(1) cheap operations per row: a row's request fields are read
once per sequence (`RowFacts`, `Sequence.facts`), and a row whose new tokens hold no stop id
(nor EOS, unless it ignores EOS) and do not reach max_tokens is known not to stop by two set
tests in C; only the rows that may stop go through `_stop`'s walk over their tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .requests import completion_seed

if TYPE_CHECKING:
    from .requests import Request
    from .scheduler import ScheduledStep, Sequence


@dataclass(frozen=True, slots=True)
class RowFacts:
    """A sequence's request fields that the host reads at every step (the stop checks, key
    selection, packing, outputs), looked up once: `Request` resolves its sampling fields
    through `__getattr__` and its stop ids through a property, per access."""
    max_tokens: int
    min_tokens: int
    stop_ids: frozenset  # the request's stop token ids
    ignore_eos: bool
    greedy: bool  # runs on the greedy keys (Request.is_greedy)
    processors: bool  # uses logits processors (SamplingParams.uses_processors)
    stop_strings: tuple  # its stop strings (checked on the text, engine._drawn)
    logprobs: bool  # asked for log-probabilities

    @classmethod
    def of(cls, req: Request) -> RowFacts:
        s = req.sampling
        return cls(req.max_tokens, req.min_tokens, frozenset(req.stop_token_ids), bool(req.ignore_eos),
                   req.is_greedy, s.uses_processors, tuple(req.stop_strings), req.logprobs is not None)


class Outcomes:
    """The scheduler's accounting after a step (mixed into `Scheduler`: its speculation policy,
    EOS ids, `fork`, `finish` and the probe `Drafting` defers)."""

    def advance(self, step: ScheduledStep, tokens: list[int], accepted: list[int] | None = None,
                now: float | None = None) -> list[tuple[Sequence, int]]:
        """Account a finished step: KV now holds the fed tokens; a sequence that fed all it
        had gets the drawn token appended (a verify step: its accepted drafts and the bonus
        token). Returns (sequence, tokens appended) for each that drew."""
        now = time.perf_counter() if now is None else now
        q = step.key.q_len
        drew, emitted, verified = [], 0, 0
        if step.settled:  # accounted when launched: no row draws
            return drew
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new)):
            if seq.finished:  # finished in the step before; this row ran ahead for nothing
                continue
            if step.drafts is not None:
                a = accepted[i]
                emitted += a + 1
                verified += 1
                seq.num_computed += a + 1  # the fed token and the accepted drafts are now valid KV
                new = tokens[i * q:i * q + a + 1]
            else:
                seq.num_computed += n
                if seq.num_pending != 0:
                    continue  # a prefill chunk that is not the prompt's last
                new = [tokens[i]]
            seq.all_ids.extend(new)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            drew.append((seq, len(new)))
        if emitted:
            self.speculation.emitted(emitted, verified)
        return drew

    def postprocess(self, step: ScheduledStep, tokens: list[int], accepted: list[int] | None = None,
                    logprobs: tuple | None = None, now: float | None = None) -> list[tuple[Sequence, str | None]]:
        """Everything a finished step changes in its sequences: append the drawn tokens
        (`advance`) and, for rows that asked, their log-probabilities (logprobs: (values, ids),
        lists per logit row); after an n > 1 request's first token start its other completions;
        stop at a stop id, EOS or max_tokens and free the finished sequences' blocks.
        Returns (sequence, finish reason or None) for each sequence that drew."""
        drew = self.advance(step, tokens, accepted, now)
        if logprobs is not None:
            _keep_logprobs(step, drew, logprobs)
        news, eos = [], self.eos_ids
        for seq, n_new in drew:
            req, ids, f = seq.request, seq.all_ids, seq.facts
            num_out = len(ids) - len(seq.prompt_ids)
            if req.n > 1 and seq.index == 0 and seq.forked < req.n - 1:  # (its first token: a cut fork goes on)
                self.fork(seq, [completion_seed(seq.seed, i) for i in range(1, req.n)])
            reason = None
            if num_out >= f.max_tokens or not f.stop_ids.isdisjoint(new := ids[-n_new:]) \
                    or not (f.ignore_eos or eos.isdisjoint(new)):  # else no token of the row's can stop it
                reason = self._stop(seq, n_new)
                if reason is not None:
                    seq.finish_reason = reason
                    self.finish(seq)
            seq.checked = num_out  # (a finished one's: unread; a Ctrl-C before this: Scheduler.requeue_all drops them)
            news.append((seq, reason))
        if self._probe is not None:
            self._deferred_probe()
        return news

    def _stop(self, seq: Sequence, n_new: int) -> str | None:
        """Check the `n_new` tokens just appended, in order: "stop" at a stop id or EOS (not
        before min_tokens; EOS not with ignore_eos), "length" at max_tokens. Tokens a verify
        step drew past that point are dropped."""
        f, ids, p = seq.facts, seq.all_ids, len(seq.prompt_ids)
        num_out = len(ids) - p
        min_tokens, max_tokens, stops = f.min_tokens, f.max_tokens, f.stop_ids
        eos = frozenset() if f.ignore_eos else self.eos_ids
        for j in range(num_out - n_new, num_out):
            t = ids[p + j]
            if j + 1 >= min_tokens and (t in stops or t in eos):
                reason = "stop"
            elif j + 1 >= max_tokens:
                reason = "length"
            else:
                continue
            del ids[p + j + 1:]
            return reason
        return None


def _keep_logprobs(step: ScheduledStep, drew: list[tuple[Sequence, int]], logprobs: tuple) -> None:
    """Each drawing sequence's rows of the step's log-probabilities, in token order."""
    values, ids = logprobs
    q = 1 if step.is_prefill else step.key.q_len
    row_of = {id(seq): i * q for i, seq in enumerate(step.seqs)}
    for seq, n_new in drew:
        if seq.facts.logprobs:
            r = row_of[id(seq)]
            seq.logprobs += [(values[r + j], ids[r + j]) for j in range(n_new)]


def unchecked_dropped(seq: Sequence) -> None:
    """An unfinished sequence's output tokens past `checked` dropped (their log-probabilities and a
    stop found among them too): a step appended them, its postprocess stopped before it was done
    (a Ctrl-C); Scheduler.requeue_all drops them, and recomputing draws them again, checked."""
    if seq.finished or len(seq.all_ids) - len(seq.prompt_ids) <= seq.checked:
        return
    del seq.all_ids[len(seq.prompt_ids) + seq.checked:]
    del seq.logprobs[seq.checked:]
    seq.finish_reason = None
