"""What a kernel boundary costs in the replayed decode step, and the light CUDA-core GEMV
(kernels/decode_light.py) against the tensor-core one (kernels/decode_kernel.py), on the
Llama-3.2-1B layer shapes in bf16, everything timed in CUDA graphs over weight copies that
defeat the L2:

1. `boundary`: the o shape (2048 x 2048 + residual) chained 16 times (16 kernels) against one
   kernel over 16 x the weight rows, for cuBLAS (F.linear), the tensor-core kernel and the light
   one (without and with PDL): us per 2048 x 2048 of weights; the difference is what a boundary costs.
2. `ops`: each op alone at T = 1, chained on weight copies: the tensor-core kernel, the light
   kernel's candidate configs with PDL, the best one also without PDL; fraction of the copy
   bandwidth for the weight bytes.
3. `layers`: 16 layers of the real sequence (qkv + RoPE/KV write, o + residual, gate_up + SiLU,
   down + residual; each op's input the previous op's output, attention left out) at T = 1:
   tensor-core, light, light with PDL; us per layer against the weights' floor.
`--write`: the best light config per shape (at T = 1, with PDL) into kernels/decode_tuned.py's LIGHT.
Usage: python scripts/decode_boundary.py OUT.json [--quick] [--write]
"""

import json
import sys

import torch
import torch.nn.functional as F
from tune_linear import graph_time  # scripts/ is on sys.path when this runs as a script

from trtgraph.bench import measure_bandwidth
from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels.composed import QKVHeads

DEV = torch.device("cuda")
DT = torch.bfloat16
HEADS = QKVHeads(32, 8, 64)
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
CANDIDATES = {  # (BLOCK_N, BLOCK_K, SPLIT_K, warps): <= 32 fp32 per thread per row accumulator
    "o": [(4, 1024, 1, 4), (8, 512, 1, 4), (4, 512, 1, 2), (8, 1024, 1, 8), (2, 1024, 1, 2), (4, 2048, 1, 8)],
    "qkv": [(4, 1024, 1, 4), (4, 512, 1, 4), (8, 512, 1, 4), (2, 1024, 1, 2), (4, 512, 1, 2), (8, 1024, 1, 8)],
    "gate_up": [(8, 512, 1, 4), (16, 256, 1, 4), (4, 1024, 1, 4), (8, 1024, 1, 8), (16, 512, 1, 8), (32, 256, 1, 8)],
    "down": [(4, 1024, 2, 4), (8, 1024, 4, 4), (8, 512, 2, 4), (4, 2048, 1, 8), (4, 1024, 1, 4), (8, 1024, 2, 8)],
}
QUICK = {name: c[:4] for name, c in CANDIDATES.items()}
RESULTS: dict = {}


def light(shape, cfg, pdl):
    """Install the light kernel for shape (or the tensor-core one: cfg None)."""
    if cfg is None:
        dl._LIGHT_ON.discard(shape)
        return
    dl._LIGHT_ON.add(shape)
    dl._LIGHT_TUNED[shape] = cfg
    dl._LIGHT_PDL = frozenset({0, 1, 2, 3}) if pdl else frozenset()


def make_op(name, m, ws, seed=0):
    """fn(i): the op on m rows with weight copy i % len(ws)."""
    n, k = SHAPES[name]
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(seed)).to(DEV, DT)  # row 0 the same for every m
    nw = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(seed + 1))).to(DEV, DT)
    if name == "qkv":
        cos_sin = torch.randn((256, HEADS.head_dim), generator=torch.Generator().manual_seed(1)).to(DEV)
        pos = torch.arange(m, device=DEV)
        cache = torch.zeros((2, 64, 16, HEADS.num_kv_heads, HEADS.head_dim), device=DEV, dtype=DT)
        slots = torch.arange(m, device=DEV) + 16
        return lambda i: dl.norm_qkv_rope(x, nw, 1e-5, ws[i % len(ws)], None, HEADS, cos_sin, pos, cache, slots)
    if name == "gate_up":
        return lambda i: dl.norm_gate_up_silu(x, nw, 1e-5, ws[i % len(ws)])
    res = torch.randn((m, n), generator=torch.Generator().manual_seed(seed + 2)).to(DEV, DT)
    return lambda i: dl.linear_residual(x, ws[i % len(ws)], res)


def copies(name):
    n, k = SHAPES[name]
    c = max(4, -(-(256 << 20) // (n * k * 2)))
    return [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5 for _ in range(c)]


def us(fn, calls):
    return graph_time(fn, calls) * 1e6


def boundary(bw):
    """o's shape chained 16 times vs one kernel of 16 x the rows."""
    n, k = SHAPES["o"]
    ws = [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5 for _ in range(32)]
    big = [torch.cat(ws[i * 16:(i + 1) * 16]) for i in range(2)]  # 2 x [32768, 2048]: 268 MB
    x = torch.randn((1, k), device=DEV, dtype=DT)
    res_s, res_b = torch.zeros((1, n), device=DEV, dtype=DT), torch.zeros((1, 16 * n), device=DEV, dtype=DT)
    out = {}
    floor = n * k * 2 / bw * 1e6
    for tag, cfg, pdl in (("cublas", None, False), ("tensor-core", None, False), ("light", (8, 512, 1, 4), False),
                          ("light+pdl", (8, 512, 1, 4), True)):
        if tag == "cublas":
            chain = us(lambda i: F.linear(x, ws[i % 32]), 32)
            one = us(lambda i: F.linear(x, big[i % 2]), 2) / 16
        else:
            light((n, k), cfg, pdl)
            light((16 * n, k), cfg, pdl)
            chain = us(lambda i: dl.linear_residual(x, ws[i % 32], res_s), 32)
            one = us(lambda i: dl.linear_residual(x, big[i % 2], res_b), 2) / 16
            light((n, k), None, False)
            light((16 * n, k), None, False)
        out[tag] = {"chained_us": chain, "one_kernel_us_per_2048": one, "boundary_us": chain - one, "floor_us": floor}
        print(f"boundary {tag:12s} chained {chain:6.2f} us/op, one kernel {one:6.2f} us per 2048 rows, "
              f"boundary {chain - one:5.2f} us (floor {floor:.2f})", flush=True)
    RESULTS["boundary"] = out


def ops(bw, quick):
    out = {}
    for name, shape in SHAPES.items():
        ws = copies(name)
        calls = max(len(ws), 16)
        floor = shape[0] * shape[1] * 2 / bw * 1e6
        r = {"floor_us": floor}
        light(shape, None, False)
        r["tensor-core"] = us(make_op(name, 1, ws), calls)
        screened = []
        for cfg in (QUICK if quick else CANDIDATES)[name]:
            light(shape, cfg, True)
            try:
                screened.append((us(make_op(name, 1, ws), calls), cfg))
            except Exception as e:
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        r["screen_T1_pdl"] = [[t, list(c)] for t, c in sorted(screened)]
        best = sorted(screened)[0][1]
        light(shape, best, False)
        r["best_T1_nopdl"] = us(make_op(name, 1, ws), calls)
        light(shape, best, True)
        r["best"] = {"cfg": list(best), "us": us(make_op(name, 1, ws), calls)}
        light(shape, None, False)
        out[name] = r
        print(f"op {name:8s} floor {floor:5.2f} us  tensor-core {r['tensor-core']:6.2f}"
              f" | light {best} {r['best']['us']:6.2f} ({floor / r['best']['us']:.0%}) no PDL {r['best_T1_nopdl']:6.2f}",
              flush=True)
        print("   screened: " + ", ".join(f"{tuple(c)} {t:.2f}" for t, c in r["screen_T1_pdl"]), flush=True)
        del ws
        torch.cuda.empty_cache()
    RESULTS["ops"] = out
    return {name: tuple(r["best"]["cfg"]) for name, r in out.items()}


def layers(bw, best):
    """16 layers of qkv -> o -> gate_up -> down, each op's input the previous one's output."""
    L = 16
    W = {name: [torch.randn(SHAPES[name], device=DEV, dtype=DT) / SHAPES[name][1] ** 0.5 for _ in range(L)]
         for name in SHAPES}
    nw = torch.ones(2048, device=DEV, dtype=DT)
    floor = sum(n * k * 2 for n, k in SHAPES.values()) / bw * 1e6
    out = {"floor_us_per_layer": floor}
    for m in (1,):
        h = torch.randn((m, 2048), device=DEV, dtype=DT)
        cos_sin = torch.randn((256, 64), device=DEV)
        pos = torch.arange(m, device=DEV)
        cache = torch.zeros((2, 64, 16, 8, 64), device=DEV, dtype=DT)
        slots = torch.arange(m, device=DEV) + 16

        def step(_):
            for i in range(L):
                q = dl.norm_qkv_rope(h, nw, 1e-5, W["qkv"][i], None, HEADS, cos_sin, pos, cache, slots)
                dl.linear_residual(q.view(m, 2048), W["o"][i], h)
                a = dl.norm_gate_up_silu(h, nw, 1e-5, W["gate_up"][i])
                dl.linear_residual(a, W["down"][i], h)
        for tag in ("tensor-core", "light", "light+pdl"):
            for name, shape in SHAPES.items():
                light(shape, None if tag == "tensor-core" else best[name], tag == "light+pdl")
            t = us(step, 1) / L
            out[f"{tag} T{m}"] = t
            print(f"layers T={m} {tag:12s} {t:6.2f} us per layer ({t / floor:.2f}x the weights' floor {floor:.2f})",
                  flush=True)
    for shape in SHAPES.values():
        light(shape, None, False)
    RESULTS["layers"] = out


def write(best):
    """Replace decode_tuned.LIGHT's entries by the measured best configs."""
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "trtgraph" / "kernels" / "decode_tuned.py"
    text = path.read_text()
    start = text.index("LIGHT = {")
    end = text.index("}", start) + 1
    body = "".join(f"    {SHAPES[name]}: {tuple(cfg)},\n" for name, cfg in best.items())
    path.write_text(text[:start] + "LIGHT = {\n" + body + "}" + text[end:])
    print("LIGHT = {\n" + body + "}", flush=True)


def main():
    path = sys.argv[1]
    quick = "--quick" in sys.argv
    bw = measure_bandwidth(DEV)
    RESULTS["bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    best = {}

    def tune():
        best.update(ops(bw, quick))
        if "--write" in sys.argv:
            write(best)
        layers(bw, best)
    for part in (lambda: boundary(bw), tune):
        try:
            part()
        except Exception as e:  # keep what was measured
            print(f"FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
