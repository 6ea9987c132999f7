"""`trtgraph bench`: decode step time against the memory-bandwidth floor, and peers.

For each generation batch size: the step replayed and eager, with `context_len` cached
tokens per sequence; the floor = (weight bytes + KV bytes read) / measured HBM bandwidth;
the ratio. Plus capture cost per key, paged attention alone, the Hugging Face transformers
eager baseline (when installed), end-to-end `run` tokens/s with the GPU's idle time and
against the step-time bound (batch / replay time of the run's largest decode key), a mixed
workload (prompt and output lengths drawn per request, a third sampled: padding, tokens/s)
and the engine's start-up phases.
Writes bench.md, bench.json and (with matplotlib) bench.png.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .buckets import GREEDY
from .errors import ConfigError
from .models import DTYPES
from . import startup
from .artifacts import Manifest, load_manifest
from .bench_hf import hf_baseline
from .bench_report import markdown, plot
from .bench_sync import free as _free, sync as _sync
from .runtime.serving.engine import Engine
from .runtime.step.executor import Executor, StepRow
from .runtime.step.kv_cache import blocks_for_tokens

Log = Callable[[str], None]


@dataclass
class BenchOptions:
    context_len: int = 128
    run_prompts: int = 256
    run_prompt_len: int = 128
    run_max_tokens: int = 128
    attention_batch: int = 64
    attention_context: int = 4096
    hf: bool = True
    repeats: int = 50
    prefill_lens: tuple[int, ...] = (128, 1024, 1900)
    mixed_prompts: int = 512  # the mixed workload's requests (0 skips it)


def check_options(opts: BenchOptions, limits) -> None:
    """Options the manifest's limits cannot serve are refused before any work, naming the option."""
    if opts.context_len >= limits.max_seq_len:
        raise ConfigError(f"--context-len {opts.context_len}: a decode step at that position needs "
                          f"limits.max_seq_len above it (the manifest has {limits.max_seq_len}); give at most "
                          f"{limits.max_seq_len - 1}.")
    if opts.run_prompts and opts.run_prompt_len + opts.run_max_tokens > limits.max_seq_len:
        raise ConfigError(f"--prompt-len {opts.run_prompt_len} + --max-tokens {opts.run_max_tokens} = "
                          f"{opts.run_prompt_len + opts.run_max_tokens} exceeds limits.max_seq_len "
                          f"({limits.max_seq_len}): every request would be refused. Lower them, or --prompts 0.")


def _check_context_fits(manifest, context_len: int) -> None:
    """The largest decode batch at --context-len must fit the KV cache (checked before start-up)."""
    batch = max(k.batch_size for k in manifest.graph_keys if not k.is_prefill)
    need = batch * blocks_for_tokens(context_len + 1, manifest.kv_cache["block_size"])
    have = manifest.kv_cache["num_blocks"] - 1
    if need > have:
        raise ConfigError(f"--context-len {context_len}: {batch} sequences of {context_len + 1} tokens need "
                          f"{need} KV blocks, the manifest's cache has {have}; give a smaller --context-len.")


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (bytes read + bytes written)."""
    n = (2 << 30 if device.type == "cuda" else 64 << 20) // 4
    src = torch.randn(n, device=device)  # random data, not zeros
    dst = torch.empty_like(src)
    times = [_timed(device, lambda: dst.copy_(src)) for _ in range(6)]
    return 2 * n * 4 / statistics.median(times[1:])


def _timed(device: torch.device, fn, repeats: int = 1) -> float:
    """Seconds per call of fn (CUDA events on a GPU)."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(repeats):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def decode_rows(ex: Executor, batch: int, context_len: int) -> list[StepRow]:
    """`batch` sequences with `context_len` cached tokens each, decoding their next token."""
    bs = ex.block_size
    need = blocks_for_tokens(context_len + 1, bs)
    if batch * need > ex.num_blocks - 1:
        raise ValueError(f"{batch} x {context_len} tokens do not fit {ex.num_blocks} KV blocks")
    return [StepRow(token_ids=[(17 * i + 3) % ex.loaded.config.vocab_size], start_pos=context_len,
                    block_table=list(range(1 + i * need, 1 + (i + 1) * need))) for i in range(batch)]


def decode_times(ex: Executor, opts: BenchOptions, log: Log) -> list[dict]:
    cfg = ex.loaded.config
    elt = DTYPES[ex.config.dtype].itemsize
    weight_bytes = cfg.parameter_count() * elt
    rows = []
    keys = sorted(k for k in ex.plan.keys if not k.is_prefill and k.draft_len == 0 and k.sampling == GREEDY)
    for key in keys:
        ex.prepare(key, decode_rows(ex, key.batch_size, opts.context_len))
        with torch.inference_mode():
            ex.execute(key)
            replay = statistics.median(_timed(ex.device, lambda: ex.execute(key), 10)
                                       for _ in range(max(3, opts.repeats // 10)))
            eager = statistics.median(_timed(ex.device, lambda: ex.execute(key, eager=True), 2) for _ in range(3))
        kv_bytes = key.batch_size * (opts.context_len + 1) * cfg.num_layers * 2 * cfg.kv_size * elt
        rows.append({"batch_size": key.batch_size, "replay_ms": replay * 1e3, "eager_ms": eager * 1e3,
                     "weight_bytes": weight_bytes, "kv_bytes": kv_bytes})
        log(f"decode bs={key.batch_size}: replay {replay * 1e3:.3f} ms, eager {eager * 1e3:.3f} ms")
    return rows


def attention_alone(device: torch.device, dtype: torch.dtype, cfg, opts: BenchOptions, kernels) -> dict:
    """Paged decode attention at attention_batch x attention_context, one layer."""
    B, ctx, bs = opts.attention_batch, opts.attention_context, 16
    nb = blocks_for_tokens(ctx + 1, bs)
    cache = torch.randn((2, B * nb + 1, bs, cfg.num_kv_heads, cfg.head_dim), device=device, dtype=dtype)
    tables = (torch.randperm(B * nb, device=device) + 1).view(B, nb)
    positions = torch.full((B,), ctx, dtype=torch.int64, device=device)
    q = torch.randn((B, cfg.num_heads, cfg.head_dim), device=device, dtype=dtype)
    fn = lambda: kernels.paged_attention(q, cache, tables, positions, 1, cfg.head_dim ** -0.5)  # noqa: E731
    fn()
    t = statistics.median(_timed(device, fn, 20) for _ in range(5))
    nbytes = B * (ctx + 1) * 2 * cfg.kv_size * cache.element_size()
    return {"batch_size": B, "context_len": ctx, "kernels": kernels.name, "ms": t * 1e3, "bytes": nbytes,
            "bytes_per_second": nbytes / t}


def make_prompts(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int = 0,
                 sampled: bool = False) -> list[dict]:
    """n random greedy prompts; with `sampled`, every second one of the first CROWD_PROBES is
    seeded sampled (temperature 0.8, top-p 0.95)."""
    rng = random.Random(seed)
    hi = min(vocab, 32000)
    return [{"id": f"p{i}", "prompt_token_ids": [rng.randrange(hi) for _ in range(prompt_len)],
             "max_tokens": max_tokens, **(SAMPLED_PARAMS | {"seed": i} if sampled and i < CROWD_PROBES and i % 2 else {})}
            for i in range(n)]


def mixed_prompts(n: int, vocab: int, max_seq_len: int, sampled: bool, seed: int = 0) -> list[dict]:
    """Issue 14's mixed workload: prompts of 8 to 1,500 tokens, outputs of 16 to 256 (both cut
    to fit max_seq_len), a third of the requests seeded sampled at temperature 0.8 (when the
    manifest has sampled keys)."""
    rng = random.Random(seed)
    hi, out_hi = min(vocab, 32000), min(256, max_seq_len // 4)
    prompts = []
    for i in range(n):
        out = rng.randint(min(16, out_hi), out_hi)
        length = rng.randint(min(8, max_seq_len - out), min(1500, max_seq_len - out))
        extra = SAMPLED_PARAMS | {"seed": i} if sampled and rng.random() < 1 / 3 else {}
        prompts.append({"id": f"m{i}", "prompt_token_ids": [rng.randrange(hi) for _ in range(length)],
                        "max_tokens": out, **extra})
    return prompts


def step_bound(run: dict, decode: list[dict]) -> dict | None:
    """The run's tokens/s against two step-time bounds, both kept, each labelled:
    - the top-level fields (the first figure, unchanged): the largest batch the run decoded
      at over that decode key's replay time (bench's own measurement at `context_len`
      cached tokens), which ignores the run's prefill steps and its contexts growing past
      `context_len`;
    - `own_steps` (where the run had gpu_timing): the bound the run's own steps imply, its
      completion tokens over the GPU's busy time inside its steps (CUDA events around every
      step: each key at its real context lengths, prefill steps included). Its fraction is
      the share of the run's wall time the GPU was busy."""
    batches = [int(k.split("bs=")[1].split(",")[0]) for k in run.get("steps_per_key", {}) if "decode" in k]
    rows = [d for d in decode if batches and d["batch_size"] == max(batches)]
    if not rows:
        return None
    bound = rows[0]["batch_size"] / (rows[0]["replay_ms"] / 1e3)
    out = {"batch_size": rows[0]["batch_size"], "replay_ms": rows[0]["replay_ms"], "bound_tokens_per_second": bound,
           "fraction": run["tokens_per_second"] / bound}
    own = own_steps_bound(run)
    if own is not None:
        out["own_steps"] = own
    return out


def own_steps_bound(run: dict) -> dict | None:
    """A run's completion tokens over the GPU's busy time in its own steps (`gpu_busy_seconds`,
    events around every step), and the run's tokens/s as a fraction of it; None without
    gpu_timing."""
    busy, tokens = run.get("gpu_busy_seconds"), run.get("completion_tokens")
    if not busy or not tokens or not run.get("seconds"):
        return None
    bound = tokens / busy
    return {"gpu_busy_seconds": busy, "steps": run.get("steps"), "bound_tokens_per_second": bound,
            "fraction": (tokens / run["seconds"]) / bound}


def mixed_run(engine: Engine, n: int, log: Log) -> dict:
    """The mixed workload through the engine: the run's stats (padding, tokens/s, GPU idle)."""
    ex = engine.executor
    prompts = mixed_prompts(n, ex.loaded.config.vocab_size, ex.config.limits.max_seq_len,
                            sampled=any(k.sampling != GREEDY for k in ex.plan.keys))
    list(engine.generate(prompts, gpu_timing=True))
    run = engine.stats.to_json()
    log(f"mixed: {n} requests (prompts 8-1500, outputs 16-256, a third sampled): {run['tokens_per_second']:.1f} "
        f"tokens/s, padding {run['padding_waste_pct']}%, {run['steps']} steps")
    return run


CROWD_PROBES = 16  # requests run alone and then inside the run's crowd
SAMPLED_PARAMS = {"temperature": 0.8, "top_p": 0.95}


def alone_vs_crowd(engine: Engine, prompts: list[dict], crowd_out: dict, log: Log) -> dict:
    """Each probe request served alone against its tokens inside the whole run (the same
    engine, replayed): bitwise-equal token lists count."""
    probes = prompts[:CROWD_PROBES]
    same = sum(next(iter(engine.generate([p]))).token_ids == crowd_out[p["id"]] for p in probes)
    log(f"alone vs in a crowd of {len(prompts)}: {same}/{len(probes)} requests identical "
        f"(greedy and seeded sampled)")
    return {"requests": len(probes), "crowd": len(prompts), "identical": same}


def prefill_throughput(engine: Engine, prompt_lens: tuple[int, ...], peak_flops: float, log: Log) -> list[dict]:
    """Prompt tokens/s of a burst of prompts with max_tokens 1 (prefill only), per prompt
    length, against the compute roofline 2 x parameters x tokens / peak FLOP/s."""
    cfg, lim = engine.executor.loaded.config, engine.executor.config.limits
    rows = []
    for n in prompt_lens:
        if n >= lim.max_seq_len:
            continue
        count = max(4, 4 * lim.max_num_tokens // n)
        prompts = make_prompts(count, n, 1, cfg.vocab_size, seed=n)
        list(engine.generate(prompts[:2]))  # warm the path
        t0 = time.perf_counter()
        list(engine.generate(prompts))
        _sync(engine.executor.device)
        seconds = time.perf_counter() - t0
        tokens = len(prompts) * n
        roof = 2 * cfg.parameter_count() * tokens / peak_flops
        rows.append({"prompt_len": n, "prompts": len(prompts), "tokens_per_second": tokens / seconds,
                     "over_roofline": seconds / roof})
        log(f"prefill {len(prompts)} x {n} tokens: {tokens / seconds:,.0f} tokens/s, {seconds / roof:.2f}x the "
            f"compute roofline")
    return rows


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in the model's dtype."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn((n, n), device=device, dtype=dtype)
    a @ a
    return 2 * n ** 3 / statistics.median(_timed(device, lambda: a @ a, 5) for _ in range(3))


def run_bench(artifacts: Path | Manifest, out_dir: Path, opts: BenchOptions, log: Log) -> dict:
    """Benchmark the manifest in `artifacts` (a directory, or a Manifest already loaded);
    write bench.{json,md,png} into out_dir. Every engine shares the one manifest read."""
    artifacts = load_manifest(artifacts)
    _check_context_fits(artifacts, opts.context_len)
    engine = Engine(artifacts)
    ex, manifest, device = engine.executor, engine.manifest, engine.executor.device
    started = startup.CLOCK.to_json()  # this engine's start-up phases (imports: since trtgraph was imported)
    log("measuring memory bandwidth")
    bw = measure_bandwidth(device)
    result = {"device": manifest.environment.get("device_name"), "environment": manifest.environment,
              "model": manifest.model, "context_len": opts.context_len, "hbm_bytes_per_second": bw,
              "kernels": ex.loaded.model.ops.name, "startup": started}
    rows = _against_floor(decode_times(ex, opts, log), bw)
    result["decode"] = rows
    result["keys"] = [{"key": str(k.key), "num_tokens": k.num_tokens, "capture_seconds": k.capture_seconds,
                       "pool_mib": k.pool_bytes / 2**20, "replay_ms": k.replay_ms} for k in manifest.keys]
    result["capture_totals"] = manifest.totals
    cfg = ex.loaded.config
    if opts.attention_batch and opts.attention_context:
        result["attention"] = _attention_vs_bandwidth(ex, opts, bw, log)
    prompts = make_prompts(opts.run_prompts, opts.run_prompt_len, opts.run_max_tokens, cfg.vocab_size,
                           sampled=any(k.sampling != GREEDY for k in ex.plan.keys))
    if opts.run_prompts:
        log(f"run: {len(prompts)} prompts, {opts.run_prompt_len} in, {opts.run_max_tokens} out")
        replay_out = {r.id: r.token_ids for r in engine.generate(prompts, gpu_timing=True)}
        result["run"] = engine.stats.to_json()
        result["run_bound"] = step_bound(result["run"], rows)
        log(f"run: {result['run']['tokens_per_second']:.1f} tokens/s")
        result["alone_vs_crowd"] = alone_vs_crowd(engine, prompts, replay_out, log)
        subset = prompts[:32]  # replay vs eager on the same requests, the same crowd
        replay_subset = {r.id: r.token_ids for r in engine.generate(subset)}
        peak = measure_peak_flops(device, DTYPES[ex.config.dtype])
        result["peak_flops"] = peak
        result["prefill"] = prefill_throughput(engine, opts.prefill_lens, peak, log)
        if opts.mixed_prompts:
            result["mixed"] = mixed_run(engine, opts.mixed_prompts, log)
        if engine.drafter is not None:  # the same run without speculation, on the same capture
            plain = Engine(artifacts, speculative=False)
            list(plain.generate(prompts))
            result["run_without_speculation"] = plain.stats.to_json()
            log(f"run without speculation: {result['run_without_speculation']['tokens_per_second']:.1f} tokens/s")
            del plain
        del engine
        _free(device)
        if opts.hf:
            hf = hf_baseline(ex, prompts, opts, log)
            if hf:
                hf["trtgraph_speedup"] = result["run"]["tokens_per_second"] / hf["tokens_per_second"]
                result["hf"] = hf
        result["run_tokens_identical_to_eager"] = _eager_check(artifacts, subset, replay_subset, log)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    (out_dir / "bench.md").write_text(markdown(result), encoding="utf-8")
    plot(result, out_dir / "bench.png", log)
    return result


def _against_floor(rows: list[dict], bw: float) -> list[dict]:
    """Each decode row's bandwidth floor (weights + KV read once) and its ratios."""
    for r in rows:
        r["floor_ms"] = (r["weight_bytes"] + r["kv_bytes"]) / bw * 1e3
        r["replay_over_floor"] = r["replay_ms"] / r["floor_ms"]
        r["eager_over_replay"] = r["eager_ms"] / r["replay_ms"]
    return rows


def _attention_vs_bandwidth(ex, opts: BenchOptions, bw: float, log: Log) -> dict:
    from .compiler.pipeline import out_of_memory

    try:
        att = attention_alone(ex.device, DTYPES[ex.config.dtype], ex.loaded.config, opts, ex.loaded.model.ops)
    except Exception as exc:  # its own KV cache, sized by the two options alone (not by the manifest)
        if not out_of_memory(exc):
            raise
        raise ConfigError(f"--attention-batch {opts.attention_batch} x --attention-context {opts.attention_context}: "
                          f"out of memory allocating the attention-alone timing's KV cache "
                          f"({str(exc).splitlines()[0]}). Give smaller values, or --attention-batch 0 to "
                          f"skip it.") from None
    att["fraction_of_hbm"] = att["bytes_per_second"] / bw
    log(f"attention bs={att['batch_size']} ctx={att['context_len']}: {att['ms']:.3f} ms, "
        f"{100 * att['fraction_of_hbm']:.1f}% of HBM bandwidth")
    return att


def _eager_check(artifacts: Manifest, prompts: list[dict], replay_out: dict, log: Log) -> dict:
    """Tokens of replay against the same requests run eagerly (same scheduler, same crowd)."""
    eager = Engine(artifacts, eager=True)
    got = {r.id: r.token_ids for r in eager.generate(prompts)}
    same = sum(got[p["id"]] == replay_out[p["id"]] for p in prompts)
    log(f"replay vs eager: {same}/{len(prompts)} requests identical")
    del eager
    return {"requests": len(prompts), "identical": same}
