"""Tune the fused decode GEMVs (kernels/decode_linear.py) per Llama-3.2-1B layer shape (bf16),
one config per shape for every T, against the composition they replace (Triton RMSNorm,
cuBLAS, Triton SiLU-mul / RoPE+KV write, the residual add in cuBLAS's epilogue: addmm_ in
place), each timed in a CUDA graph.

Prints per shape the best configs (us at T = 1, 8, 40, 64 and fraction of the measured copy
bandwidth, counting the weight bytes) and the composition's, whether the fused kernel is faster
at T <= 32 (else the shape goes to SLOWER) and at both T = 40 and 64 (then to WIDE: fused up to
64 rows), and whether row 0 is bitwise equal at T = 1, 8, 17, 40, 64. `--quick`: a short list of candidates per shape (the best of earlier
full runs, and stacked paired rows); `--current`: the table's own config only (a run gives the
WIDE verdict of today's table and kernel); `--write`: merge the results into
trtgraph/kernels/decode_tuned.py (the table the kernels use).
Usage: python scripts/tune_decode_linear.py OUT.json [--quick | --current] [--write] [SHAPE ...]
"""

import json
import pathlib
import sys

import torch
import torch.nn.functional as F
from tune_linear import graph_time  # scripts/ is on sys.path when this runs as a script

from trtgraph.bench import measure_bandwidth
from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels import decode_tuned
from trtgraph.kernels import triton_ops as t
from trtgraph.kernels.composed import QKVHeads, compose

DEV = torch.device("cuda")
DT = torch.bfloat16
HEADS = QKVHeads(32, 8, 64)
# name: (op, N, K)
SHAPES = {"qkv": ("norm_qkv_rope", 3072, 2048), "o": ("linear_residual", 2048, 2048),
          "gate_up": ("norm_gate_up_silu", 16384, 2048), "down": ("linear_residual", 2048, 8192),
          "lm_head": ("norm_linear", 128256, 2048)}
ROWS = (1, 8, 40, 64)
NARROW = (1, 8)  # the rows every chosen shape runs fused; 40 and 64 decide WIDE
COMPOSED = compose(t.rms_norm, F.linear, t.silu_and_mul, t.rope_write_kv,
                   lambda x, w, residual: residual.addmm_(x, w.t()))


def candidates(op, n, k):
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages): per BLOCK_N the split s0 that first puts
    >= 120 programs on the 132 SMs, half and twice it; stages as many (<= 4) as fit one program
    per SM, and for s0 also as many as fit two."""
    pairs = 2 if op in ("norm_qkv_rope", "norm_gate_up_silu") else 1
    cols = n // pairs
    out = []
    for bn in (32, 64, 128):
        tiles = -(-cols // bn)
        s0 = next((s for s in (1, 2, 4, 8, 16) if tiles * s >= 120), 16)
        splits = [s for s in (s0 // 2, s0, 2 * s0) if s >= 1 and k // s >= 256 and tiles * s <= 1200]
        for bk in ((128, 256) if bn < 128 else (128,)):
            per_stage = pairs * bn * bk * 2 + 64 * bk * 2
            stages = max(2, min(4, (200 << 10) // per_stage))  # one program per SM
            out += [(bn, bk, s, 4, stages) for s in splits]
            two = max(2, min(4, (100 << 10) // per_stage))  # two programs per SM
            if bk == 128 and two != stages and s0 in splits:
                out.append((bn, bk, s0, 4, two))
    if op == "norm_linear":
        out += [(128, 128, 1, 8, 3), (256, 128, 1, 8, 3)]
    return out


# the best configs of the full runs (docs/performance.md) and stacked paired-row variants
QUICK = {
    "lm_head": [(128, 128, 1, 4, 3), (128, 128, 1, 8, 3), (128, 256, 1, 8, 2), (64, 128, 1, 4, 4),
                (128, 128, 1, 8, 3, False, True)],
    "qkv": [(64, 128, 4, 4, 4, False), (64, 128, 4, 8, 3, True), (32, 128, 4, 4, 4, True),
            (32, 128, 8, 4, 4, False), (64, 128, 8, 4, 3, True), (64, 128, 8, 8, 3, True),
            (32, 128, 8, 4, 4, True), (32, 256, 4, 4, 3, True), (64, 64, 8, 4, 4, True)],
    "o": [(64, 128, 4, 4, 4), (64, 128, 2, 4, 4), (32, 128, 4, 4, 4), (64, 256, 4, 4, 3), (32, 128, 8, 4, 4),
          (64, 128, 8, 4, 4), (64, 64, 8, 4, 4), (32, 64, 8, 4, 4), (32, 256, 4, 4, 3)],
    "gate_up": [(64, 256, 1, 4, 2, False), (64, 128, 1, 8, 3, True), (64, 64, 1, 8, 6, True), (64, 64, 1, 8, 7, True), (64, 128, 1, 4, 3, True),
                (128, 128, 1, 8, 2, True), (32, 128, 1, 4, 4, True), (64, 256, 1, 8, 2, True)],
    "down": [(64, 256, 4, 4, 3), (64, 128, 4, 4, 4), (64, 128, 8, 4, 3), (64, 256, 8, 4, 3), (32, 256, 4, 4, 3),
             (32, 256, 8, 4, 3), (32, 128, 8, 4, 4), (64, 512, 4, 4, 2), (128, 256, 8, 8, 2), (64, 256, 16, 4, 3)],
}


def make_call(op, n, k, m, ws, fused):
    """fn(i) running the op on m rows with weight copy i % len(ws) (the copies defeat L2)."""
    ops = dl.FUSED_OPS if fused else COMPOSED
    g = torch.Generator().manual_seed(0)  # row 0 the same for every m
    x = torch.randn((m, k), generator=g).to(DEV, DT)
    nw = torch.ones(k, device=DEV, dtype=DT)
    if op == "norm_qkv_rope":
        gen = torch.Generator().manual_seed(1)  # the same rope table in every call
        cos_sin = torch.randn((256, HEADS.head_dim), generator=gen).to(DEV)
        pos = torch.arange(m, device=DEV)
        cache = torch.zeros((2, 64, 16, HEADS.num_kv_heads, HEADS.head_dim), device=DEV, dtype=DT)
        slots = torch.arange(m, device=DEV) + 16
        return lambda i: ops.norm_qkv_rope(x, nw, 1e-5, ws[i % len(ws)], None, HEADS, cos_sin, pos, cache, slots)
    if op == "linear_residual":
        res = torch.zeros((m, n), device=DEV, dtype=DT)
        return lambda i: ops.linear_residual(x, ws[i % len(ws)], res)
    if op == "norm_gate_up_silu":
        return lambda i: ops.norm_gate_up_silu(x, nw, 1e-5, ws[i % len(ws)])
    return lambda i: ops.norm_linear(x, nw, 1e-5, ws[i % len(ws)], None, torch.float32)


def tune_shape(name, op, n, k, bw, out, quick, current=False):
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5 for _ in range(copies)]
    calls = max(copies, 8)
    nbytes = n * k * 2
    screened = []
    listed = [decode_tuned.TUNED[(n, k)]] if current else QUICK[name] if quick else candidates(op, n, k)
    for cfg in listed:  # screened at T = 1, the best three at every T
        dl._TUNED[(n, k)] = cfg
        try:
            screened.append((graph_time(make_call(op, n, k, 1, ws, True), calls), cfg))
        except Exception as e:  # out of shared memory and the like: not a candidate
            print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
    rows = []
    for _, cfg in sorted(screened)[:3]:
        dl._TUNED[(n, k)] = cfg
        try:  # 64-row tiles need more shared memory than the 16-row ones screened
            tm = {m: graph_time(make_call(op, n, k, m, ws, True), calls) for m in ROWS}
        except Exception as e:
            print(f"  {name} {cfg} at T=64: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
            continue
        rows.append((sum(tm.values()), cfg, tm))
    rows.sort(key=lambda r: r[0])
    comp = {m: graph_time(make_call(op, n, k, m, ws, False), calls) for m in ROWS}

    def fmt(tm):
        return ", ".join(f"T={m} {v * 1e6:.1f} us ({nbytes / v / bw:.0%})" for m, v in tm.items())

    print(f"\n{name} {op} N={n} K={k} ({nbytes / 1e6:.1f} MB): composition (cuBLAS) {fmt(comp)}")
    for _, cfg, tm in rows[:4]:
        print(f"  {cfg}: {fmt(tm)}")
    best, tm = tuple(rows[0][1]) + (False,) * (7 - len(rows[0][1])), rows[0][2]
    dl._TUNED[(n, k)] = best
    faster = sum(tm[m] for m in NARROW) < sum(comp[m] for m in NARROW)
    wide = faster and all(tm[m] < comp[m] for m in ROWS if m not in NARROW)
    print(f"  best {best}: {'faster' if faster else 'SLOWER'} than the composition "
          f"({sum(tm[m] for m in NARROW) * 1e6:.1f} vs {sum(comp[m] for m in NARROW) * 1e6:.1f} us summed over "
          f"T={NARROW}); {'WIDE: faster at' if wide else 'not faster at every'} T > 32")
    same = invariant(op, n, k, ws[0])
    err = {m: parity(op, n, k, m, ws[0]) for m in (1, 64)}
    print(f"  row 0 bitwise equal at T = 1, 8, 17, 40, 64: {same}; |fused - composed| / |composed|: "
          + ", ".join(f"T={m} {e:.1e}" for m, e in err.items()))
    out[name] = {"invariant": same, "rel_err": err, "op": op, "n": n, "k": k, "config": best, "wide": wide,
                 "fused_us": {m: v * 1e6 for m, v in tm.items()},
                 "composed_us": {m: v * 1e6 for m, v in comp.items()},
                 "bw_frac": {m: nbytes / v / bw for m, v in tm.items()}, "faster": faster}


def invariant(op, n, k, w):
    """Row 0 of the op's output bitwise equal at T = 1, 8, 17, 40, 64 (row tiles 16, 16, 32, 64, 64)."""
    outs = [make_call(op, n, k, m, [w], True)(0)[0].clone() for m in (1, 8, 17, 40, 64)]
    return all(torch.equal(outs[0], o) for o in outs[1:])


def write_table(out):
    """Merge this run's best configs and verdicts into trtgraph/kernels/decode_tuned.py."""
    tuned, slower, wide = dict(decode_tuned.TUNED), set(decode_tuned.SLOWER), set(decode_tuned.WIDE)
    for v in out.values():
        if isinstance(v, dict):
            key = (v["op"], v["n"], v["k"])
            tuned[(v["n"], v["k"])] = tuple(v["config"])
            slower.discard(key)
            wide.discard(key)
            if not v["faster"]:
                slower.add(key)
            if v["wide"]:
                wide.add(key)
    path = pathlib.Path(decode_tuned.__file__)
    text = path.read_text()
    for name, body in (("TUNED", "".join(f"    {key!r}: {cfg!r},\n" for key, cfg in sorted(tuned.items()))),
                       ("SLOWER", "".join(f"    {key!r},\n" for key in sorted(slower))),
                       ("WIDE", "".join(f"    {key!r},\n" for key in sorted(wide)))):
        start = text.index(f"\n{name} = {{\n") + 1  # only this table: the light kernel's and TAIL stay
        end = text.index("}\n", start) + 2
        text = text[:start] + f"{name} = {{\n{body}}}\n" + text[end:]
    path.write_text(text)
    print(f"wrote {path}")


def parity(op, n, k, m, w):
    """Relative L2 difference of the fused op's output from the composition's, same inputs."""
    got, want = (make_call(op, n, k, m, [w], fused)(0).float() for fused in (True, False))
    return ((got - want).norm() / want.norm()).item()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick, write, current = "--quick" in sys.argv, "--write" in sys.argv, "--current" in sys.argv
    bw = measure_bandwidth(DEV)
    out = {"bandwidth_GBps": bw / 1e9}
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    dest = args[0] if args else "tune_decode.json"
    for name in args[1:] or SHAPES:
        tune_shape(name, *SHAPES[name], bw, out, quick, current)
        sys.stdout.flush()
        with open(dest, "w") as f:
            json.dump(out, f, indent=1)
        if write:  # after each shape, so a run cut short keeps what it measured
            write_table(out)
    tuned = {(v["n"], v["k"]): tuple(v["config"]) for v in out.values() if isinstance(v, dict)}
    print("\nTUNED = " + repr(tuned))
    slower = {(v["op"], v["n"], v["k"]) for v in out.values() if isinstance(v, dict) and not v["faster"]}
    print("SLOWER = " + repr(slower))


if __name__ == "__main__":
    main()
