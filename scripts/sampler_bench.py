"""Sampled vs greedy decode steps on the GPU (Llama-3.2-1B shapes, synthetic bf16 weights),
and the sampler alone against the sort-based sampler it replaced.

Usage: python scripts/sampler_bench.py [CONFIG]  (default examples/llama-3.2-1b-synthetic.yaml)
Prints a markdown table: replayed step times (CUDA events, median) per batch size for greedy
rows on the greedy key, and on the sampled key with temperature only, top-k + top-p, and
every processor (min_p, penalties, 300 logit_bias entries, min_tokens, logprobs 20).
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


def sampler_alone(V: int) -> list[str]:
    from trtgraph.kernels import sampling

    lines = ["", "| sampler alone, fp32 logits [bs, V] | bs | argmax ms | sort-based ms | sort-free torch ms | sort-free Triton ms "
             "| Triton, T only ms | Triton, top-p 0.9 only ms (rows by rejection) |", "|---|---|---|---|---|---|---|---|"]
    for bs in BATCHES:
        gen = torch.Generator(device="cuda").manual_seed(bs)
        logits = torch.randn(bs, V, device="cuda", generator=gen) * 3
        t, k, p = (torch.full((bs,), 0.8, device="cuda"), torch.full((bs,), 50, device="cuda"),
                   torch.full((bs,), 0.9, device="cuda"))
        seeds, pos = torch.arange(bs, device="cuda"), torch.full((bs,), 100, device="cuda")
        got = sampling.sample(logits, t, k, p, seeds, pos)
        agree = (sort_sampler(logits, t, k, p, seeds, pos) == got).float().mean().item()
        mins = torch.linspace(0, 0.2, bs, device="cuda")
        same = torch.equal(sampling.sample(logits, t, k, p, seeds, pos, mins), sampler.sample(logits, t, k, p, seeds, pos, mins))
        times = [graph_time(lambda: logits.argmax(-1)), graph_time(lambda: sort_sampler(logits, t, k, p, seeds, pos)),
                 graph_time(lambda: sampler.sample(logits, t, k, p, seeds, pos)),
                 graph_time(lambda: sampling.sample(logits, t, k, p, seeds, pos)),
                 graph_time(lambda: sampling.sample(logits, t, 0 * k, 1 + 0 * p, seeds, pos)),
                 graph_time(lambda: sampling.sample(logits, t, 0 * k, p, seeds, pos))]
        rejected = int(sampling.draw(logits, t, 0 * k, p, seeds, pos, None, None, None, sampling.CHUNK,
                                     sampling.CAP)[1].sum())
        lines.append(f"| top-k 50 top-p 0.9 T 0.8 (Triton == torch reference: {same}; == sort-based: {agree:.2f}) | {bs} | "
                     + " | ".join(f"{x:.3f}" for x in times) + f" ({rejected}/{bs}) |")
    return lines


def main():
    cfg = Config.from_yaml(sys.argv[1] if len(sys.argv) > 1 else "examples/llama-3.2-1b-synthetic.yaml")
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
    if ex.device.type == "cuda":
        lines += sampler_alone(ex.loaded.config.vocab_size)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
