"""Decode attention alone on the GPU: 16 launches (one per layer, each its own KV cache) in a
CUDA graph, Llama-3.2-1B shapes (32 q heads, 8 kv heads, head_dim 64, page 16, a 2048-token
block table), bf16, timed over replays (us per 16 launches); per variant (attention.DECODE_OVERRIDE
over each mode's shipped config: `shipped` is none), both split modes, at
bs 1 / 8 / 32 / 64 and contexts 128 / 512 / 2000 (the step's token at position ctx). Also: an
empty Triton kernel x16 (the launch floor), the old kernel (trtgraph/kernels/attention_old.py
where present: not committed, copied in beside for an A/B), and RoPE + KV write + attention
in one kernel vs triton_ops.rope_write_kv then attention.

Usage: python scripts/attention_sweep.py OUT.json [quick]"""

import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from trtgraph.kernels import attention as at
from trtgraph.kernels import triton_ops as t

LAYERS, HQ, HKV, D, PAGE, WIDTH = 16, 32, 8, 64, 16, 128
DEV = torch.device("cuda")
BATCHES, CONTEXTS = (1, 8, 32, 64), (128, 512, 2000)


@triton.jit
def _empty(x_ptr):
    pass


def timed(fn, reps=5, inner=20):
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / inner * 1e3)  # us per 16 launches
    return statistics.median(out)


def case(bs, ctx):
    nb = -(-(ctx + 1) // PAGE)
    caches = [torch.randn((2, bs * nb + 1, PAGE, HKV, D), device=DEV, dtype=torch.bfloat16) for _ in range(LAYERS)]
    tables = torch.zeros((bs, WIDTH), dtype=torch.int64, device=DEV)
    tables[:, :nb] = (torch.randperm(bs * nb, device=DEV) + 1).view(bs, nb)
    positions = torch.full((bs,), ctx, dtype=torch.int64, device=DEV)
    qkv = torch.randn((bs, (HQ + 2 * HKV) * D), device=DEV, dtype=torch.bfloat16)
    q, k, v = (x.view(bs, -1, D) for x in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    cos_sin = torch.randn((4096, D), device=DEV)
    slots = tables[torch.arange(bs, device=DEV), positions // PAGE] * PAGE + positions % PAGE
    return caches, tables, positions, q, k, v, cos_sin, slots


def run_variant(mod, c):
    caches, tables, positions, q, *_ = c
    q = q.contiguous()  # the old kernel wants q's strides to be its output's
    return timed(lambda: [mod.paged_attention(q, kv, tables, positions, 1, D ** -0.5) for kv in caches])


def main():
    out_path, quick = sys.argv[1], len(sys.argv) > 2
    res = {}
    x = torch.zeros(1, device=DEV)
    res["empty_x16_us"] = timed(lambda: [_empty[(1,)](x) for _ in range(LAYERS)])
    print("empty x16", res["empty_x16_us"], flush=True)
    try:
        from trtgraph.kernels import attention_old as old
    except ImportError:
        old = None
    variants = {"shipped": {}, "n64p4w4": {"block_n": 64, "piece_tiles": 4, "warps": 4}, "s1": {"stages": 1}, "w2": {"warps": 2},
                "n32p8": {"block_n": 32, "piece_tiles": 8},
                "n64p2": {"block_n": 64, "piece_tiles": 2}, "n64p1": {"block_n": 64, "piece_tiles": 1}, "n128p2": {"block_n": 128, "piece_tiles": 2},
                "n128p1": {"block_n": 128, "piece_tiles": 1}, "sm1": {"per_sm": 1}, "sm4": {"per_sm": 4}}
    cases = {(bs, ctx): case(bs, ctx) for bs in BATCHES for ctx in CONTEXTS}
    for mode in ("adaptive", "invariant"):
        for name, v in ({"shipped": {}} if quick else variants).items():
            if mode == "adaptive" and name.startswith("sm"):
                continue
            at.DECODE_OVERRIDE.clear()
            at.DECODE_OVERRIDE.update(v)
            at.set_attention_invariant(mode == "invariant")
            row = {}
            for (bs, ctx), c in cases.items():
                try:
                    row[f"{bs}x{ctx}"] = run_variant(at, c)
                except Exception as e:  # a variant that does not compile or run is a result too
                    row[f"{bs}x{ctx}"] = f"{type(e).__name__}: {str(e)[:200]}"
            res[f"{mode}/{name}"] = row
            print(mode, name, {k: (round(x, 1) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
        if old is not None:
            old.set_attention_invariant(mode == "invariant")
            row = {f"{bs}x{ctx}": run_variant(old, c) for (bs, ctx), c in cases.items()}
            res[f"{mode}/old"] = row
            print(mode, "old", {k: round(x, 1) for k, x in row.items()}, flush=True)
    at.DECODE_OVERRIDE.clear()
    at.set_attention_invariant(False)
    for bs in BATCHES:  # RoPE + KV write inside attention vs the two kernels, 128 cached tokens
        caches, tables, positions, q, k, v, cos_sin, slots = cases[(bs, 128)]
        two = timed(lambda: [at.paged_attention(t.rope_write_kv(q, k, v, cos_sin, positions, kv, slots), kv, tables,
                                                positions, 1, D ** -0.5) for kv in caches])
        one = timed(lambda: [at.rope_paged_attention(q, k, v, cos_sin, positions, kv, slots, tables, 1, D ** -0.5)
                             for kv in caches])
        res[f"rope/{bs}x128"] = {"two_kernels": two, "one_kernel": one}
        print("rope", bs, round(two, 1), round(one, 1), flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
