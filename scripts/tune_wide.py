"""Tune the fused decode GEMVs for steps of 33-64 rows (64-row tiles) on their own: one config
per Llama-3.2-1B layer shape (bf16) for those steps (decode_tuned.TUNED_WIDE, installed with
`deterministic` off), screened at 64 rows, not at one row as scripts/tune_decode_linear.py
screens the configs every row count shares.

Per shape: the candidates (tile width, K step, split, warps, depth, stacked paired rows, PRENORM
for the ops with a norm) are compiled first by a pool of worker processes (Triton's cache on
disk; compiling is most of the cost, and the device machine has 16 cores), then each is timed
in a CUDA graph at T = 64 (the weight copies defeat L2, as in the other tuners); the best four
are timed at T = 40 too, against the shape's config today and the composition (Triton RMSNorm,
cuBLAS, SiLU-mul / RoPE + KV write, addmm_ for the residual). Alone, not in the step: the
composition's RoPE + KV write runs inside attention in the real step, so the replayed step
(scripts/decode_ablation.py `tile64*`) decides what ships.
`--write`: every shape's best config into decode_tuned.TUNED_WIDE (a config only: a shape runs it
where it is also in decode_tuned.WIDE, which this script does not change).
Usage: python scripts/tune_wide.py OUT.json [--write] [--workers N] [SHAPE ...]
"""

import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_decode_linear import SHAPES, make_call  # noqa: E402
from tune_linear import graph_time  # noqa: E402

from trtgraph.bench import measure_bandwidth  # noqa: E402
from trtgraph.kernels import decode_linear as dl  # noqa: E402
from trtgraph.kernels import decode_tuned  # noqa: E402

DEV = torch.device("cuda")
DT = torch.bfloat16
ROWS = (64, 40)
BUDGET = 190 << 10  # shared memory a program may stage (one program per SM)


def candidates(op: str, n: int, k: int) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, stack, prenorm): grids of 64-300 programs."""
    pairs = 2 if op in ("norm_qkv_rope", "norm_gate_up_silu") else 1
    norm = op != "linear_residual"
    cols = n // pairs
    out = []
    for bn in (32, 64, 128):
        tiles = -(-cols // bn)
        for split in (1, 2, 4, 8, 16):
            if not 64 <= tiles * split <= 300 or k // split < 128:
                continue
            for bk in ((64, 128) if bn == 128 else (128, 256)):
                if k // split < bk:
                    continue
                for stack in ((False, True) if pairs == 2 and bn <= 64 else (False,)):
                    rows = (pairs * bn if stack or pairs == 2 else bn)
                    stages = min(5, BUDGET // ((rows + 64) * bk * 2))
                    if stages < 2:
                        continue
                    warps = 8 if (stack and bn == 64) or bn == 128 else 4
                    for prenorm in ((False, True) if norm else (False,)):
                        out.append((bn, bk, split, warps, stages, stack, prenorm))
    return out


_WEIGHTS: dict = {}


def _compile(name: str, cfg: tuple) -> tuple[str, tuple, str]:
    """Worker: run the op once at every ROWS with cfg installed for 64-row tiles (compiles it)."""
    op, n, k = SHAPES[name]
    if name not in _WEIGHTS:
        _WEIGHTS[name] = [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5]
    dl._TUNED_WIDE[(n, k)] = cfg
    try:
        for m in ROWS:
            make_call(op, n, k, m, _WEIGHTS[name], True)(0)
        torch.cuda.synchronize()
        return name, cfg, ""
    except Exception as e:  # out of shared memory and the like: not a candidate
        return name, cfg, f"{type(e).__name__}: {str(e)[:120]}"


def precompile(jobs: list[tuple[str, tuple]], workers: int) -> dict:
    """{(name, cfg): error or ""} after compiling every job in `workers` processes."""
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        return {(nm, cfg): err for nm, cfg, err in pool.map(_compile, *zip(*jobs), chunksize=1)}


def tune_shape(name: str, listed: list[tuple], errors: dict, bw: float, out: dict) -> None:
    op, n, k = SHAPES[name]
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5 for _ in range(copies)]
    calls, nbytes = max(copies, 8), n * k * 2

    def timed(cfg, m, fused=True):
        dl._TUNED_WIDE.pop((n, k), None)
        if cfg is not None:
            dl._TUNED_WIDE[(n, k)] = cfg
        try:
            return graph_time(make_call(op, n, k, m, ws, fused), calls)
        finally:
            dl._TUNED_WIDE.pop((n, k), None)

    def fmt(tm):
        return ", ".join(f"T={m} {v * 1e6:.1f} us ({nbytes / v / bw:.0%})" for m, v in tm.items())

    comp = {m: timed(None, m, False) for m in ROWS}
    today = {m: timed(None, m) for m in ROWS}
    screened = []
    for cfg in listed:
        if errors.get((name, cfg)):
            continue
        try:
            screened.append((timed(cfg, 64), cfg))
        except Exception as e:
            print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
    rows = sorted((sum(tm.values()), cfg, tm) for cfg, tm in
                  ((cfg, {m: timed(cfg, m) for m in ROWS}) for _, cfg in sorted(screened)[:4]))
    print(f"\n{name} {op} N={n} K={k} ({nbytes / 1e6:.1f} MB), {len(screened)} of {len(listed)} candidates ran:\n"
          f"  composition {fmt(comp)}\n  today's config {decode_tuned.TUNED.get((n, k))} {fmt(today)}")
    for _, cfg, tm in rows:
        print(f"  {cfg}: {fmt(tm)}")
    if not rows:
        return
    best, tm = rows[0][1], rows[0][2]
    got = make_call(op, n, k, 64, ws[:1], True)
    dl._TUNED_WIDE[(n, k)] = best
    new = got(0).float()
    dl._TUNED_WIDE.pop((n, k), None)
    want = make_call(op, n, k, 64, ws[:1], False)(0).float()
    err = ((new - want).norm() / want.norm()).item()
    beats = {m: tm[m] < comp[m] for m in ROWS}
    print(f"  best {best}: {'beats' if all(beats.values()) else 'does not beat'} the composition at T = 40 and 64; "
          f"|fused - composed| / |composed| at T=64: {err:.1e}", flush=True)
    out[name] = {"op": op, "n": n, "k": k, "config": list(best), "rel_err": err,
                 "fused_us": {m: v * 1e6 for m, v in tm.items()}, "today_us": {m: v * 1e6 for m, v in today.items()},
                 "composed_us": {m: v * 1e6 for m, v in comp.items()},
                 "bw_frac": {m: nbytes / v / bw for m, v in tm.items()},
                 "top": [[list(cfg), {m: v * 1e6 for m, v in t.items()}] for _, cfg, t in rows]}


def write_table(out: dict) -> None:
    """Rewrite decode_tuned.TUNED_WIDE with this run's best configs (others kept)."""
    table = dict(decode_tuned.TUNED_WIDE)
    for v in out.values():
        if isinstance(v, dict) and "config" in v:
            table[(v["n"], v["k"])] = tuple(v["config"])
    path = pathlib.Path(decode_tuned.__file__)
    text = path.read_text()
    start = text.index("TUNED_WIDE = {")
    end = text.index("}\n", start) + 2
    body = "TUNED_WIDE = {\n" + "".join(f"    {key!r}: {cfg!r},\n" for key, cfg in sorted(table.items())) + "}\n"
    path.write_text(text[:start] + body + text[end:])
    print(f"wrote {path}")


def main() -> None:
    argv = sys.argv[1:]
    workers = 12
    if "--workers" in argv:
        at = argv.index("--workers")
        workers = int(argv[at + 1])
        del argv[at:at + 2]
    write = "--write" in argv
    args = [a for a in argv if not a.startswith("--")]
    dest = args[0] if args else "tune_wide.json"
    names = args[1:] or ["qkv", "o", "gate_up", "down"]
    listed = {nm: candidates(*SHAPES[nm]) for nm in names}
    jobs = [(nm, cfg) for nm in names for cfg in listed[nm]]
    print(f"{len(jobs)} candidates: " + ", ".join(f"{nm} {len(c)}" for nm, c in listed.items()), flush=True)
    errors = precompile(jobs, workers)
    print("compiled; failed: " + (", ".join(f"{nm} {cfg} {e}" for (nm, cfg), e in errors.items() if e) or "none"),
          flush=True)
    bw = measure_bandwidth(DEV)
    out = {"bandwidth_GBps": bw / 1e9}
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for nm in names:
        tune_shape(nm, listed[nm], errors, bw, out)
        with open(dest, "w") as f:
            json.dump(out, f, indent=1)
    if write:
        write_table(out)


if __name__ == "__main__":
    main()
