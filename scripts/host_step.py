"""The host's cost per decode step, phase by phase, on the static (CPU) backend: what the
CPU must do between two replays, which bounds how long the GPU idles per step (issue 14).

Captures the embedded default widened to ROWS rows (a synthetic tiny model, the CPU), serves
ROWS requests of PROMPT prompt tokens and OUT generated tokens through Engine.generate (the
offline `trtgraph run` path), and times each host phase with time.perf_counter_ns:
schedule (forming a step), ahead (extend_decode: the step launched before the last one's
tokens are read), prepare (launcher._prepare: host packing or the fast path's device
updates), launch (the rest of launcher.launch: copies, events, stats; the model call not
counted), model (Executor.execute: the tiny model's CPU compute, which a GPU replay
replaces; reported, not counted as host work), wait (launcher.wait: reading tokens back),
postprocess (Scheduler.postprocess), news (the rest of Engine._complete: outputs and text),
other (the rest of Engine.step()).

Usage: PYTHONPATH=$PWD python3 scripts/host_step.py [ROWS] [PROMPT] [OUT] [REPEATS]
(64 128 128 3 by default; the best of REPEATS runs is reported per phase).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import defaultdict

import torch

from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.launcher import StepLauncher
from trtgraph.runtime.serving.scheduler import Scheduler
from trtgraph.runtime.step.executor import Executor

ROWS, PROMPT, OUT, REPEATS = (int(a) for a in (sys.argv[1:] + ["64", "128", "128", "3"][len(sys.argv) - 1:]))
PHASES = ("schedule", "ahead", "prepare", "launch", "wait", "postprocess", "news", "other", "model")
ns: dict[str, int] = defaultdict(int)


def timed(cls, name: str, phase: str, inner: tuple[str, ...] = ()):
    """Wrap cls.name so that its time goes to `phase`, less what phases in `inner` took inside it."""
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        before = sum(ns[p] for p in inner)
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            ns[phase] += time.perf_counter_ns() - t0 - (sum(ns[p] for p in inner) - before)

    setattr(cls, name, wrapper)


def main() -> None:
    torch.set_num_threads(1)
    d = Config.default().to_dict()
    d["device"] = "cpu"
    d["limits"].update(max_batch_size=ROWS, max_seq_len=PROMPT + OUT + 16, max_num_tokens=max(256, PROMPT))
    d["buckets"]["sampling"] = ["greedy"]
    out = tempfile.mkdtemp(prefix="host-step-")
    capture(Config.from_dict(d, source="host_step"), out)
    engine = Engine(out)
    timed(Executor, "execute", "model")
    timed(StepLauncher, "_prepare", "prepare")
    timed(StepLauncher, "launch", "launch", ("prepare", "model"))
    timed(StepLauncher, "wait", "wait")
    timed(Scheduler, "schedule", "schedule")
    timed(Scheduler, "extend_decode", "ahead")
    timed(Scheduler, "postprocess", "postprocess")
    timed(Engine, "_complete", "news", ("wait", "postprocess"))
    timed(Engine, "step", "other", tuple(p for p in PHASES if p != "other"))
    prompts = [{"id": f"r{i}", "prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(PROMPT)],
                "max_tokens": OUT, "ignore_eos": True} for i in range(ROWS)]
    best: dict[str, float] = {}
    for _ in range(REPEATS):
        ns.clear()
        results = list(engine.generate(prompts))
        assert all(len(r.token_ids) == OUT for r in results), [(r.finish_reason, r.error) for r in results][:2]
        steps = engine.stats.steps
        per = {p: ns[p] / steps / 1e3 for p in PHASES}
        best = per if not best else {p: min(best[p], per[p]) for p in PHASES}
    host = sum(v for p, v in best.items() if p != "model")
    print(f"{ROWS} rows x ({PROMPT} in, {OUT} out) greedy, {steps} steps, {engine.stats.fast_path_steps} on the "
          f"fast path; CPU (static backend) µs per step, best of {REPEATS}:")
    for p in PHASES:
        print(f"  {p:12s} {best[p]:8.1f}" + ("   (the tiny model on the CPU; not host work)" if p == "model" else ""))
    print(f"  {'host total':12s} {host:8.1f}")


if __name__ == "__main__":
    main()
