"""The persistent layer tail (kernels/decode_persistent.py) alone, on the GPU: 16 layers of
o + residual -> norm + gate_up + SiLU -> down + residual on distinct Llama-3.2-1B weights (bf16,
1.7 GB: no layer's weights are in L2 when it starts), recorded in a CUDA graph, at 33 / 48 / 64
rows (and any given with --rows), against today's path at those rows (the Triton set's
composition: cuBLAS addmm_ for o and down, the fused gate_up kernel), us per layer (median of 5 x
20 replays) and the weights' floor at the measured copy bandwidth. Checks: the replay bitwise equal
to the eager launches; the tail's rows bitwise equal to the separate fused-kernel ops at the same
rows (decode_linear's ops, whose configs the tail shares: the rounding question of `deterministic`).
Usage: python scripts/tail_bench.py OUT.json [--rows 8,16,33,48,64] [--prefetch 0,1024,4096] [--warps 4,8]
"""

import json
import statistics
import sys

import torch

from trtgraph.bench import _timed, measure_bandwidth
from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels import decode_persistent as dp
from trtgraph.kernels import decode_tuned, get_kernels
from trtgraph.kernels import linear as lin

H, KO, INTER, LAYERS = 2048, 2048, 8192, 16


def _arg(name, default):
    if name in sys.argv:
        at = sys.argv.index(name)
        value = sys.argv[at + 1]
        del sys.argv[at:at + 2]
        return [int(v) for v in value.split(",")]
    return default


def main():
    rows = _arg("--rows", [33, 48, 64])
    prefetch = _arg("--prefetch", [dp._PREFETCH_BYTES])
    warps = _arg("--warps", [0])  # 0: the kernel's default (decode_persistent._NUM_WARPS)
    out_path = sys.argv[1]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(0)
    shapes = [("norm_qkv_rope", 3072, H), ("linear_residual", H, KO), ("norm_gate_up_silu", 2 * INTER, H),
              ("linear_residual", H, INTER), ("norm_linear", 128256, H)]
    counts = {(n, k): rows for _, n, k in shapes}
    lin.choose_backends(counts, dt, dev, False, frozenset({(H, KO), (H, INTER)}))
    decode_tuned.TAIL = True
    print("choice:", dl.choose_fused(shapes, counts, dev, False, False, dtype=dt), flush=True)
    tail_on = set(dp._TAIL_ON)
    ops = get_kernels("triton")

    def w(n, k):
        return (torch.randn((n, k), generator=g) / k ** 0.5).to(dev, dt)
    layers = [(w(H, KO), w(2 * INTER, H), w(H, INTER)) for _ in range(LAYERS)]
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dev, dt)
    bw = measure_bandwidth(dev)
    floor = sum(t.numel() * t.element_size() for t in layers[0]) / bw * 1e6
    results = {"bandwidth_GBps": bw / 1e9, "floor_us_per_layer": floor}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; floor per layer {floor:.2f} us", flush=True)
    for T in rows:
        a = torch.randn((T, KO), generator=g).to(dev, dt)
        h0 = torch.randn((T, H), generator=g).to(dev, dt)

        def step(x, fn):
            for wo, wgu, wd in layers:
                x = fn(a, wo, x, nw, 1e-5, wgu, wd)
            return x

        def separate(a_, wo, x, nw_, eps, wgu, wd):  # the fused-kernel ops one by one (tail's configs)
            x = dl.linear_residual(a_, wo, x)
            return dl.linear_residual(dl.norm_gate_up_silu(x, nw_, eps, wgu), wd, x)
        res = {}
        for name, fn, pf, nwarps in ([("today", ops.layer_tail, None, 0)]
                                  + [(f"tail-pf{p}-w{n}", dp.layer_tail, p, n) for p in prefetch for n in warps]):
            if pf is not None:
                dp._PREFETCH_BYTES, dp._NUM_WARPS = pf, nwarps or None
            dp._TAIL_ON = set(tail_on) if pf is not None else set()
            eager = step(h0.clone(), fn)
            x = h0.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(x, fn)
            x.copy_(h0)
            graph.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(out, eager))
            us = statistics.median(_timed(dev, graph.replay, 20) for _ in range(5)) * 1e6 / LAYERS
            res[name] = {"us_per_layer": us, "x_floor": us / floor, "replay_equals_eager": same}
            if pf is not None:
                res[name]["equals_separate_fused_ops"] = bool(torch.equal(eager, step(h0.clone(), separate)))
            print(f"T={T:3d} {name:12s} {us:7.2f} us/layer ({us / floor:.2f}x floor) replay==eager {same} "
                  + str({k: v for k, v in res[name].items() if k == 'equals_separate_fused_ops'}), flush=True)
            del graph
        results[T] = res
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
