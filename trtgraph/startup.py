"""Start-up phases: where the seconds from the process's start to its exit go (`run --verbose`,
and `startup` in the summary JSON), and the bytecode cache that keeps Python's own compiling
out of every start.

One clock per process: the loader and the engine are several calls below the command, so
they lap the clock rather than carry it. `begin()` when an engine starts loading: for the
first engine of a process its phases are `interpreter` (from the process's start, as the OS
records it, to the first `import trtgraph`: Python's own start and whatever ran before; on
Linux only) and `imports` (from there to the engine's start: Python imports, and for `run`
the request file and the manifest read); for a later engine, `imports` is the time since
the last lap. `lap(name)` at the end of each phase (the loader's, the engine's, and for `run`
`serving`: requests in, results written). The phases are disjoint and add up to the total.
`first_token(seconds)` (first request in -> its first token) lies inside `serving` and is
reported beside the phases, not in their sum.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
import threading
import time


def process_age() -> float | None:
    """Seconds since this process started, from /proc (10 ms ticks); None where there is none."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


IMPORTED = time.perf_counter()  # trtgraph/__init__ imports this module first
INTERPRETER = process_age()  # the process's start to here


class StartupClock:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.first_token_seconds: float | None = None
        self.notes: list[str] = []
        self._last = IMPORTED

    def begin(self, name: str = "imports") -> None:
        """An engine starts loading: its phases start here. The time since the last lap (for
        the first engine of a process: since trtgraph was imported, after `interpreter`) is `name`.
        The program's imports are done: the collector resumes (`resume_gc`)."""
        resume_gc()
        now = time.perf_counter()
        first = self._last == IMPORTED
        self.phases = {"interpreter": INTERPRETER} if first and INTERPRETER is not None else {}
        self.phases[name] = now - self._last
        self.first_token_seconds = None
        self._last = now

    def lap(self, name: str) -> None:
        """The phase `name` ends now (a name lapped twice adds up)."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def first_token(self, seconds: float) -> None:
        """From the first request's arrival to its first token (inside `serving`, not lapped:
        requests may arrive long after start-up)."""
        if self.first_token_seconds is None:
            self.first_token_seconds = seconds

    def to_json(self) -> dict:
        phases = {k: round(v, 4) for k, v in self.phases.items()}
        out = {"phases_seconds": phases, "total_seconds": round(sum(self.phases.values()), 4)}
        if self.first_token_seconds is not None:
            out["first_token_seconds"] = round(self.first_token_seconds, 4)
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def text(self) -> str:
        """One line per phase, the largest marked, for `run --verbose`."""
        if not self.phases:
            return "start-up: no phases recorded"
        total = sum(self.phases.values())
        top = max(self.phases, key=self.phases.get)
        rows = [f"  {k:<23} {v:8.3f} s {100 * v / total if total else 0:5.1f}%{'  <- largest' if k == top else ''}"
                for k, v in self.phases.items()]
        if self.first_token_seconds is not None:
            rows.append(f"  (first_token            {self.first_token_seconds:8.3f} s: first request in -> its "
                        f"first token, inside serving)")
        head = (f"phases ({total:.3f} s in all, from the process's start"
                if "interpreter" in self.phases else f"start-up phases ({total:.3f} s in all")
        return "\n".join([head + "):", *rows, *(f"  note: {n}" for n in self.notes)])


CLOCK = StartupClock()


def begin(name: str = "imports") -> None:
    CLOCK.begin(name)


def lap(name: str) -> None:
    CLOCK.lap(name)


# ---- Python's bytecode ------------------------------------------------------------
PYCACHE_ENV = "TRTGRAPH_PYCACHE"  # off: leave Python's bytecode settings alone; a path: cache there
_OFF = ("0", "off", "no", "false")


def cache_bytecode(env=None, probe: str = "torch") -> str | None:
    """Where an environment keeps no current compiled bytecode for torch (no `__pycache__/*.pyc`
    beside its sources that matches them) and Python will not write it there (PYTHONDONTWRITEBYTECODE, or a read-only
    site-packages), every start compiles about a thousand of torch's modules from source again
    (3 s of a 4.5 s import on the H200 device's image). Then keep the bytecode under a cache
    directory instead (Python's own `sys.pycache_prefix`): $TRTGRAPH_PYCACHE if it names one,
    else $XDG_CACHE_HOME/trtgraph/pycache (~/.cache/trtgraph/pycache); the first start writes
    it, later ones read it. Call before torch is imported. Returns the directory, or None where
    nothing changed (the bytecode is there or can be written beside the sources,
    PYTHONPYCACHEPREFIX is set, TRTGRAPH_PYCACHE=off, or the directory cannot be made)."""
    env = os.environ if env is None else env
    setting = env.get(PYCACHE_ENV, "").strip()
    if setting.lower() in _OFF or sys.pycache_prefix or probe in sys.modules:
        return None
    import importlib.util

    try:
        spec = importlib.util.find_spec(probe)
    except (ImportError, ValueError):
        return None
    cached = getattr(spec, "cached", None) if spec is not None else None
    if not cached or _current(cached, spec.origin):
        return None
    if not sys.dont_write_bytecode and _can_write(os.path.dirname(cached)):
        return None  # Python writes it beside the sources on this start
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    prefix = os.path.abspath(os.path.expanduser(setting)) if setting else os.path.join(base, "trtgraph", "pycache")
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return None
    if not os.access(prefix, os.W_OK):
        return None
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    os.environ.setdefault("PYTHONPYCACHEPREFIX", prefix)  # spawned ranks read it too
    CLOCK.notes.append(f"{probe} had no compiled bytecode here and Python would not write it beside the sources; "
                       f"it is kept under {prefix} (the first start writes it; {PYCACHE_ENV}=off leaves this alone)")
    return prefix


def _current(cached: str, source: str) -> bool:
    """The .pyc exists and Python would use it: its header's source time and size match (or
    it is checked by hash, which Python does itself)."""
    try:
        with open(cached, "rb") as f:
            head = f.read(16)
        st = os.stat(source)
    except OSError:
        return False
    if len(head) < 16:
        return False
    if int.from_bytes(head[4:8], "little") != 0:  # hash-based
        return True
    return (int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)


def _can_write(directory: str) -> bool:
    """The __pycache__ directory exists and is writable, or could be made in its parent."""
    if os.path.isdir(directory):
        return os.access(directory, os.W_OK)
    return os.access(os.path.dirname(directory), os.W_OK)


# ---- CUDA's start, beside the imports ---------------------------------------------
def start_cuda_early(device: str, processes: int = 1) -> threading.Thread | None:
    """Start the CUDA driver and the device's primary context on a thread (through the
    driver's C API, which releases the GIL) while this thread imports torch: torch later
    finds the context made instead of making it (the driver's start, a few tenths of a
    second on the H200, then overlaps the imports). Only for one process on a CUDA device
    (`cuda`, `cuda:N`, or `auto`), before torch is imported; where there is no driver or
    device the thread ends quietly and torch reports it as it would have. Returns the thread
    (None where nothing was started)."""
    if processes != 1 or "torch" in sys.modules:
        return None
    name, _, index = device.partition(":")
    if name not in ("cuda", "auto") or (index and not index.isdigit()):
        return None
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return None
    thread = threading.Thread(target=_cuda_context, args=(int(index or 0),), name="trtgraph-cuda-start", daemon=True)
    thread.start()
    return thread


def _cuda_context(index: int) -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), index) == 0:
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)  # kept: torch retains the same context
    except (OSError, AttributeError):
        pass


# ---- exit -------------------------------------------------------------------------
def exit_now(code: int) -> None:
    """End the process at once: streams flushed, no interpreter or CUDA teardown (which the
    phases cannot measure). Only for a command-line process whose files are closed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_UNFREEZE_AT_EXIT: list[bool] = []
_GC_DEFERRED: list[bool] = []


def _unfreeze_at_exit() -> None:
    """Interpreter shutdown (not `exit_now`) collects as usual: what is frozen is put back first."""
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT.append(True)


def defer_gc() -> None:
    """The `trtgraph` program's imports (torch, Triton, numpy, ours: about 270,000 objects, kept
    for the process's life) run without Python's cyclic collector, which otherwise walks them
    again and again as they grow (0.2-0.36 s of a 1.5-2.8 s import on the CPU machine, about
    400 collections). `resume_gc()` (at `begin()`: a capture or an engine starts, the imports
    are done) freezes what they made and turns the collector back on. The program only
    (cli.entry): a caller that imports trtgraph as a library keeps its collector as it is."""
    if gc.isenabled():
        gc.disable()
        _GC_DEFERRED.append(True)


def resume_gc() -> None:
    """After `defer_gc()` (else nothing): what the imports made is moved out of the
    collector's generations (`gc.freeze`: never walked again; their few cycles of garbage are
    never freed, megabytes at most), then the collector runs again for what comes after. The
    collections during a capture then walk only what the capture made (h/u8's profile had
    three of 20-210 ms inside its recordings), and `freeze_heap`'s collection only what the
    engine made."""
    if _GC_DEFERRED:
        _GC_DEFERRED.clear()
        gc.freeze()
        _unfreeze_at_exit()
        gc.enable()


def freeze_heap(device) -> bool:
    """A serving process's engine is built (CUDA only): what the start made (torch, Triton, the
    model, the graphs; about 180,000 objects) lives as long as the process, so it is moved out
    of the cyclic collector's generations (`gc.freeze`, after one collection of what is garbage
    already), and a full collection while serving walks only what serving made. Without it one
    took 0.3 s over the start's objects (CPU machine), and the speculative engine's n-gram index
    makes enough long-lived objects to set them off mid-run. Put back at exit, so that
    interpreter shutdown collects as usual. Lapped as `heap_frozen`. Not on the CPU, where tests
    build hundreds of engines in one process and a frozen engine's cycles would never be freed."""
    if getattr(device, "type", None) != "cuda":
        return False
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()
    lap("heap_frozen")
    return True
