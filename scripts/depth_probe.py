"""Deeper weight pipelines for the fused decode GEMVs (kernels/decode_linear.py): Nsight Compute
put the 64-row gate_up at 59% of DRAM peak with one program per SM and two weight stages in
flight (shared memory the limit), 72% at 8 rows. Here each Llama-3.2-1B shape's config today
against the same tile with 64-wide K steps and more stages (more bytes in flight for the same
shared memory), and against deeper pipelines past the 85% shared-memory budget of
`decode_occupancy.fit_stages` (`+`: 95%), each timed alone in a CUDA graph (weight copies defeat L2) at 8, 32
and 64 rows (64 only for the shapes fused up to 64 rows). Candidates compile first in a pool of
processes. Usage: python scripts/depth_probe.py OUT.json [SHAPE ...]
"""

import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_decode_linear import SHAPES, make_call  # noqa: E402
from tune_linear import graph_time  # noqa: E402

from trtgraph.bench import measure_bandwidth  # noqa: E402
from trtgraph.kernels import decode_linear as dl  # noqa: E402
from trtgraph.kernels import decode_occupancy as occ  # noqa: E402
from trtgraph.kernels import decode_tuned  # noqa: E402

DEV, DT = torch.device("cuda"), torch.bfloat16
CANDIDATES = {  # (config, wider shared-memory budget); second round (after 0b7dbd4): gate_up's neighbours
    "gate_up": [((64, 128, 1, 8, 3, True), False), ((32, 64, 1, 4, 6, True), False), ((32, 64, 1, 4, 7, True), False),
                ((32, 128, 1, 4, 4, True), False), ((64, 64, 1, 8, 5, True), False), ((64, 64, 2, 8, 6, True), False),
                ((64, 64, 1, 4, 6, True), False), ((64, 32, 1, 8, 10, True), False)],
    "down": [((64, 64, 4, 4, 6), False), ((32, 128, 8, 4, 5), False), ((64, 128, 8, 4, 5), False)],
    "qkv": [((64, 64, 4, 8, 5, True), False), ((32, 128, 4, 4, 5, True), False)],
}
WIDE_ROWS = {"gate_up": (8, 32, 64), "lm_head": (8, 32, 64)}


def install(name, cfg, wide):
    op, n, k = SHAPES[name]
    dl._TUNED[(n, k)] = cfg
    full = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    occ.shared_memory_bytes = (lambda index: int(full * 0.95 / 0.85)) if wide else (lambda index: full)


def rows_of(name):
    return WIDE_ROWS.get(name, (8, 32))


def _compile(name, cfg, wide):
    op, n, k = SHAPES[name]
    w = [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5]
    install(name, cfg, wide)
    try:
        for m in rows_of(name):
            make_call(op, n, k, m, w, True)(0)
        torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:120]}"


def main():
    args = sys.argv[1:]
    dest, names = args[0], args[1:] or list(CANDIDATES)
    jobs = [(nm, tuple(decode_tuned.TUNED[SHAPES[nm][1:]]), False) for nm in names]
    jobs += [(nm, cfg, wide) for nm in names for cfg, wide in CANDIDATES[nm]]
    with cf.ProcessPoolExecutor(14, mp_context=mp.get_context("spawn")) as pool:
        errors = dict(zip(jobs, pool.map(_compile, *zip(*jobs))))
    bw = measure_bandwidth(DEV)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; compile errors: "
          + (", ".join(f"{j}: {e}" for j, e in errors.items() if e) or "none"), flush=True)
    out = {"bandwidth_GBps": bw / 1e9}
    for nm in names:
        op, n, k = SHAPES[nm]
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5 for _ in range(copies)]
        print(f"\n{nm} N={n} K={k} ({n * k * 2 / 1e6:.1f} MB)")
        for job in [j for j in jobs if j[0] == nm]:
            if errors[job]:
                continue
            install(*job)
            tm = {m: graph_time(make_call(op, n, k, m, ws, True), max(copies, 8)) for m in rows_of(nm)}
            tag = f"{job[1]}{'+' if job[2] else ''}{' (today)' if job is jobs[names.index(nm)] else ''}"
            print(f"  {tag:42s} " + "  ".join(f"T={m} {v * 1e6:6.1f} us ({n * k * 2 / v / bw:.0%})"
                                              for m, v in tm.items()), flush=True)
            out[f"{nm} {tag}"] = {m: v * 1e6 for m, v in tm.items()}
        with open(dest, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
