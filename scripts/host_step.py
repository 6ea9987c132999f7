"""The host's cost per decode step, phase by phase, on the static (CPU) backend: what the
CPU must do between two replays, which bounds how long the GPU idles per step (issue 14).

Captures the embedded default widened to ROWS rows (a synthetic tiny model, the CPU), serves
ROWS requests of PROMPT prompt tokens and OUT generated tokens through Engine.generate (the
offline `trtgraph run` path), and times each host phase with time.perf_counter_ns:
schedule (forming a step), ahead (extend_decode: the step launched before the last one's
tokens are read; retire_ahead / settle_ahead where they exist), prepare (launcher._prepare: host packing or the fast path's device
updates), launch (the rest of launcher.launch: copies, events, stats; the model call not
counted), model (Executor.execute: the tiny model's CPU compute, which a GPU replay
replaces; reported, not counted as host work), wait (launcher.wait: reading tokens back),
postprocess (Scheduler.postprocess), news (Engine._news: a request's output and text; timed
per call, so its timer's own cost lands in `other`), stops (the rest of Engine._drawn, or
of Engine._complete before it existed: stop strings, the loop over rows), other (the rest of
Engine.step()).

Usage: PYTHONPATH=$PWD python3 scripts/host_step.py [--rows 64 --prompt 128 --out 128 --repeats 3]
(the best of REPEATS runs per phase). --timeline N: the H200 workload's shape on the CPU (the
Llama plan's chunk 64 prefill of up to 64 rows, N requests of PROMPT/OUT tokens through
Engine.generate) with a virtual device: each step runs --decode-ms (a prefill step its tokens at
--prefill-tps) after the host launched it and the step before it ended; the host's waits (the
token read-back, the staging's upload event) advance the host's clock to when that work ends;
the tiny model's CPU time is not counted; the host's clock is its thread's CPU time, so time
the machine gave other processes is not counted either. It prints where that device would idle, by the kind of
step that waited, and before the first / after the last step: the host's critical path, measured
with this CPU's host times. On a GPU: --manifest ART --prompts FILE.jsonl runs a
captured manifest instead and reports tokens/s, step time and GPU idle per step too.
--mixed N (with --timeline or --manifest): N requests of the bench's mixed workload instead, the
idle keyed by transition (the kind of the step before -> the waiting step's kind);
--no-pipeline: the engine forms steps where the rows change only after reading the step before
them (Engine.pipeline_changes False: the A/B of Scheduler.form_ahead).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections import defaultdict

import torch

from trtgraph import startup
from trtgraph.bench import own_steps_bound
from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.launcher import StepLauncher
from trtgraph.runtime.serving.scheduler import Scheduler
from trtgraph.runtime.step.buffers import StepBuffers
from trtgraph.runtime.step.executor import Executor

PHASES = ("schedule", "ahead", "prepare", "launch", "wait", "postprocess", "stops", "news", "other", "model")
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

    wrapper.unwrapped = fn
    setattr(cls, name, wrapper)


def instrument(on: bool) -> None:
    """Time every phase (on) or restore the plain methods (off)."""
    places = ((Executor, "execute", "model", ()), (StepLauncher, "_prepare", "prepare", ()),
              (StepLauncher, "launch", "launch", ("prepare", "model")), (StepLauncher, "wait", "wait", ()),
              (Scheduler, "schedule", "schedule", ()), (Scheduler, "extend_decode", "ahead", ()),
              *((Scheduler, name, "ahead", ()) for name in ("retire_ahead", "settle_ahead") if hasattr(Scheduler, name)),
              (Scheduler, "postprocess", "postprocess", ()),
              (Engine, "_news", "news", ()),
              (Engine, "_drawn" if hasattr(Engine, "_drawn") else "_complete", "stops", ("wait", "postprocess", "news")),
              (Engine, "step", "other", tuple(p for p in PHASES if p != "other")))
    for cls, name, phase, inner in places:
        fn = getattr(cls, name)
        if on:
            timed(cls, name, phase, inner)
        elif hasattr(fn, "unwrapped"):
            setattr(cls, name, fn.unwrapped)


def phases(engine: Engine, prompts: list[dict], repeats: int) -> tuple[dict[str, float], int]:
    """µs per step per phase, the best of `repeats` runs; and the number of steps."""
    instrument(True)
    best: dict[str, float] = {}
    for _ in range(repeats):
        ns.clear()
        list(engine.generate(prompts))
        per = {p: ns[p] / engine.stats.steps / 1e3 for p in PHASES}
        best = per if not best else {p: min(best[p], per[p]) for p in PHASES}
    instrument(False)
    return best, engine.stats.steps


def report(best: dict[str, float], model_note: str) -> None:
    for p in PHASES:
        print(f"  {p:12s} {best[p]:8.1f}" + (f"   ({model_note})" if p == "model" else ""))
    print(f"  {'host total':12s} {sum(v for p, v in best.items() if p != 'model'):8.1f}")


def cpu(rows: int, prompt: int, out: int, repeats: int) -> None:
    torch.set_num_threads(1)
    d = Config.default().to_dict()
    d["device"] = "cpu"
    d["limits"].update(max_batch_size=rows, max_seq_len=prompt + out + 16, max_num_tokens=max(256, prompt))
    d["buckets"]["sampling"] = ["greedy"]
    art = tempfile.mkdtemp(prefix="host-step-")
    capture(Config.from_dict(d, source="host_step"), art)
    engine = Engine(art)
    prompts = [{"id": f"r{i}", "prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(prompt)],
                "max_tokens": out, "ignore_eos": True} for i in range(rows)]
    best, steps = phases(engine, prompts, repeats)
    print(f"{rows} rows x ({prompt} in, {out} out) greedy, {steps} steps, {engine.stats.fast_path_steps} on the "
          f"fast path; CPU (static backend) µs per step, best of {repeats}:")
    report(best, "the tiny model on the CPU; not host work")


TRACED = ((Engine, "_admit", "admit"), (Scheduler, "schedule", "schedule"), (Scheduler, "form_ahead", "form ahead"),
          (Scheduler, "extend_decode", "extend"), (Scheduler, "retire_ahead", "retire"),
          (StepLauncher, "_prepare", "prepare"), (StepLauncher, "wait", "wait"), (Scheduler, "postprocess", "postprocess"),
          (Engine, "_news", "news"))


def host_trace(log: list, mp):
    """Stamp (phase, perf_counter_ns at its start, at its end) into `log` for the host phases
    between launches (TRACED; outermost calls only) and for every collection of Python's
    garbage collector ("gc N": its generation). Returns the collector's callback (for the
    caller to remove from gc.callbacks)."""
    depth = [0]

    def wrap(fn, phase):
        def traced(*args, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    log.append((phase, t0, time.perf_counter_ns()))
        return traced

    for cls, name, phase in TRACED:
        if hasattr(cls, name):
            mp.setattr(cls, name, wrap(getattr(cls, name), phase))
    began = []

    def collected(when, info):
        if when == "start":
            began[:] = [time.perf_counter_ns()]
        elif began:
            log.append((f"gc {info['generation']}", began[0], time.perf_counter_ns()))

    gc.callbacks.append(collected)
    return collected


def host_between(log: list, a: int, b: int) -> str:
    """The host's time from a to b (perf_counter_ns) by traced phase: 'phase calls x ms'."""
    per: dict[str, list] = defaultdict(lambda: [0, 0])
    for phase, t0, t1 in log:
        if a <= t0 and t1 <= b:
            per[phase][0] += 1
            per[phase][1] += t1 - t0
    traced = sum(v[1] for v in per.values())
    return ", ".join(f"{k} {n} x {ns / 1e6:.3f} ms" for k, (n, ns) in sorted(per.items(), key=lambda kv: -kv[1][1])) \
        + f", untraced {(b - a - traced) / 1e6:.3f} ms"


def gaps(engine: Engine, prompts: list[dict], transitions: bool = False) -> None:
    """The GPU's idle time between consecutive steps (end event of one, begin event of the
    next), by the kind of the step that waited (transitions: by the kind of the step before it
    and its own): the timeline of where the device waits. Read when each step is waited for (the
    launcher's events are a ring reused a few launches later)."""
    import pytest

    per: dict[str, list[float]] = defaultdict(list)
    wait, launch, start_run = StepLauncher.wait, StepLauncher.launch, Engine.start_run
    last_end = []  # the end event of the step waited for before
    host = {}  # perf_counter: the run's start, the first launch's return, the last wait's return
    log: list = []  # host_trace's stamps
    returns: dict[int, int] = {}  # id(step) -> perf_counter_ns when its launch returned
    order: list = []  # the launched steps, in launch order
    waits: dict[int, float] = {}  # id(step) -> the device's idle before it (µs)

    def started(eng, *args, **kwargs):
        host.clear()
        start_run(eng, *args, **kwargs)
        host["start"] = eng._run_start
        host["start_ns"] = time.perf_counter_ns()

    def launched(self, step, stats):
        f = launch(self, step, stats)
        returns[id(step)] = time.perf_counter_ns()
        order.append(step)
        host.setdefault("first", time.perf_counter())
        return f

    def recorded(self, f, stats):
        out = wait(self, f, stats)  # the steps are waited for once each, in launch order
        host["last"] = time.perf_counter()
        kind = "fast" if f.step.repeats else ("prefill" if f.step.is_prefill else "full decode")
        kind += " (gathered)" if getattr(f.step, "gather", None) else ""
        kind += " (verify)" if f.step.drafts is not None else ""
        if last_end and f.events:
            per[f"{last_end[1]} -> {kind}" if transitions else kind].append(
                1e3 * last_end[0].elapsed_time(f.events[0]))
            waits[id(f.step)] = per[f"{last_end[1]} -> {kind}" if transitions else kind][-1]
        last_end[:] = [f.events[1] if f.events else None, kind]
        return out

    with pytest.MonkeyPatch.context() as mp:
        collected = host_trace(log, mp)  # (first, so that the launch and wait stamps below are outside it)
        mp.setattr(StepLauncher, "wait", recorded)
        mp.setattr(StepLauncher, "launch", launched)
        mp.setattr(Engine, "start_run", started)
        try:
            list(engine.generate(prompts, gpu_timing=True))
        finally:
            gc.callbacks.remove(collected)
    st = engine.stats
    inside = sum(sum(v) for v in per.values()) / 1e6
    if st.gpu_busy_seconds is not None:  # (CUDA: events around each step)
        print(f"GPU idle before each step, by kind (µs): "
              + "; ".join(f"{k}: {len(v)} steps, mean {sum(v) / len(v):.1f}, max {max(v):.1f}, total {sum(v) / 1e3:.2f} ms"
                          for k, v in sorted(per.items()))
              + f"; before the first and after the last step (admission, the last results): "
                f"{1e3 * (st.seconds - st.gpu_busy_seconds - inside):.2f} ms of {1e3 * st.seconds:.1f} ms "
              f"(host clock: run start to the first launch's return {1e3 * (host['first'] - host['start']):.2f} ms, "
              f"the last wait's return to the run's end {1e3 * (host['start'] + st.seconds - host['last']):.2f} ms)")
    if transitions or not order:
        return
    # The host timeline where the device waits: from the run's start to the first launch's
    # return, and for each prefill step, from the return of the launch before it to its own.
    print(f"host timeline, run start -> first launch return: {host_between(log, host['start_ns'], returns[id(order[0])])}")
    for i, step in enumerate(order[1:], start=1):
        if step.is_prefill:
            a, b = returns[id(order[i - 1])], returns[id(step)]
            print(f"host timeline, prefill step {i} (device idle before it {waits.get(id(step), float('nan')):.1f} µs;"
                  f" {(b - a) / 1e3:.0f} µs after the launch of step {i - 1}): {host_between(log, a, b)}")
    gcs = [(p, (t1 - t0) / 1e3) for p, t0, t1 in log if p.startswith("gc")]
    print(f"collections during the run: {len(gcs)}, " + ", ".join(f"{p}: {us:.0f} µs" for p, us in gcs))


CLOCK = time.thread_time_ns  # the host's clock for --timeline: this thread's CPU time (robust to a shared CPU)


class VirtualDevice:
    """A device that runs each launched step for a fixed time, in launch order, against the
    host's clock less the tiny model's CPU time (module doc: --timeline)."""

    def __init__(self, decode_ms: float, prefill_tps: float):
        self.decode_ns, self.prefill_ns_per_token = decode_ms * 1e6, 1e9 / prefill_tps
        self.skip = 0  # ns taken out of the host clock: the model's CPU time, and virtual waits
        self.end = 0.0  # when the last launched step ends on the device
        self.ends: dict[int, float] = {}  # step id -> its end
        self.steps: list = []  # every launched step (kept: their ids key `ends`)
        self.run_start = None  # the virtual time of Engine.start_run (where stats.seconds begins)
        self.upload_done = 0.0  # when the last full-path upload has left the host staging
        self.idle: dict[str, list[float]] = defaultdict(list)
        self.first_start = self.start = None
        self.transitions = False  # key the idle by (the step before's kind -> this step's kind)
        self.last_kind = "start"

    def now(self) -> float:
        return CLOCK() - self.skip

    def wait_until(self, t: float) -> None:
        self.skip -= max(0.0, t - self.now())

    def patch(self, mp) -> None:
        dev = self
        execute, launch, wait, ready, upload = (Executor.execute, StepLauncher.launch, StepLauncher.wait,
                                                StepBuffers.staging_ready, StepBuffers.upload)

        def executed(ex, key, eager=False):
            t0 = CLOCK()
            try:
                return execute(ex, key, eager)
            finally:
                dev.skip += CLOCK() - t0

        def launched(launcher, step, stats):
            f = launch(launcher, step, stats)
            t, start = dev.now(), None
            start = max(t, dev.end) if dev.ends else t
            kind = "fast" if step.repeats else ("prefill" if step.is_prefill else "full decode")
            kind += " (gathered)" if step.gather else ""
            kind += " (verify)" if step.drafts is not None else ""
            kind, dev.last_kind = (f"{dev.last_kind} -> {kind}" if dev.transitions else kind), kind
            if dev.ends:
                dev.idle[kind].append(start - dev.end)
            else:
                dev.first_start = start
            took = step.key.num_tokens * dev.prefill_ns_per_token if step.is_prefill else dev.decode_ns
            dev.end = start + took
            dev.ends[id(step)] = dev.end
            dev.steps.append(step)
            return f

        def waited(launcher, f, stats):
            dev.wait_until(dev.ends[id(f.step)])
            return wait(launcher, f, stats)

        def uploaded(buffers):
            dev.upload_done = dev.end  # the copy runs after every step launched before it
            return upload(buffers)

        def staging_ready(buffers):
            dev.wait_until(dev.upload_done)
            return ready(buffers)

        start_run = Engine.start_run

        def started(engine, *args, **kwargs):
            dev.run_start = dev.now()
            return start_run(engine, *args, **kwargs)

        mp.setattr(Engine, "start_run", started)
        mp.setattr(Executor, "execute", executed)
        mp.setattr(StepLauncher, "launch", launched)
        mp.setattr(StepLauncher, "wait", waited)
        mp.setattr(StepBuffers, "upload", uploaded)
        mp.setattr(StepBuffers, "staging_ready", staging_ready)


def timeline(n: int, prompt: int, out: int, decode_ms: float, prefill_tps: float, repeats: int,
             mixed: bool = False, pipeline: bool = True) -> None:
    """The H200 workload's step sequence on the CPU with a virtual device (module doc). mixed:
    the bench's mixed workload instead (N requests, prompts 8-1,500, outputs 16-256, a third
    sampled; the example config's chunk sizes 64, 256, 512), the idle keyed by transition."""
    import pytest

    torch.set_num_threads(1)
    d = Config.default().to_dict()
    d["device"] = "cpu"
    if mixed:
        d["limits"].update(max_batch_size=64, max_seq_len=2048, max_num_tokens=8192)
        d["buckets"].update(sampling=["greedy", "sampled"], chunk_sizes=[64, 256, 512],
                            batch_sizes=[1, 2, 4, 8, 16, 32, 48, 64], context_batch_sizes="auto")
    else:
        d["limits"].update(max_batch_size=64, max_seq_len=prompt + out + 16, max_num_tokens=4096)
        d["buckets"].update(sampling=["greedy"], chunk_sizes=[64], batch_sizes=[1, 2, 4, 8, 16, 32, 48, 64],
                            context_batch_sizes=[64])
    art = tempfile.mkdtemp(prefix="host-step-")
    capture(Config.from_dict(d, source="host_step --timeline"), art)
    engine = Engine(art)
    engine.pipeline_changes = pipeline
    if mixed:
        from trtgraph.bench import mixed_prompts

        prompts = mixed_prompts(n, engine.executor.loaded.config.vocab_size, 2048, sampled=True)
    else:
        prompts = [{"id": f"p{i}", "prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(prompt)],
                    "max_tokens": out, "ignore_eos": True} for i in range(n)]
    list(engine.generate(prompts))  # warm
    runs = []
    for _ in range(repeats):
        dev = VirtualDevice(decode_ms, prefill_tps)
        dev.transitions = mixed
        with pytest.MonkeyPatch.context() as mp:
            dev.patch(mp)
            t0 = dev.now()
            list(engine.generate(prompts))
            t1 = dev.now()
        inside = sum(sum(v) for v in dev.idle.values())
        runs.append((inside + (dev.first_start - dev.run_start) + (t1 - dev.end), dev, t0, t1))
    total, dev, t0, t1 = min(runs, key=lambda r: r[0])
    steps = len(dev.steps)
    what = "mixed (prompts 8-1500, outputs 16-256, a third sampled)" if mixed else f"({prompt} in, {out} out), greedy"
    print(f"{n} x {what}, 64 rows, {steps} steps; virtual device: decode {decode_ms} ms, "
          f"prefill {prefill_tps:.0f} tokens/s; host times of this CPU; best of {repeats}:")
    print(f"  device idle {total / 1e3 / steps:.1f} µs per step ({total / 1e6:.2f} ms in all)")
    for k, v in sorted(dev.idle.items()):
        print(f"  before {k} steps: {len(v)}, mean {sum(v) / len(v) / 1e3:.1f} µs, max {max(v) / 1e3:.1f}, "
              f"total {sum(v) / 1e6:.2f} ms" + (f" ({', '.join(f'{x / 1e3:.0f}' for x in v)})" if len(v) <= 8 else ""))
    print(f"  before the first step: {(dev.first_start - dev.run_start) / 1e6:.2f} ms (and {(dev.run_start - t0) / 1e6:.2f} "
          f"ms before the run's clock starts: parsing the requests); after the last: {(t1 - dev.end) / 1e6:.2f} ms")


def bound_lines(engine: Engine, run: dict) -> list[str]:
    """The run's tokens/s against two step-time bounds, labelled: the largest decode key it ran
    over that key's replay time in the manifest (timed at capture on padding-only inputs: no
    cached context, no prefill steps), and the bound its own steps imply (completion tokens
    over the GPU's busy time inside its steps: events around each, real context lengths)."""
    lines = []
    decode = [k for k in run.get("steps_per_key", {}) if "decode" in k]
    times = {str(r.key): r.replay_ms for r in engine.manifest.keys}
    if decode:
        key = max(decode, key=lambda k: int(k.split("bs=")[1].split(",")[0]))
        rows = int(key.split("bs=")[1].split(",")[0])
        bound = rows / (times[key] / 1e3)
        lines.append(f"step-time bound, manifest replay of {key} ({times[key]:.3f} ms, padding-only inputs): "
                     f"{bound:,.0f} tokens/s; the run reached {100 * run['tokens_per_second'] / bound:.1f}%")
    own = own_steps_bound(run)
    if own is not None:
        lines.append(f"step-time bound of the run's own steps (GPU busy {own['gpu_busy_seconds']:.3f} s in "
                     f"{own['steps']} steps): {own['bound_tokens_per_second']:,.0f} tokens/s; the run reached "
                     f"{100 * own['fraction']:.1f}%")
    return lines


def gpu(manifest: str, prompt_file: str | None, repeats: int, dump: str | None, mixed: int = 0,
        pipeline: bool = True) -> None:
    """A captured manifest on CUDA: the run's tokens/s, step time and GPU idle per step
    (gpu_timing), best of `repeats` untimed runs; then the phases (timed runs). mixed: that
    many requests of the bench's mixed workload instead of a prompt file (the idle by
    transition). pipeline False: the engine forms a rows-changing step only after reading the
    step before it (Engine.pipeline_changes: the before of this branch, same tree)."""
    engine = Engine(manifest)
    startup.freeze_heap(engine.executor.device)  # as `trtgraph run` does
    if hasattr(engine, "pipeline_changes"):
        engine.pipeline_changes = pipeline
    if mixed:
        from trtgraph.bench import mixed_prompts

        ex = engine.executor
        prompts = mixed_prompts(mixed, ex.loaded.config.vocab_size, ex.config.limits.max_seq_len,
                                sampled=any(k.sampling != "greedy" for k in ex.plan.keys))
    else:
        prompts = [json.loads(line) for line in open(prompt_file) if line.strip()]
    runs, tokens = [], None
    if not mixed:  # (mixed: the first timed run is the warm one too; its tokens are dumped)
        tokens = {r.id: r.token_ids for r in engine.generate(prompts)}
    for _ in range(repeats):
        out = {r.id: r.token_ids for r in engine.generate(prompts, gpu_timing=True)}
        tokens = tokens or out
        runs.append(engine.stats.to_json())
    if dump:
        with open(dump, "w") as f:
            json.dump(tokens, f)
    best = max(runs, key=lambda r: r["tokens_per_second"])
    keep = ("tokens_per_second", "seconds", "steps", "fast_path_steps", "gpu_idle_per_step_us", "gpu_busy_seconds",
            "completion_tokens", "padding_waste_pct", "prompt_tokens")
    print(json.dumps({k: best[k] for k in keep if k in best}))
    print("mean step ms", round(1e3 * best["seconds"] / best["steps"], 3),
          "busy ms/step", round(1e3 * best.get("gpu_busy_seconds", 0) / best["steps"], 3))
    for line in bound_lines(engine, best):
        print(line)
    gaps(engine, prompts, transitions=bool(mixed))
    if mixed:  # (no phase timing: the mixed runs are long)
        return
    ph, steps = phases(engine, prompts, repeats)
    print(f"{len(prompts)} prompts, {steps} steps; host µs per step (timed runs, best of {repeats}):")
    report(ph, "replay enqueue (and the CUDA launch)")


if __name__ == "__main__":
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--rows", type=int, default=64)
    a.add_argument("--prompt", type=int, default=128)
    a.add_argument("--out", type=int, default=128)
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--manifest", help="a captured CUDA manifest: time its run instead of the CPU tiny model")
    a.add_argument("--prompts", help="with --manifest: a JSONL of native requests")
    a.add_argument("--dump", help="with --manifest: write the first run's token ids by request id here (JSON)")
    a.add_argument("--timeline", type=int, metavar="N", help="N requests on the CPU with a virtual device")
    a.add_argument("--mixed", type=int, default=0, metavar="N",
                   help="with --timeline or --manifest: N requests of the bench's mixed workload")
    a.add_argument("--no-pipeline", action="store_true",
                   help="form rows-changing steps after reading the step before them (A/B)")
    a.add_argument("--decode-ms", type=float, default=1.457, help="with --timeline: a decode step's device time")
    a.add_argument("--prefill-tps", type=float, default=257000, help="with --timeline: prefill tokens per second")
    o = a.parse_args()
    if o.timeline:
        timeline(o.mixed or o.timeline, o.prompt, o.out, o.decode_ms, o.prefill_tps, o.repeats, bool(o.mixed),
                 not o.no_pipeline)
    elif o.manifest:
        gpu(o.manifest, o.prompts, o.repeats, o.dump, o.mixed, not o.no_pipeline)
    else:
        cpu(o.rows, o.prompt, o.out, o.repeats)
