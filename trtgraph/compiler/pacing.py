"""When the capture launches each key's verification and timing (CUDA, one process).

The capture records keys largest first, and the device's work for the first ones (a long
prefill key's verification replay: up to 20-50 ms against the host's 10 ms to record it, with
its timing run before the tenth session) outlasts their recordings: launched at once, that
work piles up behind the host, and the host's launches then wait on the device (h/u8's
profile, docs/performance.md: 10-50 ms per timing launch over the first 22 keys, the device
3-9 keys behind), while later, over the decode keys, the device idles as the host records.
The pacer keeps about AHEAD_MS of estimated device work queued and holds the rest back,
launched as the device gets through what is queued, so the head's work runs beside the
recordings of the keys after it. A key's timing is launched only once its verification is
done (a graph's second launch then never follows a first launch still queued), and never
before an earlier key's.

Unpaced (`ahead_ms=None`: the CPU, where every launch runs at once, and tensor parallelism,
where every rank must launch the same replays in the same order), a key's verification and
timing are launched at once, one after the other, as before."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

# The device work kept queued ahead of the host, in estimated milliseconds (the keys' eager
# times from the warm-up): more than a recording takes (about 10 ms), well under what made
# the launches wait in h/u8's profile (about 100 ms queued).
AHEAD_MS = 40.0


@dataclass
class KeyWork:
    """A captured key's verification and timing, to launch: `verify()` returns what has
    `ready()` (its device work done, asked without waiting), `time(parity)` likewise; the
    estimated device milliseconds of each."""
    key: Any
    index: int
    verify: Callable[[], Any]
    time: Callable[[Any], Any]
    verify_ms: float = 0.0
    time_ms: float = 0.0
    parity: Any = None


class Pacer:
    def __init__(self, ahead_ms: float | None = AHEAD_MS):
        self.ahead_ms = ahead_ms
        self._waiting: deque[KeyWork] = deque()  # captured, nothing launched
        self._verifying: deque[KeyWork] = deque()  # its verification launched, its timing not
        self._in_flight: deque[tuple[Any, float]] = deque()  # (launched, estimated ms), in launch order
        self.held_back = 0  # the most captured keys at once with nothing launched (the manifest's keys_held_back)

    def add(self, work: KeyWork) -> list[tuple]:
        """A key was captured: launch what the queue has room for. Returns the keys whose
        timing was launched, (key, index, parity, timing) each, in capture order."""
        self._waiting.append(work)
        out = self.pump()
        self.held_back = max(self.held_back, len(self._waiting))
        return out

    def pump(self, final: bool = False) -> list[tuple]:
        """Launch timings whose verification is done, then verifications, while the queued
        device work is under `ahead_ms` (unpaced: everything, each key's timing right after
        its verification). `final` (after the last capture): everything left, verifications
        first, so the device is never short of work while a timing launch waits."""
        out = []
        if final:
            while self._waiting:
                self._launch_verify(self._waiting.popleft())
            while self._verifying:
                out.append(self._launch_time(self._verifying.popleft()))
            return out
        paced = self.ahead_ms is not None
        while True:
            if self._verifying and (not paced or (self._verifying[0].parity.ready() and self._room())):
                out.append(self._launch_time(self._verifying.popleft()))
            elif self._waiting and (not paced or self._room()):
                self._launch_verify(self._waiting.popleft())
            else:
                return out

    @property
    def pending(self) -> int:
        """Keys whose timing is not launched yet."""
        return len(self._waiting) + len(self._verifying)

    def _room(self) -> bool:
        """Less than ahead_ms of launched work is not done (one stream: it finishes in launch order)."""
        while self._in_flight and self._in_flight[0][0].ready():
            self._in_flight.popleft()
        return sum(ms for _, ms in self._in_flight) < self.ahead_ms

    def _launch_verify(self, work: KeyWork) -> None:
        work.parity = work.verify()
        self._verifying.append(work)
        if self.ahead_ms is not None:
            self._in_flight.append((work.parity, work.verify_ms))

    def _launch_time(self, work: KeyWork) -> tuple:
        replay = work.time(work.parity)
        if self.ahead_ms is not None and hasattr(replay, "ready"):  # a PendingTiming (not a StepTiming: done)
            self._in_flight.append((replay, work.time_ms))
        return work.key, work.index, work.parity, replay
