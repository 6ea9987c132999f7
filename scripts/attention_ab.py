"""The replayed decode step of Llama-3.2-1B shapes (bf16, 128 cached tokens, greedy) with one
attention change at a time, interleaved (decode_ablation.py's pattern: each variant captured
afresh for every key, timed as `trtgraph bench` times a replay, the sequence forwards then
backwards, each replay's logits bitwise against the eager run of the same variant, kernels per
step at bs 1 and 64 from one eager step):
- `old`: the attention kernel of trtgraph/kernels/attention_old.py (an older attention.py copied
  in beside for the A/B, not committed), RoPE + KV write in their own kernel (or the fused qkv's);
- `kernel`: the attention kernel, RoPE + KV write in their own kernel;
- `new`: the step before PDL-launched attention: RoPE + KV write inside attention where the qkv
  is not one fused kernel (bs 40-64 on the 1B), attention launched without PDL;
- `pdl`: the shipped step: attention PDL-launched on decode keys (block table read and its first
  K / V rows prefetched to L2 before it waits), the fused qkv letting it launch from its start;
- `pdl-no-prefetch`: `pdl` without the L2 prefetch; `pdl-no-trigger`: `pdl` with the tensor-core
  qkv not triggering early (bs 2-32: attention launches at the qkv's end); `pdl-fused-only`:
  PDL only after the fused qkv (bs 40-64, after cuBLAS, without).
Usage: python scripts/attention_ab.py OUT.json [CONFIG.yaml] [VARIANT ...]"""

import dataclasses
import importlib
import json
import sys

from trtgraph.bench import measure_bandwidth
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.config import Config
from trtgraph.kernels import attention
from trtgraph.kernels import decode_linear as dl
from trtgraph.runtime.step.executor import Executor

sys.path.insert(0, "scripts")
from decode_ablation import floor_ms, kernels_per_step, measure  # noqa: E402

BATCHES = (1, 8, 32, 64)
PDL_ON = dict(attention_pdl=frozenset({"decode", "rope"}), trigger=frozenset({dl._ROPE}), prefetch=True)
FLAGS = {"old": {**PDL_ON, "attention_pdl": frozenset()}, "kernel": {**PDL_ON, "attention_pdl": frozenset()},
         "new": {**PDL_ON, "attention_pdl": frozenset(), "trigger": frozenset()},
         "pdl": PDL_ON, "pdl-no-prefetch": {**PDL_ON, "prefetch": False},
         "pdl-no-trigger": {**PDL_ON, "trigger": frozenset(), "batches": (8, 32)},
         "pdl-fused-only": {**PDL_ON, "attention_pdl": frozenset({"decode"}), "batches": (64,)}}


def install(ex, name, shipped):
    flags = FLAGS[name]
    attention.ATTENTION_PDL = flags["attention_pdl"]
    attention.PREFETCH_KV = flags["prefetch"]
    dl._TRIGGER_MODES = flags["trigger"]
    ops = shipped
    if name in ("old", "kernel"):
        ops = dataclasses.replace(ops, rope_in_attention=lambda *a: False)
    if name == "old":
        old = importlib.import_module("trtgraph.kernels.attention_old")
        old.set_attention_invariant(attention._INVARIANT_ATTENTION[0])
        ops = dataclasses.replace(ops, paged_attention=old.paged_attention)
    ex.loaded.model.ops = ops


def main():
    out_path = sys.argv[1]
    cfg = Config.from_yaml(sys.argv[2] if len(sys.argv) > 2 else "examples/llama-3.2-1b-synthetic.yaml")
    keys = {b: GraphKey(b, 0, 0, "greedy") for b in BATCHES}
    ex = Executor.build(cfg, BucketPlan.from_config(cfg).with_keys(list(keys.values())))
    shipped = ex.loaded.model.ops
    bw = measure_bandwidth(ex.device) if ex.device.type == "cuda" else 1e12
    floors = {b: floor_ms(ex, b, bw) for b in BATCHES}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; floor ms: " + ", ".join(f"bs {b} {v:.3f}" for b, v in floors.items()),
          flush=True)
    for key in keys.values():
        ex.warmup(key)
    results = {"floor_ms": floors, "bandwidth_GBps": bw / 1e9}
    names = sys.argv[3:] or ["new", "pdl"]
    for i, name in enumerate(names + names[::-1]):
        install(ex, name, shipped)
        tag = f"{name}#{1 + (i >= len(names))}"
        batches = FLAGS[name].get("batches", BATCHES)
        try:
            results[tag] = {b: measure(ex, keys[b]) for b in batches}
            if i < len(names) and ex.device.type == "cuda" and name in ("old", "kernel"):
                results[tag + " kernels"] = {b: kernels_per_step(ex, keys[b]) for b in (1, 64)}
                print(f"{tag:12s} kernels per step: {results[tag + ' kernels']}", flush=True)
        except Exception as e:  # a variant that does not run is a result too
            results[tag] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"{tag:12s} " + "  ".join(f"bs {b}: {r[0]:.3f} ms ({r[0] / floors[b]:.2f}x)"
                                       f"{'' if r[1] else ' REPLAY != EAGER'}"
                                       for b, r in results[tag].items() if b != "error")
              + results[tag].get("error", ""), flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
