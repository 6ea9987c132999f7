"""After a step: its tokens to text and outputs (`Deliveries`, mixed into the Engine: its
launcher, scheduler, tokenizer, stats and the requests being served, `Live`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .launcher import InFlight
from .requests import Result
from .scheduler import Sequence
from .streaming import RequestOutput, TextStream, final_result, logprob_entries


# Live.stream, past True / False: every step's news of every completion (n > 1 too, each
# output naming its completion) with its tokens' logprob entries when asked: the server's.
BY_CHOICE = "by choice"


@dataclass
class Sent:
    """One completion's text stream and the output tokens of it already handed out."""
    text: TextStream
    num_sent: int = 0
    entries: list[dict] = field(default_factory=list)  # logprob entries of the tokens handed out (BY_CHOICE)


@dataclass
class Live:
    """A request being served: its sequence, when it arrived, and what was handed out."""
    seq: Sequence
    arrival_seconds: float  # time.perf_counter() at add_request
    text: TextStream
    # Whether each step's new tokens and text are handed out (else only the end); True: n > 1
    # requests' only at the end; BY_CHOICE: each completion's too, with logprob entries.
    stream: bool | str = True
    num_sent: int = 0  # output tokens already handed out (of completion 0)
    entries: list[dict] = field(default_factory=list)  # their logprob entries (BY_CHOICE, when asked)
    forks: dict[int, Sent] = field(default_factory=dict)  # BY_CHOICE, n > 1: completions 1..n-1's

    def sent(self, index: int) -> "Live | Sent":
        """Completion `index`'s text stream and tokens handed out."""
        if index == 0:
            return self
        if index not in self.forks:
            self.forks[index] = Sent(self.text.twin())
        return self.forks[index]


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
        tokens, accepted, logprobs = self.launcher.wait(f, self.stats)
        self._reading = [*self._reading, *f.step.seqs]  # (where a failed step's finished completions are found)
        drew, live = [], self._live
        for seq, reason in self.scheduler.postprocess(f.step, tokens, accepted, logprobs):
            req, text = seq.request, None
            if seq.facts.stop_strings and len(seq.all_ids) - len(seq.prompt_ids) >= seq.facts.min_tokens:
                text = _stop(self.scheduler, seq, live[req.id].text, reason is not None)
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
        by_choice = live.stream == BY_CHOICE
        if reason is None:
            if live.stream and (req.n == 1 or by_choice):  # else one output, once it (all n) has finished
                self._delta(seq, live, by_choice)
            return
        result = final_result(seq, reason, self.tokenizer.decode(seq.output_ids) if text is None else text,
                              live.arrival_seconds, self.tokenizer.decode,
                              live.sent(seq.index).entries if by_choice else None)
        tokens = len(result.token_ids)
        if req.n > 1:
            self._finish_choice(seq, result, tokens, [self._last_delta(live, seq.index, result, False)]
                                if by_choice else [])
            return
        last = self._last_delta(live, 0, result, True, by_choice)
        self.stats.completion_tokens += tokens  # (no call from here on)
        del self._live[req.id]
        self._undelivered += [last]

    def _delta(self, seq: Sequence, live: Live, by_choice: bool) -> None:
        """A sequence's tokens and text since its previous output (and, by choice, their logprob
        entries), into `_undelivered`; its completion's stream, count and entries stored with it."""
        sent, out, k = live.sent(seq.index), seq.output_ids, seq.request.logprobs
        new, num = out[sent.num_sent:], len(out)
        entries, kept = None, sent.entries
        if by_choice and k is not None:  # (kept: the Result's logprobs begin with them)
            entries = logprob_entries(new, seq.logprobs[sent.num_sent:], k, self.tokenizer.decode)
            kept = kept + entries
        stream = _forked(sent.text)
        delta = RequestOutput(seq.request.id, new, stream.feed(out, seq.stop_floor or 0), index=seq.index,
                              logprobs=entries)
        sent.text, sent.num_sent, sent.entries = stream, num, kept  # (no call from here on: see the class)
        self._undelivered += [delta]

    @staticmethod
    def _last_delta(live: Live, index: int, result: Result, finished: bool,
                    with_logprobs: bool = True) -> RequestOutput:
        """The rest of a finished completion: its tokens and text not handed out yet, its finish
        reason (`finished`: the request's last output, carrying the Result)."""
        sent = live.sent(index)
        entries = result.logprobs[sent.num_sent:] if with_logprobs and result.logprobs is not None else None
        return RequestOutput(result.id, result.token_ids[sent.num_sent:], sent.text.finish(result.text), finished,
                             result.finish_reason, result if finished else None, index, entries)

    def _orphans(self) -> None:
        """After a failed step (Engine._recover): the Result of each request whose sequence (n = 1)
        or one of whose completions (n > 1: those of the step being read) finished in a step read
        before the failure but whose news was never made; not one being aborted. The stop-string
        searches of the others read there start afresh: one cut short as it ended its sequence had
        searched past the stop."""
        for seq in self._reading:  # a stop string found as the step failed is searched for again (from the start)
            if not seq.finished and seq.stop_scan is not None:
                seq.stop_scan, seq.stop_checked = None, 0
        aborts = self._aborts  # (finished by an abort a Ctrl-C cut short: dropped, when applied again)
        for live in list(self._live.values()):
            if live.seq.finished and live.seq.request.n == 1 and live.seq.request.id not in aborts:
                self._orphan(live.seq, live)
        for seq in self._reading:
            live = self._live.get(seq.request.id)
            if seq.finished and seq.request.n > 1 and live is not None and live.seq.request is seq.request \
                    and seq.request.id not in aborts \
                    and (self._choices.get(seq.request.id) or [None] * seq.request.n)[seq.index] is None:
                self._orphan(seq, live)

    def _orphan(self, seq: Sequence, live: Live) -> None:
        text = _stop(self.scheduler, seq, live.text, True) if seq.facts.stop_strings else None
        self._news(seq, "stop" if text is not None else seq.finish_reason or "stop", text)

    def _finish_choice(self, seq: Sequence, result: Result, tokens: int, ended: list[RequestOutput]) -> None:
        """n > 1: hold each finished completion until all n have; then the request's one
        output, a Result carrying them as `choices`. tokens: the completion's, counted; ended: its
        own last delta (streamed by choice), delivered with it."""
        rid = seq.request.id
        slots = list(self._choices.get(rid) or [None] * seq.request.n)
        slots[seq.index] = result
        if any(r is None for r in slots):
            self.stats.completion_tokens += tokens  # (no call from here on)
            self._choices[rid] = slots
            self._undelivered += ended
            return
        result = Result(id=result.id, prompt_tokens=result.prompt_tokens, choices=slots,
                        finish_reason=slots[0].finish_reason, ttft_ms=min(r.ttft_ms for r in slots))
        outputs = ended + [RequestOutput(result.id, [], "", True, result.finish_reason, result)]
        self.stats.completion_tokens += tokens  # (no call from here on)
        del self._live[rid]
        if rid in self._choices:
            del self._choices[rid]
        self._undelivered += outputs


def _forked(stream: TextStream) -> TextStream:
    """A copy of a request's detokenizer, fed in its place and put back in one store (`_delta`)."""
    fork = object.__new__(type(stream))
    fork.__dict__.update(stream.__dict__)
    return fork


def _stop(scheduler, seq: Sequence, stream: TextStream, finished: bool = False) -> str | None:
    """A stop string in the sequence's output: it is finished (its blocks freed), then its
    output cut after the first token whose text holds the stop; that text, cut before the stop
    (None: no stop). Finished first: cut short of that, an interrupted check is found again
    (`_orphans`) rather than go on serving the cut sequence. finished: the sequence ended
    otherwise this step (the full text is checked: `_stop_string`)."""
    found = _stop_string(seq, stream, finished)
    if found is None:
        return None
    text, end = found
    if not seq.finished:
        scheduler.finish(seq)
    del seq.all_ids[end:]
    return text


def _stop_string(seq: Sequence, stream: TextStream, finished: bool = False) -> tuple[str, int] | None:
    """Whether the sequence's output now holds one of its stop strings: its text, cut before
    the first, and where its ids end (an index into `all_ids`), or None. A step that drew several
    tokens (a verify step's accepted run) ends the output at the first of them whose text holds
    the stop, as plain decoding would have (the tokens after it are dropped). `seq.stop_checked`:
    output tokens already found free of stops (the check runs at every step the sequence draws
    in, from min_tokens on). A stop string within the text of the first min_tokens - 1 tokens is
    none (`seq.stop_floor`: that text's length): no stop applies before min_tokens. The search is
    incremental (`seq.stop_scan`); the full text is decoded where it finds a hit, and once for a
    sequence that `finished` otherwise, so the result is always the full decode's."""
    out, m = seq.output_ids, seq.facts.min_tokens
    if seq.stop_floor is None:
        seq.stop_floor = stream.length(out[:m - 1]) if m > 1 else 0
    if seq.stop_scan is None:
        seq.stop_scan = stream.scan()
    if not finished and not seq.stop_scan.hit(out, seq.stop_floor):
        seq.stop_checked = len(out)
        return None
    text, hit = stream.stop_text(out, seq.stop_floor)
    if not hit:
        seq.stop_checked = len(out)
        return None
    for t in range(max(seq.stop_checked + 1, m, 1), len(out)):
        early, hit = stream.stop_text(out[:t], seq.stop_floor)
        if hit:
            return early, len(seq.prompt_ids) + t
    return text, len(seq.all_ids)
