"""Serving a request file (`trtgraph run`): each result written and flushed as it finishes,
`--resume` appending to an interrupted run's output, and on SIGINT / SIGTERM a summary of
what finished and what did not (exit code 130).

The engine must already be loaded. `requests` is a formats.batch.RequestFile (native lines
or OpenAI batch lines); this module only needs its `ids`, `for_model()` and `lines()`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

from ... import startup
from ...errors import OutputPathError

EXIT_INTERRUPTED = 130


def serve_file(engine, requests, output: str | None, resume: bool, ascii_only: bool,
               on_result: Callable[[], None] = lambda: None, log: Callable[[str], None] | None = None) -> dict | None:
    """Serve every request and write its line to `output` (None: standard output). Returns
    the run's stats (`RunStats.to_json()` plus `startup`, the start-up phases), or None when interrupted (the summary of what
    finished is already written to `log`, standard error by default)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = open(output, "a" if resume else "w", encoding="utf-8") if output else sys.stdout
    written: set[str] = set()
    ids = requests.ids
    token_text = lambda t: engine.tokenizer.decode([t])  # noqa: E731
    try:
        results = engine.generate(requests.for_model(engine.generation))
        for rid, line in requests.lines(_first_token_timed(results), token_text,
                                        getattr(engine.tokenizer, "token_bytes", None)):
            with _signals_held():  # a line on disk is a line counted: the summary must match the file
                _write_line(out, json.dumps(line, ensure_ascii=ascii_only), output, len(written), len(ids))
                written.add(rid)
            on_result()
    except KeyboardInterrupt:
        restore = ignore_interrupts()  # a second signal must not cut this summary short
        try:
            log(interrupted_summary(ids, written, output))
        finally:
            restore()
        return None
    except (OutputPathError, BrokenPipeError):  # (the first says what is safe; the second ends quietly)
        raise
    except Exception:  # (a device error, memory): what is on disk, and how to go on, before the error's own message
        log(interrupted_summary(ids, written, output, "stopped by the error below"))
        raise
    finally:
        if output:
            try:
                out.close()
            except OSError:  # every line was flushed, or a failed write has said so already
                pass
    startup.lap("serving")  # requests in, every result written
    return {**engine.stats.to_json(), "startup": startup.CLOCK.to_json()}


def _first_token_timed(results):
    """The results as they come; the earliest first token among them goes to the start-up clock."""
    first = None
    for result in results:
        if result.ttft_ms is not None:
            first = result.ttft_ms if first is None else min(first, result.ttft_ms)
        yield result
    if first is not None:
        startup.CLOCK.first_token(first / 1e3)


def interrupted_summary(ids: list[str], written: set[str], output: str | None, why: str = "interrupted") -> str:
    missing = [i for i in ids if i not in written]
    shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
    return (f"\n{why}: {len(written)} of {len(ids)} requests finished and written"
            f"{' to ' + output if output else ''}; {len(missing)} did not finish: {shown}."
            + (f" Continue with --resume --output {output}." if output else ""))


def write_summary_json(path: str | Path, stats: dict) -> None:
    """A file that does not take the summary (disk full, I/O error) is an environment failure
    (exit 2), not an internal error: every result is already written."""
    try:
        Path(path).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise OutputPathError(f"--summary-json {path}: writing failed ({exc.strerror or exc}); every result was "
                              f"written before it. Free space (or choose another path) for the summary.") from None


def _write_line(out, line: str, output: str | None, num_written: int, num_requests: int) -> None:
    """One result, flushed. A file that stops taking data (disk full, I/O error) is an
    environment failure (exit 2) that says how much is safe and how to continue."""
    try:
        out.write(line + "\n")
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        if not output:
            raise
        raise OutputPathError(f"--output {output}: writing failed ({exc.strerror or exc}) after {num_written} of "
                              f"{num_requests} results; the lines before are whole. Free space (or fix the "
                              f"device) and continue with --resume --output {output}.") from None


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM arriving inside the block are recorded and delivered, through the
    handlers in place before it, when the block ends normally, so an interruption never falls
    between a line's write and its count. (Blocking them with a signal mask would not do: the
    kernel hands a process signal to any thread that does not block it, and Python acts on it
    in the main thread all the same.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, _frame: caught.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if caught:
        signal.raise_signal(caught[0])


def ignore_interrupts() -> Callable[[], None]:
    """Ignore SIGINT and SIGTERM until the returned function restores them."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]
