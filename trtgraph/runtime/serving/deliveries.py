"""After a step: its tokens to text and outputs (`Deliveries`, mixed into the Engine: its
launcher, scheduler, tokenizer, stats and the requests being served, `Live`)."""

from __future__ import annotations

from dataclasses import dataclass

from .launcher import InFlight
from .requests import Result
from .scheduler import Sequence
from .streaming import RequestOutput, TextStream, final_result


@dataclass
class Live:
    """A request being served: its sequence, when it arrived, and what was handed out."""
    seq: Sequence
    arrival_seconds: float  # time.perf_counter() at add_request
    text: TextStream
    stream: bool = True  # whether each step's new tokens and text are handed out (else only the end)
    num_sent: int = 0  # output tokens already handed out


class Deliveries:
    """The engine's read side: tokens applied (stop strings checked), outputs and Results.

    Ctrl-C: CPython raises a KeyboardInterrupt only where it checks for signals, as a call
    returns and at a loop's back edge, never between two stores with no call between them. So
    each output is made first (every call) and then recorded and delivered by stores alone, its
    request's state and `_undelivered` together: an interrupt lands before both (the output is
    made again after `Engine._recover`) or after both, never between (an output lost or sent
    twice, a request gone without its Result)."""

    def _drawn(self, f: InFlight) -> list[tuple[Sequence, str | None, str | None]]:
        """Wait for a step's tokens and let the scheduler apply them; stop strings are checked
        here too (a hit ends the sequence before the next step is formed). (sequence, finish
        reason, its text when a stop-string check decoded it) for each whose news someone
        reads: every one that finished, and the others of streamed requests (a request
        submitted with stream=False has its text decoded once, at the end)."""
        self._reading = f.step.seqs  # (where a failed step's finished completions are found: _orphans)
        tokens, accepted, logprobs = self.launcher.wait(f, self.stats)
        drew, live = [], self._live
        for seq, reason in self.scheduler.postprocess(f.step, tokens, accepted, logprobs):
            req, text = seq.request, None
            if seq.facts.stop_strings and len(seq.all_ids) - len(seq.prompt_ids) >= seq.facts.min_tokens:
                text = _stop(self.scheduler, seq, live[req.id].text)
                if text is not None:
                    reason = "stop"
            if reason is not None or live[req.id].stream:
                drew.append((seq, reason, text))
        return drew

    def _news(self, seq: Sequence, reason: str | None, text: str | None = None) -> None:
        """One sequence's new tokens as its request's output, into `_undelivered`: the text so far,
        or, when a stop (token-level, from the scheduler, or a stop string, found by `_drawn`)
        ended it, its Result. text: the output's text when `_drawn` decoded it (cut at a stop string)."""
        req, live = seq.request, self._live[seq.request.id]
        out = seq.output_ids
        if reason is None:
            if req.n > 1 or not live.stream:  # one output, once it (all n completions) has finished
                return
            stream, sent = _forked(live.text), len(out)
            delta = RequestOutput(req.id, out[live.num_sent:], stream.feed(out, seq.stop_floor or 0))
            live.text, live.num_sent = stream, sent  # (no call from here on: see the class)
            self._undelivered += [delta]
            return
        result = final_result(seq, reason, self.tokenizer.decode(out) if text is None else text,
                              live.arrival_seconds, self.tokenizer.decode)
        tokens = len(result.token_ids)
        if req.n > 1:
            self._finish_choice(seq, result, tokens)
            return
        last = RequestOutput(result.id, result.token_ids[live.num_sent:], live.text.finish(result.text),
                             True, result.finish_reason, result)
        self.stats.completion_tokens += tokens  # (no call from here on)
        del self._live[req.id]
        self._undelivered += [last]

    def _orphans(self) -> None:
        """After a failed step (Engine._recover): the Result of each request whose sequence (n = 1)
        or one of whose completions (n > 1: those of the step being read) finished in a step read
        before the failure but whose news was never made."""
        for live in list(self._live.values()):
            if live.seq.finished and live.seq.request.n == 1:
                self._orphan(live.seq, live)
        for seq in self._reading:
            live = self._live.get(seq.request.id)
            if seq.finished and seq.request.n > 1 and live is not None and live.seq.request is seq.request \
                    and (self._choices.get(seq.request.id) or [None] * seq.request.n)[seq.index] is None:
                self._orphan(seq, live)

    def _orphan(self, seq: Sequence, live: Live) -> None:
        text = _stop(self.scheduler, seq, live.text) if seq.facts.stop_strings else None
        self._news(seq, "stop" if text is not None else seq.finish_reason or "stop", text)

    def _finish_choice(self, seq: Sequence, result: Result, tokens: int) -> None:
        """n > 1: hold each finished completion until all n have; then the request's one
        output, a Result carrying them as `choices`. tokens: the completion's, counted."""
        rid = seq.request.id
        slots = list(self._choices.get(rid) or [None] * seq.request.n)
        slots[seq.index] = result
        if any(r is None for r in slots):
            self.stats.completion_tokens += tokens  # (no call from here on)
            self._choices[rid] = slots
            return
        result = Result(id=result.id, prompt_tokens=result.prompt_tokens, choices=slots,
                        finish_reason=slots[0].finish_reason, ttft_ms=min(r.ttft_ms for r in slots))
        last = RequestOutput(result.id, [], "", True, result.finish_reason, result)
        self.stats.completion_tokens += tokens  # (no call from here on)
        del self._live[rid]
        if rid in self._choices:
            del self._choices[rid]
        self._undelivered += [last]


def _forked(stream: TextStream) -> TextStream:
    """A copy of a request's detokenizer, fed in its place and put back in one store (`_news`)."""
    fork = object.__new__(type(stream))
    fork.__dict__.update(stream.__dict__)
    return fork


def _stop(scheduler, seq: Sequence, stream: TextStream) -> str | None:
    """A stop string in the sequence's output: it is finished (its blocks freed), then its
    output cut after the first token whose text holds the stop; that text, cut before the stop
    (None: no stop). Finished first: cut short of that, an interrupted check is found again
    (`_orphans`) rather than go on serving the cut sequence."""
    found = _stop_string(seq, stream)
    if found is None:
        return None
    text, end = found
    if not seq.finished:
        scheduler.finish(seq)
    del seq.all_ids[end:]
    return text


def _stop_string(seq: Sequence, stream: TextStream) -> tuple[str, int] | None:
    """Whether the sequence's output now holds one of its stop strings: its text, cut before
    the first, and where its ids end (an index into `all_ids`), or None. A step that drew several
    tokens (a verify step's accepted run) ends the output at the first of them whose text holds
    the stop, as plain decoding would have (the tokens after it are dropped). `seq.stop_checked`:
    output tokens already found free of stops (the check runs at every step the sequence draws
    in, from min_tokens on). A stop string within the text of the first min_tokens - 1 tokens is
    none (`seq.stop_floor`: that text's length): no stop applies before min_tokens."""
    out, m = seq.output_ids, seq.facts.min_tokens
    if seq.stop_floor is None:
        seq.stop_floor = stream.length(out[:m - 1]) if m > 1 else 0
    text, hit = stream.stop_text(out, seq.stop_floor)
    if not hit:
        seq.stop_checked = len(out)
        return None
    for t in range(max(seq.stop_checked + 1, m, 1), len(out)):
        early, hit = stream.stop_text(out[:t], seq.stop_floor)
        if hit:
            return early, len(seq.prompt_ids) + t
    return text, len(seq.all_ids)
