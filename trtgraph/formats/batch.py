"""Request files for `trtgraph run`: native JSONL or OpenAI Batch API files, told apart by
their lines; results written back in the same family.

A batch input line is `{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`; its output line is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` with the
body a `text_completion` / `chat.completion` object (formats/openai.py). A body that cannot be
served (refused by the translation, the native validation, or at admission) gets status 400,
an OpenAI error object as its body, and the same error in `error`; the rest of the file runs.
A line whose structure is wrong (not JSON, no custom_id, a repeated custom_id, another method
or url) refuses the whole file, naming the line, before any model work.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator

from ..errors import PromptError
from ..inputs import short, text_problem
from ..runtime.serving.requests import Request, Result, json_lines, parse_prompts, parse_request, read_input
from ..runtime.serving.resume import BATCH_PREFIX, request_fingerprint
from . import openai as oa

BATCH_FIELDS = ("custom_id", "method", "url", "body")
URLS = {"/v1/completions": (oa.completion_request, oa.completion_object),
        "/v1/chat/completions": (oa.chat_request, oa.chat_completion_object)}
DEFAULT_MODEL = "trtgraph"  # the `model` of a response whose request named none
OLD_CHAT_DEFAULT = 16  # what trtgraph before the nineteenth session gave a chat line without a max


@dataclass(frozen=True)
class BatchEntry:
    custom_id: str
    url: str
    line: int  # in the input file
    model: str
    fingerprint: str  # request_fingerprint of the whole input line (each response's request_id: `req_sha256_` + it)
    fields: tuple[str, str] = ("prompt", "max_tokens")  # the body's prompt and max fields (oa.body_fields)


@dataclass
class RequestFile:
    """The requests of one file, and how to write their results."""
    name: str
    requests: list[Request]  # what the engine serves
    entries: dict[str, BatchEntry] | None = None  # batch files: by custom_id, in file order
    refused: dict[str, dict] = field(default_factory=dict)  # batch files: output lines of refused bodies
    sources: dict[str, tuple[int, str]] = field(default_factory=dict)  # id -> (input line, request_fingerprint)

    @property
    def is_batch(self) -> bool:
        return self.entries is not None

    @property
    def id_field(self) -> str:
        """The output field `--resume` keys on."""
        return "custom_id" if self.is_batch else "id"

    @property
    def ids(self) -> list[str]:
        return list(self.entries) if self.is_batch else [r.id for r in self.requests]

    def for_model(self, generation) -> list[Request]:
        """The requests as the engine of a model with these generation defaults serves them: a
        batch line's omitted temperature as OpenAI bodies have it (`oa.model_temperature`)."""
        if not self.is_batch:
            return self.requests
        return [oa.model_temperature(r, generation) for r in self.requests]

    def cut_by_old_default(self, max_seq_len: int) -> Callable[[dict], str | None]:
        """For --resume: an output line's reason to be run again, or None. trtgraph before the
        nineteenth session gave a chat line without a max the native default of OLD_CHAT_DEFAULT
        tokens; its request line (and fingerprint) is the same now that the line runs to the end
        of the context, so such a result would stand beside full ones, silently shorter."""
        to_context = {r.id for r in self.requests if r.sampling.fills_context}

        def why(row: dict) -> str | None:
            body = (row.get("response") or {}).get("body") if isinstance(row.get("response"), dict) else None
            if row.get(self.id_field) not in to_context or not isinstance(body, dict):
                return None
            prompt = (body.get("usage") or {}).get("prompt_tokens") if isinstance(body.get("usage"), dict) else None
            choices = body.get("choices") if isinstance(body.get("choices"), list) else []
            cut = [c for c in choices if isinstance(c, dict) and c.get("finish_reason") == "length"
                   and isinstance(c.get("token_ids"), list) and len(c["token_ids"]) == OLD_CHAT_DEFAULT]
            if not cut or not isinstance(prompt, int) or prompt + OLD_CHAT_DEFAULT >= max_seq_len:
                return None
            return (f"stopped at {OLD_CHAT_DEFAULT} tokens (finish_reason \"length\"), short of the context "
                    f"(limits.max_seq_len {max_seq_len}, prompt {prompt} tokens): an earlier trtgraph gave a chat "
                    f"line without max_tokens / max_completion_tokens {OLD_CHAT_DEFAULT} tokens; such a line now "
                    f"runs to the end of the context, as `serve` does")
        return why

    def without(self, done: set[str]) -> RequestFile:
        """The file less the requests whose results are already written (--resume)."""
        return replace(self, requests=[r for r in self.requests if r.id not in done],
                       entries=None if self.entries is None else
                       {k: e for k, e in self.entries.items() if k not in done},
                       refused={k: v for k, v in self.refused.items() if k not in done})

    def lines(self, results: Iterable[Result], token_text: Callable[[int], str] | None = None,
              token_bytes: oa.TokenBytes | None = None) -> Iterator[tuple[str, dict]]:
        """(id, output line) for the refused bodies first, then each result as it comes."""
        yield from self.refused.items()
        for result in results:
            yield result.id, (self._batch_line(result, token_text, token_bytes) if self.is_batch else
                              self._native_line(result))

    def _native_line(self, result: Result) -> dict:
        line = result.to_json()
        if result.id in self.sources:  # the fingerprint of the request line that produced it (--resume checks it)
            line["request_sha256"] = self.sources[result.id][1]
        return line

    def _batch_line(self, result: Result, token_text, token_bytes=None) -> dict:
        entry = self.entries[result.id]
        if result.error is not None:
            return output_line(entry, 400, oa.error_from_result(result, fields=entry.fields))
        to_object = URLS[entry.url][1]
        return output_line(entry, 200, to_object(result, entry.model, response_id=None, token_text=token_text,
                                                 token_bytes=token_bytes))


def read_requests(source: str, vocab_size: int | None = None) -> RequestFile:
    """A native or batch request file ('-': standard input), validated whole before any
    model work. A file mixing the two kinds is refused, naming the first line of the other."""
    name, data = read_input(source)
    rows = json_lines(data, name)
    first = _is_batch_line(rows[0][1])
    for n, raw in rows:
        if _is_batch_line(raw) != first:
            kinds = ("native request", "OpenAI batch line")
            raise PromptError(f"{name} line {n}: {_a(kinds[not first])} in a file of {kinds[first]}s (line "
                              f"{rows[0][0]} is {_a(kinds[first])}); one file holds one kind of line.")
    if not first:
        requests = parse_prompts(rows, name, vocab_size)  # one request per row, in order
        return RequestFile(name, requests, sources={r.id: (n, request_fingerprint(raw))
                                                    for r, (n, raw) in zip(requests, rows)})
    return _read_batch(rows, name, vocab_size)


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiouAEIOU" else "a ") + noun


def _is_batch_line(raw) -> bool:
    return isinstance(raw, dict) and any(k in raw for k in BATCH_FIELDS)


def _read_batch(rows, name: str, vocab_size: int | None) -> RequestFile:
    requests, entries, refused = [], {}, {}
    for n, raw in rows:
        where = f"{name} line {n}"
        entry = _entry(raw, where, n, entries)
        entries[entry.custom_id] = entry
        translate = URLS[entry.url][0]
        try:
            requests.append(parse_request(translate(raw["body"], entry.custom_id, where), where, vocab_size))
        except PromptError as exc:  # a bad body: this line's response says so, the rest runs
            refused[entry.custom_id] = output_line(entry, 400, oa.error_from_exception(exc))
    sources = {cid: (e.line, e.fingerprint) for cid, e in entries.items()}
    return RequestFile(name, requests, entries, refused, sources)


def _entry(raw: dict, where: str, line: int, seen: dict[str, BatchEntry]) -> BatchEntry:
    """The structure of one batch line; any fault refuses the whole file."""
    unknown = sorted(k for k in raw if k not in BATCH_FIELDS)
    if unknown:
        raise PromptError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in a "
                          f"batch line; valid fields are {', '.join(BATCH_FIELDS)}.")
    cid = raw.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise PromptError(f"{where}: `custom_id` must be a non-empty string; every batch line needs one.")
    if text_problem(cid):  # it is written back in the output line, which cannot hold it
        raise PromptError(f"{where}: `custom_id` = {short(cid)} is not allowed; expected {text_problem(cid)}.")
    if cid in seen:
        raise PromptError(f"{where}: duplicate custom_id {cid!r} (first on line {seen[cid].line}); "
                          f"custom_ids must be unique, results are keyed by them.")
    if raw.get("method") != "POST":
        raise PromptError(f"{where}: `method` = {raw.get('method')!r}; batch lines must use \"POST\".")
    if raw.get("url") not in URLS:
        raise PromptError(f"{where}: `url` = {raw.get('url')!r}; supported: {', '.join(URLS)}.")
    if "body" not in raw:
        raise PromptError(f"{where}: no `body`; give the request body of {raw['url']}.")
    body = raw["body"]
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and text_problem(model):  # echoed in the response body, which cannot hold it
        raise PromptError(f"{where}: `body.model` = {short(model)} is not allowed; expected {text_problem(model)}.")
    fields = oa.body_fields(body if isinstance(body, dict) else {}, raw["url"] == "/v1/chat/completions")
    return BatchEntry(cid, raw["url"], line, model if isinstance(model, str) and model else DEFAULT_MODEL,
                      request_fingerprint(raw), fields)


def output_line(entry: BatchEntry, status_code: int, body: dict) -> dict:
    """One line of OpenAI's batch output format. Its `response.request_id` (an opaque string in
    OpenAI's format) is `req_sha256_` + the fingerprint of the input line, which --resume checks."""
    error = None
    if status_code != 200:
        err = body["error"]
        error = {"code": err["type"], "message": err["message"], "param": err["param"], "line": entry.line}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": entry.custom_id,
            "response": {"status_code": status_code, "request_id": BATCH_PREFIX + entry.fingerprint, "body": body},
            "error": error}
