"""What a finished step changes in its sequences. `Scheduler` inherits these methods
(`Outcomes`), as it does `LaunchAhead`'s and `Drafting`'s:

- `advance`: KV now holds the fed tokens; the drawn tokens (a verify step: accepted drafts and
  the bonus token) are appended;
- `postprocess`: `advance`, the rows' log-probabilities, the other completions of an n > 1
  request started after its first token, the stop checks (`_stop`) and the finished
  sequences' blocks freed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import ScheduledStep, Sequence


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
        drew, emitted = [], 0
        if step.settled:  # accounted when launched: no row draws
            return drew
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new)):
            if seq.finished:  # finished in the step before; this row ran ahead for nothing
                continue
            if step.drafts is not None:
                a = accepted[i]
                emitted += a + 1
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
            self.speculation.emitted(emitted)
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
        news = []
        for seq, n_new in drew:
            req = seq.request
            if req.n > 1 and seq.index == 0 and len(seq.all_ids) - len(seq.prompt_ids) == n_new:
                self.fork(seq, [(seq.seed + i) % (1 << 63) for i in range(1, req.n)])  # completion i: seed + i
            reason = self._stop(seq, n_new)
            if reason is not None:
                self.finish(seq)
            news.append((seq, reason))
        if self._probe is not None:
            self._deferred_probe()
        return news

    def _stop(self, seq: Sequence, n_new: int) -> str | None:
        """Check the `n_new` tokens just appended, in order: "stop" at a stop id or EOS (not
        before min_tokens; EOS not with ignore_eos), "length" at max_tokens. Tokens a verify
        step drew past that point are dropped."""
        req, ids, p = seq.request, seq.all_ids, len(seq.prompt_ids)
        num_out = len(ids) - p
        min_tokens, max_tokens, stops, eos = req.min_tokens, req.max_tokens, req.stop_token_ids, self.eos_ids
        for j in range(num_out - n_new, num_out):
            t = ids[p + j]
            if j + 1 >= min_tokens and (t in stops or (t in eos and not req.ignore_eos)):
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
        if seq.request.logprobs is not None:
            r = row_of[id(seq)]
            seq.logprobs += [(values[r + j], ids[r + j]) for j in range(n_new)]
