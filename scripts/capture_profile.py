"""Where a capture's wall goes: `python scripts/capture_profile.py CONFIG OUT_DIR [RESULT.json]`.

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
ring (what a tree lacks is not patched)."""

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

from trtgraph.compiler import pipeline, verify
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


def main(config_path: str, out_dir: str, result: str | None) -> None:
    per_key_stages()
    gc_pauses()
    timed(graph_runner.GraphRunner, "replay", lambda s: f"graph_launch[{s}]")
    timed(buffers.StepBuffers, "staging_ready", lambda s: f"staging_wait[{s}]")
    timed(graph_runner.GraphRunner, "_capture_cuda", "recording")
    timed(Executor, "capture", "capture_call (recording + C staging)", "C")
    timed(pipeline, "launch_verify", "launch_verify (V)", "V")
    timed(pipeline, "launch_timing", "launch_timing (T)", "T")
    timed(verify.KeptBlocks, "__init__", lambda s: f"kv_block_copies[{s}]")
    timed(verify.PendingParity, "parity", "read_parity")
    timed(verify.PendingTiming, "queue_more", "read_timing_first / queue_more", "X")
    timed(verify.PendingTiming, "timing", "read_timing", "X")
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
                        "keys captured at its verification's launch, at its timing's launch", *per_key]}
    print(json.dumps(body, indent=1))
    if result:
        Path(result).write_text(json.dumps(body, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
