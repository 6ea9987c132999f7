"""Decode attention alone on the GPU: 16 launches (one per layer, each its own KV cache) in a
CUDA graph, Llama-3.2-1B shapes (32 q heads, 8 kv heads, head_dim 64, page 16, a 2048-token
block table), bf16, adaptive mode (`deterministic: false`), timed over replays (us per 16
launches, median of 5 x 20), each variant twice (the list forwards, then backwards).

Variants (attention_config.DECODE_OVERRIDE over the shipped config; `old`: the attention.py of
main 269f981, copied in beside as trtgraph/kernels/attention_old.py where present, not
committed): plain decode attention (the cache written before: the fused qkv's path, bs <= 32 on
the 1B) at bs 1 / 8 / 32 / 64, and RoPE + KV write inside attention (bs 33-64's path) at bs 48 /
64, contexts 128 and 512 cached tokens (the step's token at position ctx); `fold`: the step's
key folded in from registers (no write-then-read), `early`: the first tile's pages read with the
positions and its K / V loaded before q, `w4` / `n128w4` / `s2` / `fill8`: warps, a 128-key
tile on 4 warps, 2 pipeline stages, 8 programs per SM (2 pieces a row at bs 64). Also the launch
floor (an empty kernel x16) and each compiled variant's registers / spills / shared memory.
SWEEP_SET=1: call 1's variants (relative overrides); 2 (default): whole configs for the RoPE
path at bs 48 / 64 (tile and warps 64/w2, 128/w2, 128/w4; 3 or 2 stages; fold 1 or 2).

The kernels are compiled first by `--warm K/N` child processes (one Triton cache, in parallel),
so the timing process loads them. Usage: python scripts/attention_sweep.py OUT.json"""

import importlib
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/a8-triton-cache")  # one cache for the warming children and this

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trtgraph.kernels import attention as at  # noqa: E402
from trtgraph.kernels import attention_config as acfg  # noqa: E402

LAYERS, HQ, HKV, D, PAGE, WIDTH = 16, 32, 8, 64, 16, 128
DEV = torch.device("cuda")
DT = torch.bfloat16
PLAIN_CASES = [(bs, ctx) for bs in (1, 8, 32, 64) for ctx in (128, 512)] + [(64, 127), (64, 0)]
ROPE_CASES = [(bs, ctx) for bs in (48, 64) for ctx in (128, 512)] + [(64, 1)]
SETS = {}
SETS[1] = {  # call 1 (at be3c10b, over that tree's configs: 128/2/w4 up to 2 row programs per SM, 64/4/w2 past)
    "plain/old": ("plain", "old", {}),
    "plain/shipped": ("plain", "new", {"early": False}),
    "plain/early": ("plain", "new", {"early": True}),
    "plain/early-w4": ("plain", "new", {"early": True, "warps": 4}),
    "rope/old": ("rope", "old", {}),
    "rope/nofold": ("rope", "new", {"fold": False, "early": False}),
    "rope/fold": ("rope", "new", {"fold": True, "early": False}),
    "rope/fold-early": ("rope", "new", {"fold": True, "early": True}),
    "rope/fold-w4": ("rope", "new", {"fold": True, "early": False, "warps": 4}),
    "rope/fold-early-w4": ("rope", "new", {"fold": True, "early": True, "warps": 4}),
    "rope/fold-n128w4": ("rope", "new", {"fold": True, "early": False, "block_n": 128, "piece_tiles": 1, "warps": 4}),
    "rope/fold-early-n128w4": ("rope", "new", {"fold": True, "early": True, "block_n": 128, "piece_tiles": 1,
                                               "warps": 4}),
    "rope/fold-s2": ("rope", "new", {"fold": True, "early": False, "stages": 2}),
    "rope/fold-early-fill8": ("rope", "new", {"fold": True, "early": True, "fill": 8}),
}
N64W2, N128W4, N128W2 = (dict(block_n=64, piece_tiles=4, warps=2), dict(block_n=128, piece_tiles=2, warps=4),
                         dict(block_n=128, piece_tiles=2, warps=2))
SETS[2] = {  # call 2 (at b3a7705): whole configs (the fold's slot read early; fold 2: the key as a 16-key tile)
    "plain/shipped": ("plain", "new", {}),
    "rope/before": ("rope", "new", {**N64W2, "stages": 3, "fold": 0, "early": False}),
    **{f"rope/n{c['block_n']}w{c['warps']}-s{st}-fold{f}":
       ("rope", "new", {**c, "stages": st, "fold": f, "early": False})
       for c in (N64W2, N128W2, N128W4) for st in (3, 2) for f in (1, 2) if not (c is N128W4 and st == 2)},
}
VARIANTS = SETS[int(os.environ.get("SWEEP_SET", "2"))]


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
    caches = [torch.randn((2, bs * nb + 1, PAGE, HKV, D), device=DEV, dtype=DT) for _ in range(LAYERS)]
    tables = torch.zeros((bs, WIDTH), dtype=torch.int64, device=DEV)
    tables[:, :nb] = (torch.randperm(bs * nb, device=DEV) + 1).view(bs, nb)
    positions = torch.full((bs,), ctx, dtype=torch.int64, device=DEV)
    qkv = torch.randn((bs, (HQ + 2 * HKV) * D), device=DEV, dtype=DT)
    q, k, v = (x.view(bs, -1, D) for x in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    cos_sin = torch.randn((4096, D), device=DEV)
    slots = tables[torch.arange(bs, device=DEV), positions // PAGE] * PAGE + positions % PAGE
    return caches, tables, positions, q, k, v, cos_sin, slots


def modules():
    mods = {"new": at}
    try:
        mods["old"] = importlib.import_module("trtgraph.kernels.attention_old")
    except ImportError:
        pass
    return mods


def launches(mod, path, c):
    caches, tables, positions, q, k, v, cos_sin, slots = c
    if path == "plain":
        qc = q.contiguous()
        return lambda: [mod.paged_attention(qc, kv, tables, positions, 1, D ** -0.5) for kv in caches]
    return lambda: [mod.rope_paged_attention(q, k, v, cos_sin, positions, kv, slots, tables, 1, D ** -0.5)
                    for kv in caches]


def check(mod, path, c):
    """The variant's output of layer 0 against the torch reference: relative error (bf16)."""
    from trtgraph.kernels import reference as ref

    caches, tables, positions, q, k, v, cos_sin, slots = c
    kv = caches[0].clone()
    want_kv = kv.clone()
    if path == "plain":
        got = mod.paged_attention(q.contiguous(), kv, tables, positions, 1, D ** -0.5)
        want = ref.paged_attention(q.contiguous(), want_kv, tables, positions, 1, D ** -0.5)
    else:
        got = mod.rope_paged_attention(q, k, v, cos_sin, positions, kv, slots, tables, 1, D ** -0.5)
        want = ref.rope_paged_attention(q, k, v, cos_sin, positions, want_kv, slots, tables, 1, D ** -0.5)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    return round(rel(got, want), 5), round(rel(kv, want_kv), 5)


def install(name, mods):
    path, m, override = VARIANTS[name]
    acfg.DECODE_OVERRIDE.clear()
    acfg.DECODE_OVERRIDE.update(override)
    acfg.set_attention_invariant(False)
    if m == "old":
        mods["old"].set_attention_invariant(False)
    return path, mods[m]


def compiled(mod):
    """(key, registers, spills, shared bytes, warps) of every compiled variant of the kernel."""
    out = {}
    try:
        for dev_cache in mod._paged_attn_kernel.device_caches.values():
            for key, k in dev_cache[0].items():
                out[str(key)[-400:]] = dict(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                                            warps=k.metadata.num_warps)
    except Exception as e:  # the cache's layout is Triton's; a miss here is reported, not fatal
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def warm(part, parts):
    mods = modules()
    names = [n for i, n in enumerate(VARIANTS) if i % parts == part and VARIANTS[n][1] in mods]
    for name in names:
        path, mod = install(name, mods)
        for bs, ctx in (PLAIN_CASES if path == "plain" else ROPE_CASES):
            launches(mod, path, case(bs, ctx))()
    torch.cuda.synchronize()


def main():
    if sys.argv[1] == "--warm":
        part, parts = (int(x) for x in sys.argv[2].split("/"))
        return warm(part, parts)
    out_path = sys.argv[1]
    t0 = time.time()
    parts = min(8, len(VARIANTS))
    kids = [subprocess.Popen([sys.executable, __file__, "--warm", f"{i}/{parts}"]) for i in range(parts)]
    codes = [p.wait() for p in kids]
    res = {"warm_s": time.time() - t0, "warm_exit_codes": codes}
    print(f"compiled in {res['warm_s']:.1f} s, exit codes {codes}", flush=True)
    mods = modules()
    x = torch.zeros(1, device=DEV)
    res["empty_x16_us"] = timed(lambda: [_empty[(1,)](x) for _ in range(LAYERS)])
    print("empty x16", round(res["empty_x16_us"], 2), flush=True)
    cases = {p: {c: case(*c) for c in (PLAIN_CASES if p == "plain" else ROPE_CASES)} for p in ("plain", "rope")}
    names = [n for n in VARIANTS if VARIANTS[n][1] in mods]
    for i, name in enumerate(names + names[::-1]):
        path, mod = install(name, mods)
        tag = f"{name}#{1 + (i >= len(names))}"
        row = {}
        for (bs, ctx), c in cases[path].items():
            try:
                row[f"{bs}x{ctx}"] = round(timed(launches(mod, path, c)), 2)
            except Exception as e:  # a variant that does not compile or run is a result too
                row[f"{bs}x{ctx}"] = f"{type(e).__name__}: {str(e)[:200]}"
        if i < len(names):  # output and cache against the reference, once per variant
            try:
                row["rel_err_64x128"] = check(mod, path, cases[path][(64, 128)])
            except Exception as e:
                row["rel_err_64x128"] = f"{type(e).__name__}: {str(e)[:200]}"
        res[tag] = row
        print(f"{tag:28s}", "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    res["compiled"] = {m: compiled(mod) for m, mod in mods.items()}
    for m, entries in res["compiled"].items():
        for key, meta in entries.items():
            print(m, meta, key[-160:], flush=True)
    acfg.DECODE_OVERRIDE.clear()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"sweep done in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
