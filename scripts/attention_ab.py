"""The replayed decode step of Llama-3.2-1B shapes (bf16, 128 cached tokens, greedy) with the
old attention against the new, interleaved (decode_ablation.py's pattern: each variant captured
afresh for every key, timed as `trtgraph bench` times a replay, the sequence forwards then
backwards, each replay's logits bitwise against the eager run of the same variant, kernels per
step at bs 1 and 64 from one eager step):
- `old`: the attention kernel of trtgraph/kernels/attention_old.py (main 09b623b's, copied in
  beside for the A/B, not committed), RoPE + KV write in their own kernel (or the fused qkv's);
- `kernel`: the new attention kernel, RoPE + KV write still in their own kernel;
- `new`: the shipped step: the new kernel, RoPE + KV write inside it where the qkv is not one
  fused kernel (bs 40-64 on the 1B).
Usage: python scripts/attention_ab.py OUT.json [CONFIG.yaml] [VARIANT ...]"""

import dataclasses
import importlib
import json
import sys

from trtgraph.bench import measure_bandwidth
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.config import Config
from trtgraph.kernels import attention
from trtgraph.runtime.step.executor import Executor

sys.path.insert(0, "scripts")
from decode_ablation import floor_ms, kernels_per_step, measure  # noqa: E402

BATCHES = (1, 8, 32, 64)


def install(ex, name, shipped):
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
    names = sys.argv[3:] or ["old", "kernel", "new"]
    for i, name in enumerate(names + names[::-1]):
        install(ex, name, shipped)
        tag = f"{name}#{1 + (i >= len(names))}"
        try:
            results[tag] = {b: measure(ex, keys[b]) for b in BATCHES}
            if i < len(names) and ex.device.type == "cuda":
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
