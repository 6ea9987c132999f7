"""Start-up phases: where the seconds before the first token go (`run --verbose`, and
`startup` in the summary JSON).

One clock per process: the loader and the engine are several calls below the command, so
they lap the clock rather than carry it. `begin()` when an engine starts loading (the time
before it, from the first `import trtgraph`, is `imports`: Python imports, and for `run` the
request file and the manifest read), `lap(name)` at the end of each phase,
`first_token(seconds)` once the first token is out. The interpreter's own start (before
`import trtgraph`) is not counted.
"""

from __future__ import annotations

import time

IMPORTED = time.perf_counter()  # trtgraph/__init__ imports this module first


class StartupClock:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = IMPORTED

    def begin(self, name: str = "imports") -> None:
        """An engine starts loading: its phases start here. The time since the last lap (for
        the first engine of a process: since trtgraph was imported) is `name`."""
        now = time.perf_counter()
        self.phases = {name: now - self._last}
        self._last = now

    def lap(self, name: str) -> None:
        """The phase `name` ends now (a name lapped twice adds up)."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def first_token(self, seconds: float) -> None:
        """From the first request's arrival to its first token (not lapped: requests may
        arrive long after start-up)."""
        self.phases.setdefault("first_token", seconds)

    def to_json(self) -> dict:
        phases = {k: round(v, 4) for k, v in self.phases.items()}
        return {"phases_seconds": phases, "total_seconds": round(sum(self.phases.values()), 4)}

    def text(self) -> str:
        """One line per phase, the largest marked, for `run --verbose`."""
        if not self.phases:
            return "start-up: no phases recorded"
        total = sum(self.phases.values())
        top = max(self.phases, key=self.phases.get)
        rows = [f"  {k:<22} {v:8.3f} s {100 * v / total if total else 0:5.1f}%{'  <- largest' if k == top else ''}"
                for k, v in self.phases.items()]
        return "\n".join([f"start-up phases ({total:.3f} s in all):", *rows])


CLOCK = StartupClock()


def begin(name: str = "imports") -> None:
    CLOCK.begin(name)


def lap(name: str) -> None:
    CLOCK.lap(name)
