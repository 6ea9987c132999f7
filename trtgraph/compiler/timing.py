"""Step timing for the capture: a key's replay time in milliseconds. A decode (or verify) key's
is the median of timing runs on padding-only inputs (the speculation policy reads these),
launched and read later (`launch_timing`, `PendingTiming`) so the host's launches overlap the
device's runs; a prefill key's is its verification replay's (`VerificationTiming`: one run, on
the verification's random valid rows; compiler/verify.py times it), timed by no runs of its own."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..buckets import GraphKey
from ..runtime.step.executor import Executor

# Step timing (CUDA): MIN_REPEATS runs of a decode key; where they differ by more than SPREAD_OK
# of their median, more while they fit in TIMING_BUDGET_MS.
MIN_REPEATS = 2
SPREAD_OK = 0.03
TIMING_BUDGET_MS = 25.0
# Before a timed replay (a prefill key's verification, a decode key's timing runs; CUDA), the
# device spins this many clock cycles (about 1 ms on the H200) while the host makes the
# replay's checks and launches its graph (0.15-0.4 ms each, h/u9's profile), so that the start
# event passes when the graph can start, not earlier: the host's launch is then not in the
# time. Without it, on a device that waits for the host, a decode key's first timing run held
# the launch's gap (h/u10's call: spread median 0.01-0.07, 20 runs, against 0.005 and 2).
SPIN_CYCLES = 2_000_000
SPIN_MS = 1.0  # what the spin takes at the H200's 1.98 GHz: the pacer's estimate of it


def _spin(device: torch.device) -> None:
    """On CUDA, SPIN_CYCLES of device work ahead of a timed launch (see SPIN_CYCLES)."""
    if device.type == "cuda" and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(SPIN_CYCLES)


def timed_by_verification(key: GraphKey) -> bool:
    """Whether `key`'s replay time is its verification replay's (prefill keys: nothing reads
    their times to decide anything) rather than timing runs of its own on padding-only inputs
    (decode and verify keys: the speculation policy reads theirs)."""
    return key.is_prefill


class VerificationTiming:
    """A prefill key's replay time: its verification replay (`PendingParity.replay_clock`: the
    graph's first launch, on the verification's random valid rows, one run), read once the
    verification is done. Shaped like a `PendingTiming` for the capture loop: `ready()`,
    `queue_more()` (never more runs) and `timing()`."""

    def __init__(self, parity: PendingParity):
        self.parity = parity

    def ready(self) -> bool:
        return self.parity.ready()

    def queue_more(self) -> bool:
        return False

    def timing(self) -> StepTiming:
        clock = self.parity.replay_clock
        if clock.cuda:
            clock.end.synchronize()
        ms = clock.ms()
        return StepTiming(ms, ms, ms, 1)


class _StepClock:
    """Milliseconds from construction to stop(): CUDA events (read once the device has passed
    the second), or the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        return self.start.elapsed_time(self.end) if self.cuda else (self.t1 - self.t0) * 1e3


@dataclass
class StepTiming:
    """Milliseconds of one step over `repeats` runs: the median (what the manifest records),
    and the fastest and slowest run (the spread)."""
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms > 0 else 0.0


def time_step(ex: Executor, key: GraphKey, eager: bool, repeats: int, budget_ms: float = TIMING_BUDGET_MS,
              least: int = MIN_REPEATS) -> StepTiming:
    """One step (replay or eager) on padding-only inputs, timed. No warm-up run: the key has
    run eagerly (warm-up, verification) and been replayed (verification) before. On CUDA the
    runs go back to back, each between two events, read after one synchronisation per batch
    (see PendingTiming); on the CPU, `repeats` runs by the host clock."""
    if ex.device.type != "cuda":
        ex.prepare(key, [])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ex.execute(key, eager=eager)
            times.append((time.perf_counter() - t0) * 1e3)
        return _timing(times)
    return PendingTiming(ex, key, eager, repeats, budget_ms, least).timing()


class PendingTiming:
    """A CUDA step timing launched: `least` runs queued back to back, each between two events;
    `timing()` waits for them alone (not for work launched after them) and reads them. Where
    their spread ((slowest - fastest) / median) is within SPREAD_OK, that is the timing;
    else as many more runs (up to `repeats` in all) as fit in `budget_ms` at their median, so
    a noisy 0.2 ms decode key runs up to `repeats` times and a steady 40 ms prefill key `least`."""

    def __init__(self, ex: Executor, key: GraphKey, eager: bool, repeats: int,
                 budget_ms: float = TIMING_BUDGET_MS, least: int = MIN_REPEATS):
        self.ex, self.key, self.eager, self.repeats, self.budget_ms = ex, key, eager, repeats, budget_ms
        self.least = max(1, min(least, repeats))
        ex.prepare(key, [])
        self._events = self._launch(self.least)
        self._times: list[float] | None = None  # the first runs' times, once read
        self._more: list = []  # the events of the runs queued by queue_more()

    def _launch(self, n: int) -> list:
        """n runs back to back, n + 1 events: run i lies between events i and i + 1."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        _spin(self.ex.device)  # the runs go back to back on the device, not at the host's pace
        events[0].record()
        for end in events[1:]:
            self.ex.execute(self.key, eager=self.eager)
            end.record()
        return events

    def ready(self) -> bool:
        """The runs queued last (the first ones, or the further ones) have passed their last
        event: reading them would not wait."""
        return (self._more or self._events)[-1].query()

    def queue_more(self) -> bool:
        """Read the first runs (waiting for them alone); where their spread is over SPREAD_OK,
        queue the further runs without waiting for them and return True (`timing()` reads them)."""
        if self._times is None:
            self._times = _read(self._events)
            first = _timing(self._times)
            done = len(self._times)
            more = min(self.repeats - done, int(self.budget_ms / max(first.median_ms, 1e-3)) - done)
            if first.spread > SPREAD_OK and more > 0:
                self.ex.prepare(self.key, [])  # other keys may have run since
                self._more = self._launch(more)
        return bool(self._more)

    def timing(self) -> StepTiming:
        self.queue_more()
        return _timing(self._times + (_read(self._more) if self._more else []))


def launch_timing(ex: Executor, key: GraphKey, repeats: int, least: int = MIN_REPEATS) -> "PendingTiming | StepTiming":
    """The replay timing of `key`: launched (CUDA: read later by `.timing()`) or, on the CPU, done."""
    if ex.device.type == "cuda":
        return PendingTiming(ex, key, eager=False, repeats=repeats, least=least)
    return time_step(ex, key, eager=False, repeats=repeats)


def _read(events: list) -> list[float]:
    events[-1].synchronize()
    return [start.elapsed_time(end) for start, end in zip(events, events[1:])]


def _timing(times: list[float]) -> StepTiming:
    return StepTiming(statistics.median(times), min(times), max(times), len(times))
