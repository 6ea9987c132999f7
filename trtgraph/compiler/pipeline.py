"""The capture pipeline: plan -> warm up -> capture -> verify -> measure -> manifest.

1. Plan: every key the config asks for, and a proof that they cover every batch the
   scheduler may form (or a CaptureError listing the uncovered shapes).
2. Warm up: one eager run of every key, before any capture, so lazy library state and
   workspaces reach their final size; the keys that loaded a kernel or made a buffer no
   earlier key had are what a start warms (`totals.warmup_keys`, runtime/warmup.py). Each
   run is on random valid rows over a random-filled KV cache and its outputs are kept: the
   key's verification reference (no second eager run). A run leaves the cache as it found
   it, so the replay later reads the same context.
3. Capture: keys in the order of their warm-up's peak memory, largest first, all into one
   shared pool.
4. Verify: after its capture (on CUDA once the pacer launches it, 5.), each key is
   replayed on its reference's rows and compared with it (on CUDA the device runs this
   while the host records later keys).
5. Measure: a decode key's median replay time on padding-only inputs (events in bulk; 2
   runs, more where they differ by over 3%), queued after the verification; a prefill key's
   is its verification replay's (events around it: one run, on the verification's random
   valid rows; its times steer nothing, so it gets no timing runs of its own); the eager
   time is the reference's run. A key's verification and timing are read once the device has done
   them (CUDA events, asked without waiting), at the latest once LAG_KEYS later keys are
   captured and launched (further timing runs, where needed, are queued then and read as
   late again): the device works through that queue while the host records, and the host
   waits only for work LAG_KEYS keys old (the step inputs' host staging is a ring of
   slots for it: `StepBuffers.stage_slots`). A key's verification queues few small ops
   (its KV blocks of every layer copied out and back in one op each, one upload, a short
   comparison), so the queue stays below what a stream holds before a launch blocks. On
   CUDA (one process) the launches are paced (compiler/pacing.py): about AHEAD_MS of
   device work queued, the rest held back and launched as the device gets through it, so
   the long prefill keys' work (first in the order) runs beside later keys' recordings
   instead of making the host's launches wait.
6. Manifest: written atomically, only once everything above passed.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import startup
from ..artifacts import (MANIFEST_NAME, TRITON_CACHE_DIR, KeyRecord, Manifest, check_manifest_target, check_triton_cache,
                         environment, use_triton_cache, write_manifest)
from ..buckets import BucketPlan, GraphKey, uncovered_shapes
from ..config import AUTO, Config
from ..errors import CaptureError
from ..models.parallel import TPGroup
from ..runtime.distributed import agree, gather
from ..runtime.step.executor import Executor, resolve_device
from ..runtime import triton_key
from ..runtime.step.kv_cache import kv_bytes_per_block
from ..runtime.warmup import loaded_kernels
from ..models import DTYPES
from ..models.loader import position_limit
from .pacing import AHEAD_MS, KeyWork, Pacer
from .timing import MIN_REPEATS, SPIN_MS, StepTiming, VerificationTiming, launch_timing, timed_by_verification
from .verify import clear_kv_cache, eager_reference, fill_kv_cache, launch_verify

# The warm-up keeps each key's eager outputs as its verification's reference while they fit in
# this many bytes in all (the 92 keys of examples/llama-3.2-1b-synthetic.yaml: 0.4 GB); a key
# past it runs eagerly again at its verification.
REFERENCE_BYTES = 2 << 30

# A key's verification and timing are read at the latest after this many later keys are captured
# and launched (on CUDA earlier where its work is done: `_read_due`); each key's work stages at most
# 3 uploads (capture, verification, timing) and a late one (further timing runs), so a ring of
# 4 x LAG_KEYS staging slots lets no upload wait for work that recent. The long prefill keys come
# first, and the device's work on them outlasts their recordings: the lag lets the host record
# on. On the H200 the device was at most 9 keys behind with the lag at 32 (h/u8's profile,
# docs/performance.md), and the capture phase outside its recordings took 18-33 ms longer than
# with 8: the 128-slot ring's pinned allocation, presumably. 12 keeps it near what 8 took
# before the ring became one allocation (47 slots of 263 KB; 31 separate ones before).
LAG_KEYS = 12

# progress(stage, key, done, total); stage is "warmup" | "capture" | "verify"
Progress = Callable[[str, GraphKey | None, int, int], None]


@dataclass
class CaptureResult:
    manifest: Manifest
    path: Path
    executor: Executor


def capture(config: Config, out_dir: Path | None = None, device: torch.device | None = None,
            progress: Progress | None = None, timing_repeats: int | None = None,
            tp: TPGroup = TPGroup()) -> CaptureResult:
    """Capture every key of the config's plan. With tensor parallelism every rank calls this
    in lockstep; rank 0 writes the manifest."""
    startup.begin()  # the capture's phases (`capture --json`): interpreter and imports before this
    out_dir = Path(out_dir or config.output)
    progress = progress or (lambda *a: None)
    device = device or resolve_device(config.device)
    config, notes = resolve_max_seq_len(config, device, tp)
    plan = BucketPlan.from_config(config)
    check_triton_cache(out_dir / TRITON_CACHE_DIR)  # before any work: a cache a run would refuse
    check_manifest_target(out_dir / MANIFEST_NAME)  # before any work: never overwrite another tool's file
    misses = uncovered_shapes(plan)
    if misses:
        raise CaptureError(f"{config.source}: the bucket plan does not cover {'; '.join(misses)}. "
                           f"Add those sizes to buckets.batch_sizes / context_batch_sizes, or lower the limits.")
    # Before any collective: every rank must be about to capture the same keys.
    agree(tp, "the config and its bucket plan", json.dumps([config.to_dict(), [str(k) for k in plan.keys]]))
    made_dirs = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # --out a/b/c: a and b too
    made_cache = use_triton_cache(out_dir / TRITON_CACHE_DIR)
    try:
        return _capture(config, plan, out_dir, device, progress, timing_repeats, tp, notes)
    except BaseException:  # a failed or interrupted capture leaves nothing behind
        if made_cache:
            shutil.rmtree(out_dir / TRITON_CACHE_DIR, ignore_errors=True)
        for d in made_dirs:  # innermost first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise


def _capture(config: Config, plan: BucketPlan, out_dir: Path, device: torch.device | None, progress: Progress,
             timing_repeats: int | None, tp: TPGroup, notes: list[str]) -> CaptureResult:
    history = loaded_kernels()  # trtgraph's Triton kernels this process loaded before (not in a fresh one)
    try:
        ex = Executor.build(config, plan, device, tp=tp)
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        raise CaptureError(f"{config.source}: out of {_memory(exc)} loading the model and allocating the KV "
                           f"cache ({str(exc).splitlines()[0]}). No manifest was written. Set a smaller "
                           f"kv_cache.num_blocks or limits.max_seq_len / max_batch_size.") from None
    repeats = timing_repeats or (20 if device.type == "cuda" else 3)
    startup.lap("kv_cache_and_buffers")

    if ex.device.type == "cuda":
        triton_key.remember(out_dir / TRITON_CACHE_DIR)  # Triton's own key: hashed once per install
    with torch.inference_mode():
        t0 = time.perf_counter()
        fill_kv_cache(ex, seed=0)  # the verifications' rows read a random context, not zeros
        order, warm_keys, refs, eager_ms = _warm_up(ex, plan, progress, tp, history)
        warmup_seconds = time.perf_counter() - t0
        startup.lap("warm_up")
        layout = json.dumps([ex.buffers.layout(), [str(k) for k in order]])
        stats, records, timings, t1 = {}, [], [], time.perf_counter()
        ex.buffers.stage_slots(4 * LAG_KEYS)
        pending = deque()  # keys launched and not yet read, oldest first
        pacer = Pacer(AHEAD_MS if ex.device.type == "cuda" and tp.world == 1 else None)
        for i, key in enumerate(order):
            agree(tp, f"graph key {i} and the buffer layout", f"{key}|{layout}")
            stats[key] = _guard(key, "capture", lambda: ex.capture(key))
            progress("capture", key, i + 1, len(order))
            startup.lap("capture")
            # under tensor parallelism no rank may add runs the others do not (their graphs all-reduce)
            work = _key_work(ex, key, i, refs.pop(key), repeats if tp.world == 1 else MIN_REPEATS, eager_ms[key])
            pending.extend((launched, False) for launched in pacer.add(work))
            _read_due(pending, LAG_KEYS, stats, records, timings)
            startup.lap("verify_and_time")
        pending.extend((launched, False) for launched in pacer.pump(final=True))
        _read_due(pending, 0, stats, records, timings)
        ex.buffers.stage_slots(1)
        clear_kv_cache(ex)
        _sync(ex.device)
        verify_seconds = time.perf_counter() - t1 - sum(s.capture_seconds for s in stats.values())
        startup.lap("verify_and_time")

    ranks = gather(tp, {"rank": tp.rank, "device": str(ex.device),
                        "parameter_count": sum(p.numel() for p in ex.model.parameters()),
                        "kv_cache_bytes": sum(t.numel() * t.element_size() for t in ex.kv_caches)})
    manifest = _manifest(config, ex, records, warmup_seconds)
    manifest.totals["warmup_keys"] = [str(k) for k in warm_keys]
    manifest.totals["replay_timing"] = {**_timing_summary(records, timings),
                                        "verify_seconds": round(verify_seconds, 3), "keys_held_back": pacer.held_back}
    if notes:
        manifest.totals["notes"] = notes
    manifest.parallel = {"tensor_parallel_size": tp.world, "ranks": ranks}
    path = write_manifest(out_dir, manifest) if tp.rank == 0 else out_dir / "manifest.json"
    startup.lap("manifest")
    return CaptureResult(manifest, path, ex)


def resolve_max_seq_len(config: Config, device: torch.device, tp: TPGroup = TPGroup()) -> tuple[Config, list[str]]:
    """`limits.max_seq_len: auto`: the model's position limit, lowered to what the KV cache
    holds for one sequence (a fixed kv_cache.num_blocks, or free device memory). Returns the
    resolved config and a sentence for the capture summary (none when it was a number)."""
    if config.limits.max_seq_len != AUTO:
        return config, []
    limit, reason = position_limit(config.model)
    note = f"limits.max_seq_len auto = {limit} (the {reason})"
    bs, blocks = config.kv_cache.block_size, config.kv_cache.num_blocks
    if blocks == AUTO and device.type == "cuda":
        cfg = _local_model_config(config, tp)
        free, _total = torch.cuda.mem_get_info(device)
        blocks = int((free * 0.9 - (4 << 30)) // kv_bytes_per_block(cfg, bs, DTYPES[config.dtype])) + 1
    if blocks != AUTO and (blocks - 1) * bs < limit:
        limit = max(2, (blocks - 1) * bs)
        note += f", lowered to {limit}: the KV cache holds {blocks - 1} blocks of {bs} tokens for one sequence"
    dropped = [c for c in config.buckets.chunk_sizes if c > limit]
    if dropped:
        note += f"; chunk sizes {dropped} are longer and left out of the plan"
    return config.with_max_seq_len(limit), [note]


def _local_model_config(config: Config, tp: TPGroup):
    """This rank's model shapes, from config.json alone (for KV sizing before loading)."""
    from ..models.loader import model_config
    from ..models.parallel import local_config

    return local_config(model_config(config.model), tp)


def _warm_up(ex: Executor, plan: BucketPlan, progress: Progress, tp: TPGroup,
             history: int | None = 0) -> tuple[list[GraphKey], list[GraphKey], dict, dict]:
    """Run every key eagerly once, on random valid rows (seeded by its place in the warm
    order): the verification's eager reference (`verify.eager_reference`). Returns the
    capture order: largest first (by the memory its eager step peaked at), so later keys
    reuse its pool; ranks order by the largest peak any rank saw, so all capture in the same
    order. The keys a start warms, in warm order: the first, and each whose run loaded a
    Triton kernel or kept device memory that no earlier key had (on any rank) — every key where
    the process had loaded trtgraph's kernels before (`history`: their first loads go unseen).
    Each key's reference: its outputs while they fit in REFERENCE_BYTES in all, else its seed
    (the verification then runs the key eagerly again first). And each key's eager milliseconds
    (the least of the ranks'; None on the CPU): the pacer's estimate of its replays."""
    warm = sorted(plan.keys, key=lambda k: (-k.num_tokens, k))
    seen, refs, clocks, held = [], {}, [], 0  # seen, per key: (peak bytes, whether a start must warm it)
    for i, key in enumerate(warm):
        kernels = loaded_kernels()
        ref = _guard(key, "warm-up", lambda: eager_reference(ex, key, seed=i))
        now = loaded_kernels()
        seen.append((ref.peak_bytes, i == 0 or history != 0 or kernels is None or now is None or now > kernels
                     or ref.kept_bytes > 0))
        clocks.append(ref.clock)
        held += ref.nbytes
        refs[key] = ref if held <= REFERENCE_BYTES else i
        progress("warmup", key, i + 1, len(warm))
    _sync(ex.device)
    cuda = ex.device.type == "cuda"
    ranks = gather(tp, [(*s, c.ms() if cuda else None) for s, c in zip(seen, clocks)])
    peak = {k: max(r[i][0] for r in ranks) for i, k in enumerate(warm)}
    starts = [k for i, k in enumerate(warm) if any(r[i][1] for r in ranks)]
    eager_ms = {k: min(r[i][2] for r in ranks) if cuda else None for i, k in enumerate(warm)}
    return sorted(plan.keys, key=lambda k: (-peak[k], -k.num_tokens, k)), starts, refs, eager_ms


def _key_work(ex: Executor, key: GraphKey, index: int, ref, repeats: int, eager_ms: float | None) -> KeyWork:
    """The key's verification (its replay against its eager reference: a Reference, or the
    seed of one, run eagerly first) and its replay timing, for the pacer to launch; read by
    `_read_verify_and_time`. The timing: a decode key's MIN_REPEATS runs to start with (up to
    `repeats`), a prefill key's verification replay (`VerificationTiming`, no device work of
    its own). Estimated device time: the eager run's (twice for a verification that runs it
    again; a prefill key's spin besides), a decode key's timing MIN_REPEATS times it."""
    seed, reference = (ref, None) if isinstance(ref, int) else (ref.seed, ref)
    ms = eager_ms or 0.0
    verify_ms = ms if reference is not None else 2 * ms
    if timed_by_verification(key):
        time, time_ms, verify_ms = (lambda parity: VerificationTiming(parity)), 0.0, verify_ms + SPIN_MS
    else:
        time = lambda parity: _guard(key, "timing", lambda: launch_timing(ex, key, repeats, MIN_REPEATS))  # noqa: E731
        time_ms = MIN_REPEATS * ms
    return KeyWork(key, index,
                   verify=lambda: _guard(key, "verification", lambda: launch_verify(ex, key, seed, reference)),
                   time=time, verify_ms=verify_ms, time_ms=time_ms)


def _read_due(pending: deque, lag: int, stats: dict, records: list, timings: list) -> None:
    """Read the keys launched more than `lag` keys ago (all of them at lag 0), and any at the
    front whose work the device has done (`_done`: on CUDA, where a read would not wait). A key
    whose first timing runs differ by over SPREAD_OK gets its further runs queued and goes to
    the back, read as late again (at lag 0: at once). Entries: (launched, whether requeued)."""
    while pending and (len(pending) > lag or _done(pending[0][0])):
        launched, requeued = pending.popleft()
        key, replay = launched[0], launched[3]
        if lag and not requeued and not isinstance(replay, StepTiming) \
                and _guard(key, "timing", replay.queue_more):
            pending.append((launched, True))
            continue
        record, timing = _read_verify_and_time(launched, stats[key])
        records.append(record)
        timings.append(timing)


def _done(launched) -> bool:
    """The key's verification and its timing runs queued last are done: reading them would not wait."""
    parity, replay = launched[2], launched[3]
    return parity.ready() and (isinstance(replay, StepTiming) or replay.ready())


def _read_verify_and_time(launched, stats) -> tuple[KeyRecord, StepTiming]:
    """A difference fails the capture; the eager run's time is eager_ms; the replay timing is
    returned too, for its spread."""
    key, index, pending, replay = launched
    parity = _guard(key, "verification", pending.parity)
    if not parity.ok:
        raise CaptureError(f"{key}: replay differs from eager on the same inputs "
                           f"(max |logit diff| = {parity.max_abs_logit_diff:.3g}, tokens equal: "
                           f"{parity.tokens_equal}). No manifest was written.")
    if not isinstance(replay, StepTiming):
        replay = _guard(key, "timing", replay.timing)
    return KeyRecord(key=key, num_tokens=key.num_tokens, capture_index=index,
                     capture_seconds=stats.capture_seconds, pool_bytes=stats.pool_bytes,
                     replay_ms=replay.median_ms, eager_ms=parity.eager_ms,  # the reference's eager run
                     max_abs_logit_diff=parity.max_abs_logit_diff, tokens_equal=parity.tokens_equal), replay


def _timing_summary(records: list[KeyRecord], timings: list[StepTiming]) -> dict:
    """Over the keys timed by runs of their own (decode and verify keys): how many runs each
    replay time is the median of, and their spread ((slowest - fastest) / median): the median
    and the largest over the keys timed more than once; how many keys' times are their
    verification replay's (`verification_timed_keys`: the prefill keys, one run each). (With
    verify_seconds: the capture loop's wall time less its recordings: the verification and
    timing of every key, with the host's waits for the device.)"""
    own = [t for r, t in zip(records, timings) if not timed_by_verification(r.key)] or [StepTiming(0.0, 0.0, 0.0, 1)]
    spreads = sorted(t.spread for t in own if t.repeats > 1) or [0.0]
    return {"repeats_min": min(t.repeats for t in own), "repeats_max": max(t.repeats for t in own),
            "spread_median": round(spreads[len(spreads) // 2], 4), "spread_max": round(spreads[-1], 4),
            "verification_timed_keys": len(records) - sum(not timed_by_verification(r.key) for r in records)}


def _guard(key: GraphKey, stage: str, fn):
    """Name the key when memory runs out (device or host alike); nothing is written then."""
    try:
        return fn()
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        raise CaptureError(f"{key}: out of {_memory(exc)} during {stage} ({str(exc).splitlines()[0]}). "
                           f"No manifest was written. Capture a smaller plan: fewer or smaller "
                           f"buckets.batch_sizes / chunk_sizes, a lower limits.max_seq_len, or a fixed "
                           f"kv_cache.num_blocks.") from None


def out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    return (isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError))
            or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)))


def _memory(exc: BaseException) -> str:
    return "device memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else "host memory"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _linear_backends(ex: Executor) -> dict:
    """Each GEMM shape's backend (cuBLAS or the batch-invariant Triton GEMM) as the executor chose it."""
    if ex.model.ops.name != "triton":
        return {}
    from ..kernels.linear import installed_backends

    return installed_backends()


def _linear_times(ex: Executor) -> dict:
    """The times behind _linear_backends' choices, where capture timed them (us over the plan's row counts)."""
    if ex.model.ops.name != "triton":
        return {}
    from ..kernels.linear import installed_times

    return installed_times()


def _fused_ops(ex: Executor) -> dict:
    """Each fused op and weight shape: the fused decode GEMV for steps of <= FUSED_MAX_ROWS rows, or the
    composition of single ops, as the executor chose it."""
    if ex.model.ops.name != "triton":
        return {}
    from ..kernels.decode_linear import installed_choice

    return installed_choice()


def _manifest(config: Config, ex: Executor, records: list[KeyRecord], warmup_seconds: float) -> Manifest:
    pool = sum(r.pool_bytes for r in records)
    capture_s = sum(r.capture_seconds for r in records)
    block_bytes = kv_bytes_per_block(ex.model.local, ex.block_size, DTYPES[config.dtype])
    resolved = config.to_dict()
    resolved["kv_cache"]["num_blocks"] = ex.num_blocks
    return Manifest(
        environment=environment(ex.device, ex.backend),
        model=ex.loaded.fingerprint,
        config=resolved,
        kv_cache={"block_size": ex.block_size, "num_blocks": ex.num_blocks, "bytes": block_bytes * ex.num_blocks},
        buffers=ex.buffers.layout(),
        keys=sorted(records, key=lambda r: r.key),
        totals={
            "num_keys": len(records),
            "warmup_seconds": round(warmup_seconds, 4),
            "capture_seconds": round(capture_s, 4),
            "pool_bytes": pool,
            "largest_key_pool_bytes": max((r.pool_bytes for r in records), default=0),
            "linear_backends": _linear_backends(ex),
            **({"linear_times_us": t} if (t := _linear_times(ex)) else {}),
            "fused_ops": _fused_ops(ex),
        },
    )
