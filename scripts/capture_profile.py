"""Where a capture's wall goes: `python scripts/capture_profile.py CONFIG OUT_DIR [RESULT.json] [--calls]
[--timing-check] [--hold]`.

Runs `trtgraph capture` in this process (its phases as `capture --json` reports them) with
the host's time split by what it did in the capture loop: recording (the graph runner's
capture), waiting for the host staging of the step inputs (`StepBuffers.staging_ready`, by
the stage that asked: the capture's own padding upload C, the verification V, the timing T,
a timing's further runs X, a warm-up run W), waiting to read a verification or a timing (the
events' synchronize), the KV block copies of each verification, and the rest; and per key
(capture order) how many earlier keys' verifications the device had not finished when its
capture began, with the host ms of its recording and launches and how far it grew the pool.
Also (h/u8): the graph launches by stage, Python's garbage collections by generation and
stage, and each timed call split by whether the caching allocator took new device memory
during it ("+reserve"). h/u9: how many keys were captured when each key's verification and
timing were launched (the pacer holds them back while the device is behind), and the imports
run without the collector as the program's do. Works on trees before and after the staging
ring (what a tree lacks is not patched).

h/u10 (issue 14's recordings that stall at fixed keys): each recording split into its input
upload (`prepare`), `capture_begin`, the step's ops and `capture_end` (the graph's
instantiation), with whether the device's stream was idle before and after it (`recordings`);
`--calls`: every Python or C call over 2 ms inside a recording over 15 ms (sys.setprofile,
recordings only: it slows them; use apart from the timed figures); `--timing-check`: after the
capture, each prefill key's manifest replay_ms (tenth session: its verification replay, the
graph's first launch) against 3 later replays on the same rows (the verification's, from its
seed) and against the median of 2 on padding-only inputs (what replay_ms was before);
`--hold`: the pacer launches nothing before the last recording (the device idle while the
host records: a recording that stalls only while the device works waits for the device).
Since the thirteenth session the runner records through the driver (runtime/step/cuda_graph.py),
not torch.cuda.CUDAGraph: a recording's `capture_begin` / `capture_end` parts are then absent
(within `recording` and `step`)."""

from __future__ import annotations

from trtgraph import startup  # noqa: E402  (first: the program's imports run without the collector, h/u9)

getattr(startup, "defer_gc", lambda: None)()  # as `trtgraph capture` does (trees before h/u9: nothing)

import gc  # noqa: E402
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from trtgraph.compiler import pipeline, timing, verify
from trtgraph.config import Config
from trtgraph.runtime.step import buffers, graph_runner
from trtgraph.runtime.step.executor import Executor

seconds: dict = defaultdict(float)
counts: dict = defaultdict(int)
stage = ["W"]


def _reserved() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else 0


def timed(owner, name: str, label, set_stage: str | None = None) -> None:
    """Wrap owner.name: its host seconds go to label (a string, or a function of the stage);
    a call during which the caching allocator reserved more device memory (a new segment from
    the driver) goes to "label +reserve" instead."""
    real = getattr(owner, name, None)
    if real is None:
        return

    def wrapper(*args, **kwargs):
        before = stage[0]
        if set_stage:
            stage[0] = set_stage
        r0, t0 = _reserved(), time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            key = label if isinstance(label, str) else label(stage[0])
            key += " +reserve" if _reserved() > r0 else ""
            seconds[key] += time.perf_counter() - t0
            counts[key] += 1
            if set_stage:
                stage[0] = before

    setattr(owner, name, wrapper)


per_key: list = []  # capture order: [key, queued behind, recording ms, launch verify ms, launch timing ms, pool MB,
#                      keys captured when its verification / its timing was launched (h/u9: the pacer may hold them back)]
row_of: dict = {}  # key -> its row in per_key
gc_pause: list = [0.0]  # when the running collection began
launched: list = []  # every PendingParity launched, for how many the device has not finished


def per_key_stages() -> None:
    """Per key: how many earlier keys' verifications the device had not finished when its
    capture began (the device behind the host), and the host ms of its recording and launches."""
    capture, launch_verify, launch_timing = Executor.capture, pipeline.launch_verify, pipeline.launch_timing

    def captured(ex, key):
        behind = sum(1 for p in launched if p._done is not None and not p._done.query())
        t0 = time.perf_counter()
        out = capture(ex, key)
        row_of[key] = len(per_key)
        per_key.append([str(key), behind, round((time.perf_counter() - t0) * 1e3, 3), 0.0, 0.0,
                        round(out.pool_bytes / 2**20, 1), None, None])
        return out

    def verified(ex, key, *args, **kwargs):
        t0 = time.perf_counter()
        p = launch_verify(ex, key, *args, **kwargs)
        launched.append(p)
        row = per_key[row_of[key]]
        row[3], row[6] = round((time.perf_counter() - t0) * 1e3, 3), len(per_key)
        return p

    def timed_replay(ex, key, *args, **kwargs):
        t0 = time.perf_counter()
        out = launch_timing(ex, key, *args, **kwargs)
        row = per_key[row_of[key]]
        row[4], row[7] = round((time.perf_counter() - t0) * 1e3, 3), len(per_key)
        return out

    Executor.capture, pipeline.launch_verify, pipeline.launch_timing = captured, verified, timed_replay


def gc_pauses() -> None:
    """Python's garbage collections, by generation and stage: their host seconds."""
    def callback(phase, info):
        if phase == "start":
            gc_pause[0] = time.perf_counter()
        else:
            label = f"gc_gen{info['generation']}[{stage[0]}]"
            seconds[label] += time.perf_counter() - gc_pause[0]
            counts[label] += 1

    gc.callbacks.append(callback)


recordings: list = []  # per recording: key, ms of its parts and of all, whether the stream was idle before / after
long_calls: dict = {}  # key -> [(depth, name, ms)] of the calls over 2 ms in a recording over 15 ms (--calls)


def recording_parts(calls: bool) -> None:
    """Each recording split by its parts (Executor.capture: prepare, then the runner's
    capture_begin, the step, capture_end), the stream's idleness around it, and (calls) the
    long calls inside it."""
    capture, prepare = Executor.capture, Executor.prepare
    begin, end = torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end
    now: list = [None]  # the recording under way: its parts' ms, and when its step began

    def part(name, t0):
        if now[0] is not None:
            now[0][name] = now[0].get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def prepared(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return prepare(self, *args, **kwargs)
        finally:
            part("prepare", t0)

    def began(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return begin(self, *args, **kwargs)
        finally:
            part("capture_begin", t0)
            if now[0] is not None:
                now[0]["_step0"] = time.perf_counter()

    def ended(self, *args, **kwargs):
        t0 = time.perf_counter()
        if now[0] is not None and "_step0" in now[0]:
            now[0]["step"] = (t0 - now[0].pop("_step0")) * 1e3
        try:
            return end(self, *args, **kwargs)
        finally:
            part("capture_end", t0)

    def captured(self, key):
        idle_before = torch.cuda.current_stream().query() if torch.cuda.is_available() else None
        now[0], found, depth = {}, [], [0]
        stack: list = []

        def hook(frame, event, arg):
            if event in ("call", "c_call"):
                stack.append(time.perf_counter())
            elif event in ("return", "c_return", "c_exception") and stack:
                ms = (time.perf_counter() - stack.pop()) * 1e3
                if ms > 2.0:
                    name = (getattr(arg, "__qualname__", None) or repr(arg)) if event != "return" else \
                        f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_code.co_firstlineno})"
                    found.append((len(stack), name, round(ms, 3)))

        t0 = time.perf_counter()
        if calls:
            sys.setprofile(hook)
        try:
            return capture(self, key)
        finally:
            if calls:
                sys.setprofile(None)
            total = (time.perf_counter() - t0) * 1e3
            parts = {k: round(v, 3) for k, v in now[0].items() if not k.startswith("_")}
            now[0] = None
            idle_after = torch.cuda.current_stream().query() if torch.cuda.is_available() else None
            recordings.append([str(key), parts, round(total, 3), idle_before, idle_after])
            if calls and total > 15.0:
                long_calls[str(key)] = found[-40:]

    Executor.capture, Executor.prepare = captured, prepared
    torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end = began, ended


def timing_check(res) -> list:
    """Each prefill key: [key, manifest replay_ms, median of 3 later replays on its verification's
    rows (from its seed; each behind the same spin as the capture's), median of 2 on padding]."""
    ex = res.executor
    warm = sorted(ex.plan.keys, key=lambda k: (-k.num_tokens, k))
    recorded = {r.key: r.replay_ms for r in res.manifest.keys}
    spin = getattr(timing, "SPIN_CYCLES", 2_000_000)
    out = []
    with torch.inference_mode():
        for i, key in enumerate(warm):
            if not key.is_prefill:
                continue
            ex.prepare(key, verify.random_rows(ex, key, torch.Generator().manual_seed(i)))
            times = []
            for _ in range(3):
                torch.cuda._sleep(spin)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                ex.execute(key)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            padding = timing.time_step(ex, key, eager=False, repeats=2)
            out.append([str(key), recorded[key], round(sorted(times)[1], 4), round(padding.median_ms, 4)])
    return out


def main(config_path: str, out_dir: str, result: str | None, calls: bool = False, check: bool = False,
         hold: bool = False) -> None:
    if hold:
        from trtgraph.compiler import pacing

        pipeline.Pacer = lambda ahead_ms: pacing.Pacer(None if ahead_ms is None else 0.0)
    per_key_stages()
    recording_parts(calls)
    gc_pauses()
    timed(graph_runner.GraphRunner, "replay", lambda s: f"graph_launch[{s}]")
    timed(buffers.StepBuffers, "staging_ready", lambda s: f"staging_wait[{s}]")
    timed(graph_runner.GraphRunner, "_capture_cuda", "recording")
    timed(Executor, "capture", "capture_call (recording + C staging)", "C")
    timed(pipeline, "launch_verify", "launch_verify (V)", "V")
    timed(pipeline, "launch_timing", "launch_timing (T)", "T")
    timed(verify.KeptBlocks, "__init__", lambda s: f"kv_block_copies[{s}]")
    timed(Executor, "prepare", lambda s: f"prepare[{s}]")  # h/u10: the inputs' packing and upload, by stage
    timed(verify.PendingParity, "parity", "read_parity")
    timed(timing.PendingTiming, "queue_more", "read_timing_first / queue_more", "X")
    timed(timing.PendingTiming, "timing", "read_timing", "X")
    timed(torch.cuda, "synchronize", "cuda_synchronize")
    startup.begin()
    t0 = time.perf_counter()
    config = Config.from_yaml(config_path) if config_path != "default" else Config.default().replace(device="cpu")
    res = pipeline.capture(config, Path(out_dir))
    wall = time.perf_counter() - t0
    t = res.manifest.totals
    body = {"wall_in_capture_s": round(wall, 3), "warmup_seconds": t["warmup_seconds"],
            "capture_seconds": t["capture_seconds"], "replay_timing": t["replay_timing"],
            "phases": startup.CLOCK.to_json()["phases_seconds"],
            "host_seconds": {k: round(v, 4) for k, v in sorted(seconds.items())}, "calls": dict(counts),
            "per_key": ["key, verifications queued behind, recording ms, launch verify ms, launch timing ms, pool MB, "
                        "keys captured at its verification's launch, at its timing's launch", *per_key],
            "recordings": ["key, parts ms (prepare, capture_begin, step, capture_end), all ms, stream idle before, "
                           "after", *recordings]}
    if calls:
        body["long_calls"] = long_calls
    if check and torch.cuda.is_available():
        body["timing_check"] = ["key, manifest replay_ms, verification rows (3 later replays, median), "
                                "padding (2, median)", *timing_check(res)]
    print(json.dumps(body, indent=1))
    if result:
        Path(result).write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0], args[1], args[2] if len(args) > 2 else None, "--calls" in flags, "--timing-check" in flags,
         "--hold" in flags)
