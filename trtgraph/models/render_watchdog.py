"""The chat template's render deadline (models/chat_bounds.py's `render_bounded`): one daemon thread
raises `Expired` in a rendering thread whose deadline has passed."""

from __future__ import annotations

import ctypes
import threading
import time


class Expired(BaseException):
    """What the watchdog raises in a rendering thread: a BaseException, so that no `except Exception`
    on the way (jinja2's `is sequence` test, its getitem's fallbacks) swallows it and lets the render
    run on with no deadline left; render_bounded turns it into RenderTimeout."""


class _Watchdog:
    """One daemon thread for every render under way: at a render's deadline it raises Expired
    (RenderTimeout once out of the render) in the rendering thread (PyThreadState_SetAsyncExc:
    delivered at that thread's next bytecode, so a template's loop stops there; a single long C
    call ends first, and the size bounds keep those short). Costs a render nothing but its
    registration: no trace function."""

    def __init__(self):
        self._lock = threading.Lock()  # rendering threads take this one: its __enter__ is C, so the exception cannot
        #   land between taking it and the `with` that releases it (Condition.__enter__ is Python: it did, and
        #   the lock stayed held for good, every later render and the watchdog waiting on it)
        self._cond = threading.Condition(self._lock)  # the watchdog's, which no exception is raised in
        self._renders: dict[int, tuple[int, float]] = {}  # token -> (thread id, deadline)
        self._next = 0
        self._thread: threading.Thread | None = None

    def begin(self, seconds: float) -> int:
        with self._lock:
            self._next += 1
            self._renders[self._next] = (threading.get_ident(), time.monotonic() + seconds)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trtgraph-chat-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def end(self, token: int) -> None:
        """The render is over. If its deadline fired, the watchdog's Expired was raised in this thread:
        delivered already (the render stopped), or still pending (it ended at its deadline), and then it
        is delivered here, for render_bounded to turn into RenderTimeout. Not cleared with
        PyThreadState_SetAsyncExc(NULL): on CPython 3.11 that leaves the eval loop's pending flag set
        for good — every later check takes the slow path, and any later profile or trace function
        (a profiler, a debugger, coverage) spins at its next call."""
        with self._lock:  # the watchdog removes an entry and raises in its thread under this lock too
            fired = self._renders.pop(token, None) is None
        if fired:
            for _ in range(2):  # a backward jump: the eval loop delivers a pending exception here
                pass

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for token, (tid, deadline) in list(self._renders.items()):
                    if deadline <= now:
                        del self._renders[token]
                        _set_async_exc(tid, Expired)
                soonest = min((d for _, d in self._renders.values()), default=None)
                self._cond.wait(None if soonest is None else max(soonest - now, 0.001))


def _set_async_exc(thread_id: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))


WATCHDOG = _Watchdog()
