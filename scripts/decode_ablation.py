"""The replayed decode step of Llama-3.2-1B shapes (bf16, 128 cached tokens) with one change at
a time: how the o / down residual add runs past the fused GEMVs' rows, which shapes run the
fused GEMVs up to 64 rows (decode_tuned.WIDE), and programmatic dependent launch (PDL) per op.

Variants (each captured afresh for every key, timed as `trtgraph bench` times a replay):
- `separate-add`: the composition adds the residual in its own kernel (main 5b27c9f's step);
- `epilogue`: the add rides in the GEMM (cuBLAS addmm_ in place), 32 fused rows everywhere;
- `wide`: `epilogue` + the WIDE shapes fused up to 64 rows (no PDL);
- `pdl`: `wide` + PDL for every fused op, `pdl-<op>`: for that op alone, `pdl-no-prefetch`:
  every op, waiting at the start with no L2 prefetch.
Each replay's logits are checked bitwise against the eager run of the same variant.
Usage: python scripts/decode_ablation.py OUT.json [CONFIG.yaml]
"""

import dataclasses
import json
import statistics
import sys

import torch

from trtgraph.bench import _timed, decode_rows, measure_bandwidth
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.config import Config
from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels import linear as lin
from trtgraph.kernels import triton_ops as t
from trtgraph.kernels.composed import compose
from trtgraph.runtime.step.executor import Executor

BATCHES = (1, 8, 32, 40, 64)
ALL = frozenset({dl._PLAIN, dl._RESIDUAL, dl._SILU, dl._ROPE})
OPS = {"qkv": dl._ROPE, "o_down": dl._RESIDUAL, "gate_up": dl._SILU, "lm_head": dl._PLAIN}
WIDE = set(dl._WIDE)
# name: (residual add in the GEMM, WIDE shapes, PDL modes, prefetch bytes, batches)
VARIANTS = {"separate-add": (False, set(), frozenset(), 0, BATCHES),
            "epilogue": (True, set(), frozenset(), 0, BATCHES),
            "wide": (True, WIDE, frozenset(), 0, BATCHES),
            "pdl": (True, WIDE, ALL, dl._PREFETCH_BYTES, BATCHES),
            "pdl-no-prefetch": (True, WIDE, ALL, 0, (1, 64)),
            **{f"pdl-{name}": (True, WIDE, frozenset({mode}), dl._PREFETCH_BYTES, (1, 64))
               for name, mode in OPS.items()}}


def install(ex, epilogue, wide, pdl, prefetch):
    dl._WIDE, dl._PDL_MODES, dl._PREFETCH_BYTES = set(wide), frozenset(pdl), prefetch
    fused = compose(t.rms_norm, lin.linear, t.silu_and_mul, t.rope_write_kv, lin.linear_residual if epilogue else None)
    ex.loaded.model.ops = dataclasses.replace(ex.loaded.model.ops, **dl.dispatch(fused)._asdict())


def floor_ms(ex, batch, bw):
    """The bench's floor: the weights and the cached K/V read once at the copy bandwidth."""
    cfg, elt = ex.loaded.config, ex.loaded.model.lm_head_weight.element_size()
    kv_bytes = batch * 129 * cfg.num_layers * 2 * cfg.kv_size * elt
    return (cfg.parameter_count() * elt + kv_bytes) / bw * 1e3


def measure(ex, key):
    ex.runner._graphs.pop(key, None)  # re-record this variant's graph
    ex.capture(key)
    ex.prepare(key, decode_rows(ex, key.batch_size, 128))
    with torch.inference_mode():
        replay = ex.execute(key).logits.clone()
        eager = ex.execute(key, eager=True).logits.clone()
        ms = statistics.median(_timed(ex.device, lambda: ex.execute(key), 20) for _ in range(5)) * 1e3
    return ms, bool(torch.equal(replay, eager))


def main():
    out_path = sys.argv[1]
    cfg = Config.from_yaml(sys.argv[2] if len(sys.argv) > 2 else "examples/llama-3.2-1b-synthetic.yaml")
    keys = {b: GraphKey(b, 0, 0, "greedy") for b in BATCHES}
    ex = Executor.build(cfg, BucketPlan.from_config(cfg).with_keys(list(keys.values())))
    bw = measure_bandwidth(ex.device) if ex.device.type == "cuda" else 1e12
    floors = {b: floor_ms(ex, b, bw) for b in BATCHES}
    print(f"choice: {dl.installed_choice()}\nbackends: {lin.installed_backends()}\ncopy bandwidth "
          f"{bw / 1e9:.0f} GB/s; floor ms: " + ", ".join(f"bs {b} {v:.3f}" for b, v in floors.items()), flush=True)
    for key in keys.values():
        ex.warmup(key)
    results = {"floor_ms": floors, "bandwidth_GBps": bw / 1e9}
    for name, (epilogue, wide, pdl, prefetch, batches) in VARIANTS.items():
        install(ex, epilogue, wide, pdl, prefetch)
        try:
            results[name] = {b: measure(ex, keys[b]) for b in batches}
        except Exception as e:  # a variant that does not run is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"{name:18s} " + "  ".join(f"bs {b}: {v[0]:.3f} ms ({v[0] / floors[b]:.2f}x)"
                                         f"{'' if v[1] else ' REPLAY != EAGER'}"
                                         for b, v in results[name].items() if b != "error")
              + results[name].get("error", ""), flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
