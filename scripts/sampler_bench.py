"""Sampled vs greedy decode steps on the GPU (Llama-3.2-1B shapes, synthetic bf16 weights),
and the sampler alone against the sort-based sampler it replaced.

Usage: python scripts/sampler_bench.py [CONFIG]  (default examples/llama-3.2-1b-synthetic.yaml)
       python scripts/sampler_bench.py --alone  (the sampler's kernels alone, no model)
       python scripts/sampler_bench.py --sweep  (the draw under other chunkings and search widths)
       python scripts/sampler_bench.py --steps-only [CONFIG]  (the decode steps alone)
Prints a markdown table: replayed step times (CUDA events, median) per batch size for greedy
rows on the greedy key, and on the sampled key with temperature only, top-k + top-p, and
every processor (min_p, penalties, 300 logit_bias entries, min_tokens, logprobs 20); then the
sampler's kernels alone at the Llama-3 vocabulary (argmax, the draw's filter mixes, top-p alone
on peaked and near-flat rows, logprobs 20), each in a CUDA graph, with a per-kernel profile.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from trtgraph.bench import _timed, decode_rows
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.config import Config
from trtgraph.kernels import sampler_reference as sampler
from trtgraph.runtime.step.executor import Executor

BATCHES = (1, 8, 64)
SETTINGS = {
    "T=0 rows": dict(temperature=0.0),
    "T=0.8": dict(temperature=0.8),
    "T=0.8 top-k 50 top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "every processor": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, processors=True,
                            repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                            eos_until=10**9, logprobs=True),
}


def sort_sampler(logits, temperature, top_k, top_p, seeds, positions):
    """The sampler before this change (commit 38e516f): a full sort, a cumulative sum."""
    R, V = logits.shape
    is_greedy = temperature <= 0
    temp = torch.where(is_greedy, torch.ones_like(temperature), temperature.clamp_min(1e-6))
    sorted_logits, sorted_ids = (logits / temp.unsqueeze(1)).sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device).unsqueeze(0)
    k = torch.where((top_k <= 0) | (top_k > V), torch.full_like(top_k, V), top_k)
    drop = rank >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop = drop | (probs.cumsum(dim=-1) - probs > top_p.unsqueeze(1))
    from trtgraph.kernels.triton_ops import gumbel_noise

    gumbel = gumbel_noise(sampler.row_hash(seeds, positions), sorted_ids)
    choice = (sorted_logits + gumbel).masked_fill(drop, float("-inf")).argmax(dim=-1, keepdim=True)
    return torch.where(is_greedy, logits.argmax(dim=-1), sorted_ids.gather(1, choice).squeeze(1))


def graph_time(fn) -> float:
    """ms per replay of fn recorded into a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return 1e3 * statistics.median(_timed(torch.device("cuda"), g.replay, 20) for _ in range(5))


def _cases(bs: int, V: int):
    """(name, fn) pairs of the sampler alone at batch bs, fp32 logits [bs, V] = randn x 3, T 0.8."""
    from trtgraph.kernels import processors, sampling

    gen = torch.Generator(device="cuda").manual_seed(bs)
    logits = torch.randn(bs, V, device="cuda", generator=gen) * 3
    flat = torch.randn(bs, V, device="cuda", generator=gen)
    t, k, p = (torch.full((bs,), 0.8, device="cuda"), torch.full((bs,), 50, device="cuda"),
               torch.full((bs,), 0.9, device="cuda"))
    no_k, no_p = torch.zeros_like(k), torch.ones_like(p)
    seeds, pos = torch.arange(bs, device="cuda"), torch.full((bs,), 100, device="cuda")
    tokens, want = logits.argmax(-1), torch.ones(bs, dtype=torch.int64, device="cuda")
    split_argmax = getattr(sampling, "argmax", None)  # absent before this branch
    return logits, [
        ("argmax torch", lambda: logits.argmax(-1)),
        ("argmax Triton", (lambda: split_argmax(logits)) if split_argmax else None),
        ("sort-based", lambda: sort_sampler(logits, t, k, p, seeds, pos)),
        ("T only", lambda: sampling.sample(logits, t, no_k, no_p, seeds, pos)),
        ("top-k 50 + top-p 0.9", lambda: sampling.sample(logits, t, k, p, seeds, pos)),
        ("top-p 0.9 alone", lambda: sampling.sample(logits, t, no_k, p, seeds, pos)),
        ("top-p 0.9 alone, flat rows", lambda: sampling.sample(flat, t, no_k, p, seeds, pos)),
        ("logprobs 20 Triton", lambda: processors.top_logprobs(logits, tokens, want, 20)),
        ("logprobs 20 torch", lambda: sampler.top_logprobs(logits, tokens, want, 20)),
    ], (t, k, p, no_k, seeds, pos, flat)


def sampler_alone(V: int, profile_bs: int = 64) -> list[str]:
    """The sampler's kernels alone, each recorded in a CUDA graph (ms per replay), the rows each
    path took, and a per-kernel profile at profile_bs."""
    from trtgraph.kernels import sampling

    names = None
    lines, extra = [], []
    for bs in BATCHES:
        logits, cases, (t, k, p, no_k, seeds, pos, flat) = _cases(bs, V)
        if names is None:
            names = [n for n, _ in cases]
            lines += ["", "| sampler alone, fp32 [bs, V], ms | bs | " + " | ".join(names) + " | rows off the candidates "
                      "(top-p alone; flat) | Triton == reference |", "|---|---" + "|---" * (len(names) + 2) + "|"]
        mins = torch.linspace(0, 0.2, bs, device="cuda")
        same = torch.equal(sampling.sample(logits, t, k, p, seeds, pos, mins), sampler.sample(logits, t, k, p, seeds, pos, mins))
        same &= torch.equal(sampling.sample(flat, t, no_k, p, seeds, pos), sampler.sample(flat, t, no_k, p, seeds, pos))
        paths = [sampling.draw(x, t, no_k, p, seeds, pos, None, None, None, sampling.CHUNK, sampling.CAP)[1]
                 for x in (logits, flat)]
        split = hasattr(sampling, "argmax")  # before this branch: 1 = the rejection rounds
        counts = "; ".join(f"{int((q == 1).sum())} split + {int((q == 2).sum())} rejection" if split
                           else f"{int(q.sum())} rejection" for q in paths)
        cells = [f"{graph_time(fn):.4f}" if fn else "-" for _, fn in cases]
        lines.append(f"| | {bs} | " + " | ".join(cells) + f" | {counts} | {same} |")
        print(lines[-1], file=sys.stderr, flush=True)
        if bs == profile_bs:
            extra += profile(cases)
    return lines + extra


VARIANTS = ((4096, 64, 4, 1, 32), (4096, 64, 4, 1, 64), (4096, 64, 4, 1, 16), (4096, 64, 8, 1, 32), (2048, 32, 4, 1, 16))


def sweep(V: int) -> list[str]:
    """top-k 50 + top-p 0.9 (and top-p alone on flat rows) under other settings: tokens per
    chunk, candidates per chunk, warps, bits per counting step of the selects' key searches,
    and the candidates at which the chunks' cut stops bisecting."""
    from trtgraph.kernels import sampling

    lines = ["", "| chunk, candidates, warps, search bits, cut stops at | bs | top-k 50 + top-p 0.9 ms | rows off | "
             "top-p alone, flat ms | == reference |", "|---|---|---|---|---|---|"]
    for bs in (1, 64):
        logits, _, (t, k, p, no_k, seeds, pos, flat) = _cases(bs, V)
        for block, cap, warps, bits, enough in VARIANTS:
            def run(x, kk, block=block, cap=cap, warps=warps, bits=bits, enough=enough):
                return sampling.draw(x, t, kk, p, seeds, pos, None, None, None, block, cap, warps=warps,
                                     search_bits=bits, enough=enough)
            got, path = run(logits, k)
            same = torch.equal(got, sampler.sample(logits, t, k, p, seeds, pos))
            same &= torch.equal(run(flat, no_k)[0], sampler.sample(flat, t, no_k, p, seeds, pos))
            lines.append(f"| {block}, {cap}, {warps}, {bits}, {enough} | {bs} | {graph_time(lambda: run(logits, k)):.4f} | "
                         f"{int((path != 0).sum())} | {graph_time(lambda: run(flat, no_k)):.4f} | {same} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def profile(cases) -> list[str]:
    """Per kernel: mean device time (us) over 20 replays of each case's graph."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    lines = ["", "| case (profile) | kernel | calls per replay | us per call |", "|---|---|---|---|"]
    for name, fn in cases:
        if fn is None:
            continue
        g = torch.cuda.CUDAGraph()
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count >= 20:
                us = ev.device_time_total / ev.count if hasattr(ev, "device_time_total") else ev.cuda_time_total / ev.count
                lines.append(f"| {name} | {ev.key[:60]} | {ev.count // 20} | {us:.1f} |")
    return lines


def main():
    if "--sweep" in sys.argv:  # the draw under other chunkings (this branch's kernels only)
        print("\n".join(sweep(128256)))
        return
    if "--alone" in sys.argv:  # the sampler's kernels alone, no model (Llama-3 vocabulary)
        print("\n".join(sampler_alone(128256)))
        return
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    cfg = Config.from_yaml(paths[0] if paths else "examples/llama-3.2-1b-synthetic.yaml")
    keys = [GraphKey(b, 0, 0, s) for b in BATCHES for s in ("greedy", "sampled")]
    plan = BucketPlan.from_config(cfg).with_keys(keys)
    ex = Executor.build(cfg, plan)
    lines = [f"kernels: {ex.model.ops.name}", "", "| bs | greedy ms | " + " | ".join(SETTINGS) + " |",
             "|---|---|" + "---|" * len(SETTINGS)]
    with torch.inference_mode():
        for key in keys:
            ex.warmup(key)
    for key in keys:
        ex.capture(key)
        print(f"captured {key}", file=sys.stderr, flush=True)
    bias = tuple((t, 1.0) for t in range(0, 3000, 10))
    for slot in range(ex.buffers.num_slots):
        ex.buffers.write_slot(slot, bias, list(ex.loaded.config.eos_token_ids))
    for b in BATCHES:
        cells = []
        for key, rows_kw in [(GraphKey(b, 0, 0, "greedy"), {})] + [(GraphKey(b, 0, 0, "sampled"), kw)
                                                                  for kw in SETTINGS.values()]:
            rows = [dataclasses.replace(r, seed=i, slot=i if rows_kw.get("processors") else None, prompt_len=100,
                                        **rows_kw) for i, r in enumerate(decode_rows(ex, b, 128))]
            ex.prepare(key, rows)
            with torch.inference_mode():
                ex.execute(key)
                if ex.device.type == "cuda":
                    torch.cuda.synchronize()
                ms = 1e3 * statistics.median(_timed(ex.device, lambda: ex.execute(key), 10) for _ in range(5))
            cells.append(ms)
            print(f"{key} {rows_kw}: {ms:.3f} ms", file=sys.stderr, flush=True)
        lines.append(f"| {b} | {cells[0]:.3f} | " + " | ".join(f"{c:.3f} ({c / cells[0]:.2f}x)" for c in cells[1:])
                     + " |")
    if ex.device.type == "cuda" and "--steps-only" not in sys.argv:
        lines += sampler_alone(ex.loaded.config.vocab_size)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
