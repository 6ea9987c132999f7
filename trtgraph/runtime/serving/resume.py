"""`--resume`: which results an output file already holds, and the fingerprint that ties each
result line to the request line that produced it (an edited request is not taken as done).
A file holding some but not all of a prompts file's results is refused by a run without
--resume (`refuse_unfinished`): it is an interrupted run's work."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ...errors import PromptError
from ...inputs import short


FINGERPRINT_HEX = 32  # digits of a request's fingerprint: the first 128 bits of its SHA-256
BATCH_PREFIX = "req_sha256_"  # a batch output line's response.request_id: this + the fingerprint (OpenAI's own
#                               request ids are "req_" + hex digits: an OpenAI output is not mistaken for ours)


def request_fingerprint(raw) -> str:
    """The fingerprint of one request line as parsed (a native request, or a whole OpenAI batch
    line): the SHA-256 of its JSON with sorted keys and no whitespace, the first 32 hex digits.
    Key order and spacing in the file do not change it; any field's value does. An output line
    records it (`request_sha256`; a batch line's `response.request_id` is `req_sha256_` + it) so that
    --resume can tell a result of the request now in the file from one of an edited request."""
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:FINGERPRINT_HEX]


def line_fingerprint(row, key: str) -> str | None:
    """The fingerprint an output line records (None: a line of an older trtgraph, which wrote none)."""
    if key == "custom_id":
        response = row.get("response")
        rid = response.get("request_id") if isinstance(response, dict) else None
        value = rid.removeprefix(BATCH_PREFIX) if isinstance(rid, str) and rid.startswith(BATCH_PREFIX) else None
    else:
        value = row.get("request_sha256")
    return value if isinstance(value, str) and len(value) == FINGERPRINT_HEX else None


@dataclass
class ResumePoint:
    """What --resume found in an output file."""
    done: set[str]  # the ids whose results are written
    unchecked: int = 0  # results without a fingerprint (an older trtgraph's): their requests were not compared


def resume_point(path: str | Path, key: str = "id", expected: set[str] | None = None,
                 prompts: str = "the prompts file", sources: dict[str, tuple[int, str]] | None = None,
                 stale=None) -> ResumePoint:
    """Ids already in a results file (the `key` field of each line: `custom_id` in an OpenAI
    batch output). A last line cut short by a hard kill is removed, so the file stays valid
    JSONL and that request runs again; a complete last line without its newline gets one, so
    the next result starts on a line of its own. A line that is not a result (a prompts file,
    any other JSON) is refused, naming it; so is, with `expected` (the prompts file's ids), a result
    for an id the prompts file does not hold (the output of another prompts file); and, with
    `sources` (id -> (line in the prompts file, its request_fingerprint)), a result whose recorded
    fingerprint is not that of the request the prompts file now holds under its id (the request
    was edited after the result was written); and, with `stale` (row -> why its result is not what the
    request asks for now, or None), a result that says so. Nothing in the file changes when it is refused."""
    path = Path(path)
    if not path.exists():
        return ResumePoint(set())
    data = path.read_bytes()
    ids, keep, foreign, changed, unchecked, old = set(), 0, None, [], 0, []
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                if line.endswith(b"\n"):
                    raise PromptError(f"{path} line {number}: not a result line (not valid JSON); --resume needs "
                                      f"the output of an earlier `trtgraph run`.") from None
                break  # an unterminated last line: the write was cut off
            if not _is_result_line(row, key):
                raise PromptError(f"{path} line {number}: not a result line (a result has id, token_ids and "
                                  f"finish_reason, or choices; an OpenAI batch output line has custom_id and "
                                  f"response); --resume needs the output of an earlier `trtgraph run`.")
            if expected is not None and row[key] not in expected and foreign is None:
                foreign = number, row[key]
            if sources is not None and row[key] in sources:
                recorded = line_fingerprint(row, key)
                if recorded is None:
                    unchecked += 1
                elif recorded != sources[row[key]][1]:
                    changed.append((number, row[key], recorded))
            if stale is not None and (why := stale(row)):
                old.append((number, row[key], why))
            ids.add(row[key])
        keep += len(line)
    if foreign is not None:  # (after every line is known to be a result: that refusal names its line first)
        raise PromptError(f"{path} line {foreign[0]}: a result for {key} {foreign[1]!r}, which {prompts} does not "
                          f"hold; --resume continues a run of the same prompts file. Pass that file, or write to "
                          f"a new --output.")
    if changed:
        raise _changed_error(path, key, prompts, sources, changed)
    if old:
        raise _stale_error(path, key, old)
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    elif data and not data.endswith(b"\n"):
        with open(path, "ab") as f:
            f.write(b"\n")
    return ResumePoint(ids, unchecked)


def _changed_error(path, key, prompts, sources, changed) -> PromptError:
    number, rid, recorded = changed[0]
    line, now = sources[rid]
    name, prefix = ("response.request_id", BATCH_PREFIX) if key == "custom_id" else ("request_sha256", "")
    rest = [str(c[0]) for c in changed[1:]]
    more = (f" Line{'s' if len(rest) > 1 else ''} {', '.join(rest[:5])}{', ...' if len(rest) > 5 else ''} of {path} "
            + ("hold results of changed requests too." if len(rest) > 1 else
               "holds the result of a changed request too.")) if rest else ""
    lines, them = ("those result lines", "the requests") if rest else ("that result line", "the request")
    return PromptError(f"{path} line {number}: the result for {key} {rid!r} was written for another request than "
                       f"{prompts} line {line} holds now ({name} {prefix}{recorded} in the output, {prefix}{now} "
                       f"for the request now): the request changed after its result was written, and --resume "
                       f"would keep the old request's result.{more} Remove {lines} from {path} to run {them} "
                       f"again, restore {them} as {'they were' if rest else 'it was'}, or write to a new --output.")


def _stale_error(path, key, old) -> PromptError:
    (number, rid, why), more = old[0], f" So are {len(old) - 1} more lines of {path}." if len(old) > 1 else ""
    return PromptError(f"{path} line {number}: the result for {key} {rid!r} {why}.{more} Remove such result lines "
                       f"from {path} to run them again with --resume, or write to a new --output.")


def _is_result_line(row, key: str) -> bool:
    """A line `run` wrote: a native result (n > 1: with `choices`) or an OpenAI batch output line."""
    if not isinstance(row, dict) or not isinstance(row.get(key), str):
        return False
    if key == "custom_id":
        return "response" in row and "error" in row
    return isinstance(row.get("choices"), list) or ("finish_reason" in row and isinstance(row.get("token_ids"), list))


def refuse_unfinished(path: str | Path, key: str, expected: set[str], prompts: str = "the prompts file") -> None:
    """A run without --resume empties `path`: refused where it holds the results of some, not all, of the
    prompts file's requests (an interrupted run's; --resume keeps them). Anything else is replaced."""
    path = Path(path)
    if not path.is_file():
        return
    done = set()
    with path.open("rb") as f:
        for line in f:
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue  # blank, or cut short by a hard kill
            if _is_result_line(row, key) and row[key] in expected:
                done.add(row[key])
    if 0 < len(done) < len(expected):
        raise PromptError(f"{path} holds the results of {len(done)} of the {len(expected)} requests of {prompts}, "
                          f"as an interrupted run leaves it; running again without --resume would replace "
                          f"them. Pass --resume to serve only the {len(expected) - len(done)} left, or remove "
                          f"{path} (or write to another --output) to run them all again.")
