"""How the command line ends: errors and signals mapped to exit codes (the list is in
cli.py's docstring), one place for all commands.

A TrtgraphError or running out of memory is exit 2 with a one-paragraph message; SIGINT or
SIGTERM is 130 after the command has said what it kept; a broken pipe is 141, quietly;
anything else is 1 with a one-line "internal error" (TRTGRAPH_RAISE_ERRORS=1 shows the
traceback).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading

import click

from .errors import TrtgraphError

EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141


class UserError(click.ClickException):
    exit_code = 2

    def show(self, file=None):
        click.echo(f"error: {self.format_message()}", err=True)


def _raise_errors() -> bool:
    return os.environ.get("TRTGRAPH_RAISE_ERRORS", "").strip().lower() not in ("", "0", "false", "no", "off")


def _out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)))


class Group(click.Group):
    def invoke(self, ctx):
        _tolerate_terminal_encoding()
        restore = _sigterm_interrupts()
        try:
            return super().invoke(ctx)
        except TrtgraphError as exc:
            if _raise_errors():
                raise
            raise UserError(str(exc)) from None
        except KeyboardInterrupt:  # SIGINT, or SIGTERM: the command said what it kept, if anything
            click.echo("\ninterrupted: stopped before finishing.", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # the reader went away (`| head -1`): stop quietly
            _silence_stdio()
            ctx.exit(EXIT_BROKEN_PIPE)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:  # an internal error: say so briefly, exit 1
            if _raise_errors():
                raise
            if _out_of_memory(exc):  # the environment, not a bug
                raise UserError(f"out of memory ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). "
                                f"Free memory, or capture a smaller plan (kv_cache.num_blocks, "
                                f"limits.max_seq_len / max_batch_size).") from None
            click.echo(f"internal error: {type(exc).__name__}: {exc}\n(set TRTGRAPH_RAISE_ERRORS=1 for the "
                       f"traceback, and please report it)", err=True)
            ctx.exit(1)
        finally:
            restore()


def _sigterm_interrupts():
    """SIGTERM stops a command like Ctrl-C (exit 130, the command's own summary). Returns
    a function that puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _tolerate_terminal_encoding() -> None:
    """A terminal that cannot show a character (PYTHONIOENCODING=ascii, a latin-1 locale)
    gets an escape instead of a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and not is_utf8(stream):
            stream.reconfigure(errors="backslashreplace")


def is_utf8(stream) -> bool:
    return (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "") in ("utf8", "utf8sig")


def _silence_stdio() -> None:
    """After a broken pipe: point stdout and stderr at /dev/null, so the interpreter's final
    flush does not print a second error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass
    os.close(devnull)
