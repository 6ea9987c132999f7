"""Incremental outputs: what one engine step adds to a request, as token ids and text.

Streamed text never splits a UTF-8 character (a token that ends inside one is held until
the character completes) and never shows text that may turn out to be the start of a stop
string (that suffix is held until it cannot be one, or the request finishes). Concatenated,
a request's text deltas equal its final `Result.text`.

This is the text side of serving: the scheduler has appended the tokens and applied the
token-level stops; here they become text, stop strings end a request, and a finished
sequence becomes its `Result`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .requests import Result

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that do not (yet) form a character


@dataclass
class RequestOutput:
    """One step's news for one request: new token ids, new text, and at the end its Result.
    A request streamed by choice (deliveries.BY_CHOICE) also gets n > 1 completions' deltas,
    each naming its completion (`index`); one whose completion ended has its `finish_reason`
    but not `finished` (the request's own last output, the Result with its `choices`, follows
    when all n have), and each delta carries its tokens' logprob entries when they were asked."""
    id: str
    token_ids: list[int] = field(default_factory=list)  # new since this request's previous output
    text: str = ""  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # stop | length | error, when finished (or its completion ended)
    result: Result | None = None  # the whole request, when finished
    index: int = 0  # which of the request's n completions the delta is of (streamed by choice)
    logprobs: list[dict] | None = None  # streamed by choice with logprobs: token_ids' entries (logprob_entries)


class TextStream:
    """One request's detokenizer. It decodes a sliding window of ids (the tokens since the
    last complete character boundary plus the new ones), so each step costs a few tokens'
    decoding, not the whole output's."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self._tokenizer, self._decode = tokenizer, tokenizer.decode
        self._stops = stop_strings
        self._prefix_offset = 0  # window start: ids before it are text already
        self._read_offset = 0  # ids up to here are in `text`
        self.text = ""  # decoded so far, ending on a complete character
        self.sent = 0  # characters of `text` already handed out

    def feed(self, ids: list[int], floor: int = 0) -> str:
        """The new text after `ids` (all of the request's output ids so far) grew. floor: a
        stop string that ends within the text's first `floor` characters is not one (min_tokens)."""
        before = self._decode(ids[self._prefix_offset:self._read_offset])
        now = self._decode(ids[self._prefix_offset:])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.text += now[len(before):]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        safe = min([len(self.text) - stop_prefix_length(self.text, self._stops)]
                   + _found(self.text, self._stops, floor))
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def twin(self) -> "TextStream":
        """A fresh detokenizer with the same tokenizer and stop strings (another completion's)."""
        return TextStream(self._tokenizer, self._stops)

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the Result's text) after what was handed out."""
        sent = self.text[:self.sent]
        return final_text[len(sent):] if final_text.startswith(sent) else ""

    def stop_text(self, ids: list[int], floor: int = 0) -> tuple[str, bool]:
        """(the text of `ids`, cut before the first stop string it holds that ends past its
        first `floor` characters; whether it held one)."""
        text = self._decode(ids)
        hit = min(_found(text, self._stops, floor), default=-1)
        return (text[:hit], True) if hit >= 0 else (text, False)

    def scan(self) -> StopScan:
        """A fresh incremental stop-string search with this stream's tokenizer and stop strings."""
        return StopScan(self._decode, self._stops)

    def length(self, ids: list[int]) -> int:
        """Characters in the text of `ids`."""
        return len(self._decode(ids))


class StopScan:
    """One sequence's search for its stop strings, step by step: its text decoded as TextStream
    decodes it (a window of ids since the last complete character), and each step's search
    only over the text that step may have changed (from the longest stop string's length before
    the previous search's end). So a step costs its new tokens, not the whole output: a full
    decode of 8,000 tokens took 1.3 ms of host time a step (the shipped tokenizer). A hit here is
    confirmed by a full decode (deliveries._stop_string), which also checks a finished sequence once."""

    def __init__(self, decode, stops: tuple[str, ...]):
        self._decode, self._stops = decode, stops
        self._prefix_offset = self._read_offset = 0
        self._text = ""  # the text of ids[:read_offset], ending on a complete character
        self._searched = 0  # characters of _text searched already

    def hit(self, ids: list[int], floor: int = 0) -> bool:
        """Whether the text of `ids` (the output so far; it only grows) holds a stop string ending
        past its first `floor` characters that the previous searches did not see."""
        before = self._decode(ids[self._prefix_offset:self._read_offset])
        now = self._decode(ids[self._prefix_offset:])
        tail = now[len(before):] if len(now) > len(before) else ""
        if tail and not now.endswith(REPLACEMENT):
            self._text, tail = self._text + tail, ""
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        text, start = self._text + tail, max(floor, self._searched)
        self._searched = len(self._text)
        return any(text.find(s, max(start - len(s) + 1, 0)) >= 0 for s in self._stops)


def _found(text: str, stops: tuple[str, ...], floor: int) -> list[int]:
    """Where each stop string first occurs in `text` ending past its first `floor` characters."""
    return [i for s in stops if (i := text.find(s, max(floor - len(s) + 1, 0))) >= 0]


def final_result(seq, reason: str, text: str, arrival_seconds: float, decode, made: list | None = None) -> Result:
    """A finished sequence's Result: tokens, text, timings (ms) and, when asked, logprobs.
    seq: a scheduler Sequence; decode: the tokenizer's decode; made: the logprob entries of its
    first tokens, made already (for its streamed deltas)."""
    out = seq.output_ids
    n = len(out)
    tpot = (seq.last_token_time - seq.first_token_time) * 1e3 / (n - 1) if n > 1 else None
    req = seq.request
    logprobs = None
    if req.logprobs is not None:
        made = (made or [])[:n]
        logprobs = made + logprob_entries(out[len(made):], seq.logprobs[len(made):], req.logprobs, decode)
    return Result(id=req.id, text=text, token_ids=list(out), finish_reason=reason,
                  prompt_tokens=len(seq.prompt_ids), ttft_ms=(seq.first_token_time - arrival_seconds) * 1e3,
                  tpot_ms=tpot, logprobs=logprobs)


def logprob_entries(tokens: list[int], rows: list, k: int, decode) -> list[dict]:
    """One entry per generated token (runtime/serving/requests.py documents the shape); rows:
    (values, ids) per token, values[0] the token's own log-probability."""
    out = []
    for token, (values, ids) in zip(tokens, rows):
        out.append({"token_id": token, "token": decode([token]), "logprob": values[0],
                    "top_logprobs": [{"token_id": t, "token": decode([t]), "logprob": v}
                                     for t, v in zip(ids[:k], values[1:k + 1])]})
    return out


def stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
