"""Requests in (JSONL or dicts) and results out, with strict validation.

A prompts file is validated whole before any model work; a bad line raises PromptError
naming the file, the line number and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PromptError

FIELDS = ("id", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
MAX_TOKENS_CAP = 1 << 20


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
        raise PromptError(f"{where}: expected a JSON object with `id` and `prompt` (or `prompt_token_ids`).")
    raw = {k: _plain(v) for k, v in raw.items()}  # numpy numbers and arrays as Python ones
    unknown = sorted(k for k in raw if k not in FIELDS)
    if unknown:
        raise PromptError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                          f"valid fields are {', '.join(FIELDS)}.")
    rid = raw.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        fail("id", rid, "a non-empty string or an integer")
    has_text, has_ids = raw.get("prompt") is not None, raw.get("prompt_token_ids") is not None
    if has_text == has_ids:
        raise PromptError(f"{where}: give exactly one of `prompt` (text) or `prompt_token_ids` (a list of ints).")
    prompt, ids = None, None
    if has_text:
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
    top_k = raw.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= 1 << 24:
        fail("top_k", top_k, "an integer >= 0 (0 = no top-k)")
    seed = raw.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63):
        fail("seed", seed, "an integer in [0, 2**63)")
    stop_strings, stop_ids = _stops(raw.get("stop"), fail)
    return Request(id=str(rid), prompt=prompt, prompt_token_ids=ids, max_tokens=max_tokens,
                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                   stop_strings=stop_strings, stop_token_ids=stop_ids)


def _number(raw, name, default, lo, hi, fail) -> float:
    val = raw.get(name, default)
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not lo <= val <= hi:
        fail(name, val, f"a number in [{lo:g}, {hi:g}]")
    return float(val)


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


def _plain(value):
    """A numpy scalar or array (np.int64 token ids, an np.float32 temperature) as the Python
    value it holds; lists one level deep. Anything else as it is."""
    if isinstance(value, list):
        return [v.tolist() if _is_numpy(v) else v for v in value]
    return value.tolist() if _is_numpy(value) else value


def _is_numpy(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tolist")


def _short(value) -> str:
    """A value for an error message; never fails, whatever the value is."""
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError, RecursionError):
            text = repr(value)
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
    the file stays valid JSONL and that request runs again; a complete last line without
    its newline gets one, so the next result starts on a line of its own. A line that is
    not a result (a prompts file, any other JSON) is refused, naming it."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    ids, keep = set(), 0
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                if line.endswith(b"\n"):
                    raise PromptError(f"{path} line {number}: not a result line (not valid JSON); --resume needs "
                                      f"the output of an earlier `trtgraph run`.") from None
                break  # an unterminated last line: the write was cut off
            if not (isinstance(row, dict) and isinstance(row.get("id"), str) and "finish_reason" in row
                    and isinstance(row.get("token_ids"), list)):
                raise PromptError(f"{path} line {number}: not a result line (a result has id, token_ids and "
                                  f"finish_reason); --resume needs the output of an earlier `trtgraph run`.")
            ids.add(row["id"])
        keep += len(line)
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    elif data and not data.endswith(b"\n"):
        with open(path, "ab") as f:
            f.write(b"\n")
    return ids
