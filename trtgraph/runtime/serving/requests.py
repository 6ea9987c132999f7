"""Requests in (JSONL or dicts) and results out, with strict validation.

A prompts file is validated whole before any model work; a bad line raises PromptError
naming the file, the line number and the field.

With `logprobs: N` a result carries `logprobs`: one entry per generated token,
  {"token_id": int, "token": str, "logprob": float,
   "top_logprobs": [{"token_id": int, "token": str, "logprob": float}, ... N, most likely first]}
log-probabilities of the raw model logits (log_softmax before logit_bias, penalties,
temperature and the filters; vLLM's default). `token` is the token decoded alone. OpenAI's
completion format is `tokens` = [e.token], `token_logprobs` = [e.logprob], `top_logprobs` =
[{t.token: t.logprob}]; its chat format is content = [{token, logprob, bytes, top_logprobs:
[{token, logprob, bytes}]}].
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...errors import PromptError
from ...inputs import InputTooLarge, JSONProblem, int_problem, is_int, loads_json, read_bounded, short, text_problem
from .sampling_params import (LOGIT_BIAS_CAPACITY, MAX_LOGPROBS, MAX_N, MAX_STOP_TOKEN_IDS,  # noqa: F401
                              MAX_TOKENS_CAP, SAMPLING_DEFAULTS, SAMPLING_FIELDS, RequestFields, SamplingParams)

FIELDS = ("id", "prompt", "prompt_token_ids", "messages", "n") + SAMPLING_FIELDS
CHAT_ROLES = ("system", "user", "assistant")


_MASK64 = (1 << 64) - 1


def completion_seed(seed: int, index: int) -> int:
    """The seed completion `index` of an n > 1 request draws with: the request's own for completion 0
    (so n = 1 and the first of n draw alike), else splitmix64 of (seed, index) in 63 bits, so that
    nearby seeds share no completion (seed + index did: seed s's completion 1 was seed s + 1's first)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True, init=False)
class Request:
    id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: SamplingParams
    n: int  # completions of this prompt; completion i draws with completion_seed(seed, i)
    messages: tuple[tuple[str, str], ...] | None  # chat: (role, content) pairs

    def __init__(self, id: str, prompt: str | None = None, prompt_token_ids=None,
                 sampling: SamplingParams | None = None, n: int = 1, messages=None, **fields):
        """`fields`: SamplingParams fields given flat (Request(id=.., max_tokens=8, temperature=0.7));
        stop_strings / stop_token_ids are accepted as well."""
        stop = tuple(fields.pop("stop_strings", ())) + tuple(fields.pop("stop_token_ids", ()))
        if stop:
            fields["stop"] = stop
        if sampling is None:
            sampling = SamplingParams(**fields)
        elif fields:
            sampling = replace(sampling, **fields)
        for name, val in (("id", id), ("prompt", prompt), ("sampling", sampling), ("n", n), ("messages", messages),
                          ("prompt_token_ids", None if prompt_token_ids is None else tuple(prompt_token_ids))):
            object.__setattr__(self, name, val)

    def __getattr__(self, name):  # the resolved sampling fields: req.temperature, req.max_tokens, ...
        if name in SAMPLING_DEFAULTS:
            val = getattr(self.sampling, name)
            return SAMPLING_DEFAULTS[name] if val is None else val
        if name in SAMPLING_FIELDS or name in ("stop_strings", "stop_token_ids"):
            return getattr(self.sampling, name)
        raise AttributeError(name)

    def with_sampling(self, sampling: SamplingParams) -> "Request":
        """This request with `sampling` (already validated) in place of its sampling fields;
        nothing else is validated or copied again (its prompt ids are shared)."""
        out = object.__new__(Request)
        out.__dict__.update(self.__dict__, sampling=sampling)
        return out

    @property
    def is_greedy(self) -> bool:
        """A pure argmax: temperature 0, no logits processor, no min_p, no logprobs. Anything
        else runs on the sampled keys."""
        s = self.sampling
        return (self.temperature == 0.0 and not s.uses_processors and s.logprobs is None)

    @property
    def chat_messages(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages or ()]



def resolve_sampling_defaults(req: Request, defaults) -> Request:
    """Fill the sampling fields a request left out (temperature / top_p / top_k) from the
    model's generation defaults (a models.config.GenerationDefaults: do_sample false means
    greedy; top_p and top_k where the file gives them)."""
    model = {"temperature": defaults.default_temperature, "top_p": defaults.top_p, "top_k": defaults.top_k}
    return dataclasses.replace(req, sampling=req.sampling.resolved({k: v for k, v in model.items() if v is not None}))


@dataclass
class Result:
    id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # stop | length | error
    error: str | None = None
    error_code: str | None = None  # "context_length_exceeded" for a refusal by limits.max_seq_len (OpenAI's code)
    error_param: str | None = None  # the native field that refusal names: "prompt" or "max_tokens"
    prompt_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    logprobs: list[dict] | None = None  # with `logprobs: N`: one entry per token (module docstring)
    choices: list[Result] | None = None  # n > 1: the n completions, in index order

    def to_json(self) -> dict:
        if self.choices is not None:
            return _choices_json(self)
        out = {"id": self.id, "text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "error": self.error, "usage": {"prompt_tokens": self.prompt_tokens,
                                              "completion_tokens": len(self.token_ids)},
               "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
               "tpot_ms": None if self.tpot_ms is None else round(self.tpot_ms, 3)}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


def _choices_json(result: Result) -> dict:
    """n > 1: one line with a `choices` list (index, text, token_ids, finish_reason, timings)."""
    choices = []
    for i, c in enumerate(result.choices):
        one = c.to_json()
        del one["id"], one["error"], one["usage"]
        choices.append({"index": i, **one})
    return {"id": result.id, "choices": choices, "error": None,
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "completion_tokens": sum(len(c.token_ids) for c in result.choices)}}


def parse_request(raw, where: str, vocab_size: int | None = None) -> Request:
    """One request from a dict. `where` names it in errors (`prompts.jsonl line 3`)."""

    check = RequestFields(where)
    fail = check.fail
    if not isinstance(raw, dict):
        raise PromptError(f"{where}: expected a JSON object with `id` and `prompt` (or `prompt_token_ids`, "
                          f"or `messages`).")
    raw = {k: _plain(v) for k, v in raw.items()}  # numpy numbers and arrays as Python ones
    unknown = sorted(short(k) if text_problem(k) else k for k in raw if k not in FIELDS)
    if unknown:
        raise PromptError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                          f"valid fields are {', '.join(FIELDS)}.")
    rid = raw.get("id")
    if "id" not in raw:
        raise PromptError(f"{where}: missing field `id`; give every request a unique `id` (a non-empty string "
                          f"or an integer): it names the request's output line and lets an interrupted run resume.")
    if not (isinstance(rid, str) or int_problem(rid, -(1 << 63), (1 << 63) - 1) is None) or rid == "":
        fail("id", rid, "a non-empty string or an integer in [-2**63, 2**63)")
    if isinstance(rid, str) and text_problem(rid):
        fail("id", rid, text_problem(rid))
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if raw.get(k) is not None]
    if len(given) != 1:
        raise PromptError(f"{where}: give exactly one of `prompt` (text), `prompt_token_ids` (a list of ints) or "
                          f"`messages` (a chat: a list of {{role, content}})" + (f"; got {', '.join(given)}." if given else "."))
    has_text = given == ["prompt"]
    prompt, ids, messages = None, None, None
    hi = vocab_size if vocab_size is not None else 1 << 31
    if given == ["messages"]:
        messages = _messages(raw["messages"], fail)
    elif has_text:
        prompt = raw["prompt"]
        if not isinstance(prompt, str) or not prompt:
            fail("prompt", prompt, "a non-empty string")
        if text_problem(prompt):
            fail("prompt", prompt, text_problem(prompt))
    else:
        ids = raw["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            fail("prompt_token_ids", ids, "a non-empty list of token ids")
        for t in ids:
            if not is_int(t) or not 0 <= t < hi:
                fail("prompt_token_ids", t, f"token ids in [0, {hi})")
        ids = tuple(ids)
    sampling = SamplingParams.from_json(raw, where)
    for t, _bias in sampling.logit_bias:
        if t >= hi:
            fail("logit_bias", {str(t): _bias}, f"token ids in [0, {hi})")
    n = check.integer(raw.get("n", 1), "n", 1, MAX_N)
    return Request(id=str(rid), prompt=prompt, prompt_token_ids=ids, sampling=sampling, n=n, messages=messages)


def _messages(raw, fail) -> tuple[tuple[str, str], ...]:
    """A chat as OpenAI sends it: a non-empty list of {role, content} with string content."""
    if not isinstance(raw, list) or not raw:
        fail("messages", raw, "a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or set(m) - {"role", "content"}:
            fail(f"messages[{i}]", m, "an object with exactly `role` and `content`")
        if m.get("role") not in CHAT_ROLES:
            fail(f"messages[{i}].role", m.get("role"), f"one of {', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            fail(f"messages[{i}].content", m.get("content"), "a string")
        if text_problem(m["content"]):
            fail(f"messages[{i}].content", m["content"], text_problem(m["content"]))
        out.append((m["role"], m["content"]))
    return tuple(out)


def _plain(value):
    """A numpy scalar or array (np.int64 token ids, an np.float32 temperature) as the Python
    value it holds; lists one level deep. Anything else as it is."""
    if isinstance(value, list):
        return [v.tolist() if _is_numpy(v) else v for v in value]
    return value.tolist() if _is_numpy(value) else value


def _is_numpy(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tolist")


def read_prompts(path: str | Path, vocab_size: int | None = None) -> list[Request]:
    """Every request of a JSONL file ('-': standard input), validated before anything runs.
    Blank lines are skipped."""
    name, data = read_input(path)
    return parse_prompts(json_lines(data, name), name, vocab_size)


def read_input(path: str | Path) -> tuple[str, bytes]:
    """(the name errors use, the bytes) of a prompts file, or of standard input for '-'."""
    if str(path) == "-":
        return "<stdin>", sys.stdin.buffer.read()
    try:
        return str(path), read_bounded(path)
    except OSError as exc:
        raise PromptError(f"{path}: cannot read the prompts file ({exc.strerror or exc}).") from None
    except InputTooLarge as exc:
        raise PromptError(f"{path}: cannot read the prompts file ({exc}); pass a JSONL file, or - to read "
                          f"standard input (`cmd | trtgraph run --prompts -`).") from None


def json_lines(data: bytes, name: str) -> list[tuple[int, object]]:
    """(line number, decoded JSON value) of each non-blank line; the first line that is not
    UTF-8 JSON raises PromptError naming it."""
    rows = []
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark (Windows editors write one), as YAML allows
    for n, line in enumerate(data.split(b"\n"), start=1):
        where = f"{name} line {n}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(f"{where}: not valid UTF-8 (byte {exc.start}); save the file as UTF-8.") from None
        if not text.strip():
            continue
        try:
            rows.append((n, loads_json(text, unique_keys=True)))
        except JSONProblem as exc:
            raise PromptError(f"{where}: not valid JSON ({exc}). Each line must be one JSON object.") from None
    if not rows:
        raise PromptError(f"{name}: no requests (the file is empty).")
    return rows


def parse_prompts(rows: list[tuple[int, object]], name: str, vocab_size: int | None = None) -> list[Request]:
    """Native requests from json_lines' rows; ids must be unique."""
    requests, seen = [], {}
    for n, raw in rows:
        where = f"{name} line {n}"
        req = parse_request(raw, where, vocab_size)
        if req.id in seen:
            raise PromptError(f"{where}: duplicate id {req.id!r} (first on line {seen[req.id]}); ids must be unique.")
        seen[req.id] = n
        requests.append(req)
    return requests
