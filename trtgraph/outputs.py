"""Where a command may write: checked before any work.

An output must not be (or resolve, through symlinks or a hard link, to) anything the
command reads: the prompts file, the config, the manifest, a file inside the Triton
cache or the checkpoint directory. Two outputs must not be the same file. Every output
directory must exist (or be creatable) and be writable. Each refusal is an
OutputPathError naming both paths, raised before the model loads, so nothing is
overwritten and no work is lost to a path that fails at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import OutputPathError


@dataclass(frozen=True)
class Place:
    """A path a command reads or writes, and the name a message gives it."""
    label: str  # "--output", "the prompts file (--prompts)", ...
    path: Path
    is_dir: bool = False  # a directory: everything inside it counts
    makedirs: bool = False  # an output whose missing parent directories the command creates

    @property
    def real(self) -> Path:
        return Path(os.path.realpath(self.path))


def place(label: str, path, is_dir: bool = False, makedirs: bool = False) -> Place | None:
    return None if path is None else Place(label, Path(path), is_dir, makedirs)


def stdin_place(label: str) -> Place | None:
    """Standard input where it is a file (`--prompts - < prompts.jsonl`): an output must not be
    that file either (it was read whole, then truncated by the output). None for a pipe or a terminal."""
    try:
        if not stat.S_ISREG(os.fstat(sys.stdin.fileno()).st_mode):
            return None
    except (AttributeError, OSError, ValueError):  # no stdin, or one without a descriptor
        return None
    link = f"/proc/self/fd/{sys.stdin.fileno()}" if os.path.isdir("/proc/self/fd") else "/dev/stdin"
    return Place(label, Path(os.path.realpath(link)))  # the file's own name, for the message


def stdout_place(label: str) -> Place | None:
    """Standard output where it is a file (`--summary-json - > summary.json`): it must not be an
    input or another output (a shell redirect into --output would write the summary over the
    results). None for a pipe or a terminal."""
    try:
        if not stat.S_ISREG(os.fstat(sys.stdout.fileno()).st_mode):
            return None
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    link = f"/proc/self/fd/{sys.stdout.fileno()}" if os.path.isdir("/proc/self/fd") else "/dev/stdout"
    return Place(label, Path(os.path.realpath(link)))


def manifest_inputs(manifest, path) -> list[Place | None]:
    """What a run reads through a loaded manifest: the file, its Triton cache, the checkpoint."""
    ckpt = manifest.app_config().model.path
    return [place("the manifest", path), place("the Triton cache", manifest.paths["triton_cache"], is_dir=True),
            place("the checkpoint directory (config model.path)", ckpt, is_dir=True)]


def check_outputs(outputs: list[Place | None], inputs: list[Place | None]) -> None:
    """Refuse any output that is an input, lies inside an input directory, equals another
    output, or cannot be written. Call it before any work."""
    outs = [o for o in outputs if o is not None]
    ins = [i for i in inputs if i is not None]
    for n, out in enumerate(outs):
        for other in ins + outs[:n]:
            if _overlaps(out, other):
                raise OutputPathError(_clash(out, other, other in ins))
        _check_writable(out)


def _overlaps(out: Place, other: Place) -> bool:
    a, b = out.real, other.real
    if a == b or (other.is_dir and b in a.parents) or (out.is_dir and a in b.parents):
        return True
    try:  # a hard link (or a bind mount) is the same file under another name
        return not out.is_dir and not other.is_dir and os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _clash(out: Place, other: Place, is_input: bool) -> str:
    where = f"{out.label} {out.path}"
    if Path(os.path.abspath(out.path)) != out.real:
        where += f" (which resolves to {out.real})"
    if not is_input:
        return f"{where} and {other.label} {other.path} are the same file; give each output its own path."
    if other.is_dir and other.real != out.real:
        what = f"is inside {other.label} {other.path}"
    elif out.is_dir:
        what = f"contains {other.label} {other.path}"
    else:
        what = f"is the same file as {other.label} {other.path}"
    return f"{where} {what}; writing there would destroy an input. Choose an output path outside it."


def _check_writable(out: Place) -> None:
    """The output's directory must exist (or be creatable) and take a new file; an existing
    output must be a file that opens for writing (nothing is written or truncated here)."""
    path = out.real
    if out.is_dir and path.exists() and not path.is_dir():
        raise OutputPathError(f"{out.label} {out.path}: exists and is not a directory; move it away.")
    if not out.is_dir and path.is_dir():
        raise OutputPathError(f"{out.label} {out.path}: is a directory; give a file path.")
    if not out.is_dir and path.exists():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))  # a FIFO must not block here
        except OSError as exc:
            raise OutputPathError(f"{out.label} {out.path}: cannot be written ({exc.strerror}).") from None
        return
    directory = path if out.is_dir else path.parent
    if not directory.exists():
        if not (out.is_dir or out.makedirs):
            linked = Path(os.path.abspath(out.path)) != path  # a symlink: name the directory it points into
            missing = f"{directory} (where {out.path} points)" if linked else out.path.parent
            raise OutputPathError(f"{out.label} {out.path}: the directory {missing} does not exist; "
                                  f"create it first, or choose another path.")
        directory = next(p for p in directory.parents if p.exists())
    _probe_dir(out, directory)


def _probe_dir(out: Place, directory: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise OutputPathError(f"{out.label} {out.path}: cannot write into {directory} ({exc.strerror}); "
                              f"choose a writable directory.") from None


@contextlib.contextmanager
def output_locked(label: str, path):
    """Hold an exclusive lock on an output file while the command writes it, so a second run
    given the same file is refused (two runs would truncate and interleave each other's lines).
    The file is opened without truncation; one this created and left empty is removed again.
    Yields `release`, which ends the hold early (a launcher that leaves the writing to a rank)."""
    if path is None:
        yield lambda: None
        return
    created = not os.path.lexists(path)
    try:  # O_NONBLOCK: a FIFO without a reader must not block here (it is not locked)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        raise OutputPathError(f"{label} {path}: cannot be written ({exc.strerror}).") from None
    held = [fd]

    def release():
        if held:
            os.close(held.pop())

    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OutputPathError(f"{label} {path}: another process (a `trtgraph run` still going?) is writing "
                                      f"this file; wait for it to finish, or choose another path.") from None
            except OSError:  # a file system without locks: write as before
                pass
        yield release
    finally:
        try:
            if held and created and os.fstat(fd).st_size == 0:
                os.unlink(path)
        except OSError:
            pass
        release()
