"""Triton's own cache key, remembered by file size and time.

Before a process launches its first Triton kernel, Triton computes `triton_key()`: a sha256
of its compiler, backend and language sources and of its whole `libtriton` library (about
500 MB), 0.4 s of every start and every capture on the H200 device. The key only changes
when those files do, so `remember(cache_dir)` keeps it in the Triton cache directory
(`trtgraph-triton-key.json`), next to the stat (size, modification time) of every file it
covers, and on a later start hands Triton that value (as Triton's own compile workers do:
`triton.runtime.cache.triton_key = lambda: key`) when the stat is unchanged. Any change in
version, file list, size or time computes it again. (An edit that restores a file's time and
size is not caught, as for checkpoint files: delete the json file to force it.)
"""

from __future__ import annotations

import json
import os
import sys

KEY_FILE = "trtgraph-triton-key.json"


def remember(cache_dir: str | os.PathLike | None) -> bool:
    """Install the remembered key (computing and saving it where it is missing or stale).
    Returns True if Triton's key now comes from the file. Does nothing without Triton loaded,
    or where this Triton has no `triton_key` (another version)."""
    if cache_dir is None or "triton" not in sys.modules:
        return False
    try:
        import triton
        import triton.runtime.cache as cache
    except ImportError:
        return False
    real = getattr(cache, "triton_key", None)
    if real is None or getattr(real, "_trtgraph", False):
        return bool(real is not None)
    root = os.path.dirname(os.path.abspath(triton.__file__))
    stamp = {"triton": getattr(triton, "__version__", "?"), "files": _stamp(root, cache.__file__)}
    path = os.path.join(os.fspath(cache_dir), KEY_FILE)
    key = None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if isinstance(saved, dict) and saved.get("stamp") == stamp and isinstance(saved.get("key"), str):
            key = saved["key"]
    except (OSError, ValueError):
        pass
    if key is None:
        key = real()
        _save(path, {"stamp": stamp, "key": key})

    def remembered():
        return key

    remembered._trtgraph = True
    cache.triton_key = remembered
    autotuner = sys.modules.get("triton.runtime.autotuner")
    if autotuner is not None and getattr(autotuner, "triton_key", None) is real:
        autotuner.triton_key = remembered
    return True


def _stamp(root: str, frontend: str) -> list:
    """[relative path, size, mtime_ns] of what triton_key reads: the frontend (runtime/cache.py),
    the compiler, backend and language Python sources, and the `_C` libraries."""
    files = [frontend]
    for sub in ("compiler", "backends", "language"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, sub)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            files += [os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".py")]
    lib = os.path.join(root, "_C")
    if os.path.isdir(lib):
        files += [os.path.join(lib, n) for n in sorted(os.listdir(lib)) if n.startswith("libtriton")]
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        out.append([os.path.relpath(f, root), st.st_size, st.st_mtime_ns])
    return out


def _save(path: str, body: dict) -> None:
    """Written atomically (ranks may start together); a cache that cannot be written keeps
    computing the key each start."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(body, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
