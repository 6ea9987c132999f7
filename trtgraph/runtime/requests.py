"""Requests in (JSONL or dicts) and results out, with strict validation.

A prompts file is validated whole before any model work; a bad line raises PromptError
naming the file, the line number and the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PromptError

FIELDS = ("id", "prompt", "prompt_token_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
MAX_TOKENS_CAP = 1 << 20
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # chat: (role, content) pairs
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Sampling fields the request left out: the model's generation_config.json decides them
    # at admission (resolve_sampling_defaults); without one they keep the values above.
    omitted: frozenset[str] = frozenset()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def chat_messages(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages or ()]


SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


def resolve_sampling_defaults(req: Request, defaults) -> Request:
    """Fill the sampling fields a request left out from the model's generation defaults (a
    models.config.GenerationDefaults: do_sample false means greedy; top_p and top_k where
    the file gives them)."""
    model = {"temperature": defaults.default_temperature, "top_p": defaults.top_p, "top_k": defaults.top_k}
    changes = {k: model[k] for k in req.omitted if model.get(k) is not None}
    return dataclasses.replace(req, omitted=frozenset(), **changes)


@dataclass
class Result:
    id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # stop | length | error
    error: str | None = None
    prompt_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "error": self.error, "usage": {"prompt_tokens": self.prompt_tokens,
                                               "completion_tokens": len(self.token_ids)},
                "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
                "tpot_ms": None if self.tpot_ms is None else round(self.tpot_ms, 3)}


def parse_request(raw, where: str, vocab_size: int | None = None) -> Request:
    """One request from a dict. `where` names it in errors (`prompts.jsonl line 3`)."""

    def fail(field_name, value, expected):
        raise PromptError(f"{where}: field `{field_name}` = {_short(value)} is not allowed; expected {expected}.")

    if not isinstance(raw, dict):
        raise PromptError(f"{where}: expected a JSON object with `id` and `prompt` (or `prompt_token_ids`, "
                          f"or `messages`).")
    unknown = sorted(k for k in raw if k not in FIELDS)
    if unknown:
        raise PromptError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                          f"valid fields are {', '.join(FIELDS)}.")
    rid = raw.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        fail("id", rid, "a non-empty string or an integer")
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if raw.get(k) is not None]
    if len(given) != 1:
        raise PromptError(f"{where}: give exactly one of `prompt` (text), `prompt_token_ids` (a list of ints) or "
                          f"`messages` (a chat: a list of {{role, content}})" + (f"; got {', '.join(given)}." if given else "."))
    has_text, has_ids = given == ["prompt"], given == ["prompt_token_ids"]
    prompt, ids, messages = None, None, None
    if given == ["messages"]:
        messages = _messages(raw["messages"], fail)
    elif has_text:
        prompt = raw["prompt"]
        if not isinstance(prompt, str) or not prompt:
            fail("prompt", prompt, "a non-empty string")
    else:
        ids = raw["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            fail("prompt_token_ids", ids, "a non-empty list of token ids")
        hi = vocab_size if vocab_size is not None else 1 << 31
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < hi:
                fail("prompt_token_ids", t, f"token ids in [0, {hi})")
        ids = tuple(ids)
    max_tokens = raw.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS_CAP:
        fail("max_tokens", max_tokens, f"an integer in [1, {MAX_TOKENS_CAP}]")
    temperature = _number(raw, "temperature", 0.0, 0.0, 100.0, fail)
    top_p = _number(raw, "top_p", 1.0, 0.0, 1.0, fail)
    if top_p == 0.0:
        fail("top_p", top_p, "a number in (0, 1]")
    top_k = 0 if raw.get("top_k") is None else raw["top_k"]  # null: omitted, like temperature and top_p
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= 1 << 24:
        fail("top_k", top_k, "an integer >= 0 (0 = no top-k)")
    seed = raw.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63):
        fail("seed", seed, "an integer in [0, 2**63)")
    stop_strings, stop_ids = _stops(raw.get("stop"), fail)
    return Request(id=str(rid), prompt=prompt, prompt_token_ids=ids, messages=messages, max_tokens=max_tokens,
                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                   stop_strings=stop_strings, stop_token_ids=stop_ids,
                   omitted=frozenset(k for k in SAMPLING_FIELDS if raw.get(k) is None))


def _number(raw, name, default, lo, hi, fail) -> float:
    val = raw.get(name)
    if val is None:
        return default
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not lo <= val <= hi:
        fail(name, val, f"a number in [{lo:g}, {hi:g}]")
    return float(val)


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
        out.append((m["role"], m["content"]))
    return tuple(out)


def _stops(stop, fail) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if stop is None:
        return (), ()
    items = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if not isinstance(items, list):
        fail("stop", stop, "a string, a token id, or a list of them")
    strings, ids = [], []
    for s in items:
        if isinstance(s, str) and s:
            strings.append(s)
        elif isinstance(s, int) and not isinstance(s, bool) and s >= 0:
            ids.append(s)
        else:
            fail("stop", s, "non-empty strings or non-negative token ids")
    return tuple(strings), tuple(ids)


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_prompts(path: str | Path, vocab_size: int | None = None) -> list[Request]:
    """Every request of a JSONL file, validated before anything runs. Blank lines are skipped."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PromptError(f"{path}: cannot read the prompts file ({exc.strerror or exc}).") from None
    requests, seen = [], {}
    for n, line in enumerate(data.split(b"\n"), start=1):
        where = f"{path} line {n}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(f"{where}: not valid UTF-8 (byte {exc.start}); save the file as UTF-8.") from None
        if not text.strip():
            continue
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}). Each line must be "
                              f"one JSON object.") from None
        req = parse_request(raw, where, vocab_size)
        if req.id in seen:
            raise PromptError(f"{where}: duplicate id {req.id!r} (first on line {seen[req.id]}); ids must be unique.")
        seen[req.id] = n
        requests.append(req)
    if not requests:
        raise PromptError(f"{path}: no requests (the file is empty).")
    return requests


def finished_ids(path: str | Path) -> set[str]:
    """Ids already in a results file. A last line cut short by a hard kill is removed, so
    the file stays valid JSONL and that request runs again."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    ids, keep = set(), 0
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if line.strip():
            try:
                ids.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                if line.endswith(b"\n"):
                    raise PromptError(f"{path} line {number}: not a result line; --resume needs the output "
                                      f"of an earlier `trtgraph run`.") from None
                break  # an unterminated last line: the write was cut off
        keep += len(line)
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return ids
