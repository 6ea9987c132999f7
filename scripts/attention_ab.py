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
- `pdl`: attention PDL-launched on every decode key (block table read and its first K / V rows
  prefetched to L2 before it waits), the fused qkv letting it launch from its start, attention
  letting its successor launch from its own start;
- `pdl-no-prefetch`: `pdl` without the L2 prefetch; `pdl-no-trigger`: `pdl` with the tensor-core
  qkv not triggering early (bs 2-32: attention launches at the qkv's end); `pdl-fused-only`:
  PDL only after the fused qkv (bs 40-64, after cuBLAS, without).
- `pdl-late`, `pdl-late-no-prefetch`: `pdl` (without the prefetch) with attention letting its
  successor launch only once it has waited (ATTENTION_TRIGGER 2), not from its start (1);
  `shipped`: the tree's own settings.
- (eighth session, each with the shipped PDL settings) `before`: the adaptive decode configs of
  main 269f981 (no fold, no early first tile); `fold`: the step's key folded in from registers
  where RoPE runs inside attention; `fold-early`: and the first tile's pages read with the
  positions, its K / V before q; `fold-early-w4`: and 4 warps past two row programs per SM;
  `before-configs`: main 269f981's DECODE_ADAPTIVE (no fold, 128-key tiles up to two row programs
  per SM, then 64-key tiles on 2 warps) on this tree's kernel: the step before this branch;
  `picked` (with A8_PICK=PICK.json from scripts/attention_pick.py): the configs a sweep picked.
Usage: python scripts/attention_ab.py OUT.json [CONFIG.yaml] [VARIANT ...] [--batches 1,8,...]"""

import dataclasses
import importlib
import json
import os
import sys

from trtgraph.bench import measure_bandwidth
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.config import Config
from trtgraph.kernels import attention
from trtgraph.kernels import attention_config as acfg
from trtgraph.kernels import decode_linear as dl
from trtgraph.runtime.step.executor import Executor

sys.path.insert(0, "scripts")
from decode_ablation import floor_ms, kernels_per_step, measure  # noqa: E402

BATCHES = (1, 8, 32, 64)
ALL, NONE = {"decode": 64, "rope": 64}, {"decode": 0, "rope": 0}
PDL_ON = dict(attention_pdl=ALL, trigger=frozenset({dl._ROPE}), prefetch=True, attn_trigger=1)
FLAGS = {"old": {**PDL_ON, "attention_pdl": NONE}, "kernel": {**PDL_ON, "attention_pdl": NONE},
         "new": {**PDL_ON, "attention_pdl": NONE, "trigger": frozenset()},
         "pdl": PDL_ON, "pdl-no-prefetch": {**PDL_ON, "prefetch": False},
         "pdl-no-trigger": {**PDL_ON, "trigger": frozenset(), "batches": (8, 32)},
         "pdl-fused-only": {**PDL_ON, "attention_pdl": {"decode": 64, "rope": 0}, "batches": (64,)},
         "pdl-late": {**PDL_ON, "attn_trigger": 2},
         "pdl-late-no-prefetch": {**PDL_ON, "attn_trigger": 2, "prefetch": False},
         "shipped": {"attention_pdl": dict(acfg.ATTENTION_PDL), "trigger": dl._TRIGGER_MODES,
                     "prefetch": acfg.PREFETCH_KV, "attn_trigger": acfg.ATTENTION_TRIGGER}}
SHIPPED_ADAPTIVE = acfg.DECODE_ADAPTIVE
FLAGS.update({"before": {**FLAGS["shipped"], "override": {"fold": False, "early": False}},
              "fold": {**FLAGS["shipped"], "override": {"fold": True, "early": False}},
              "fold-early": {**FLAGS["shipped"], "override": {"fold": True, "early": True}},
              "fold-early-w4": {**FLAGS["shipped"], "override": {"fold": True, "early": True},
                                "adaptive": (SHIPPED_ADAPTIVE[0], (None, {**SHIPPED_ADAPTIVE[1][1], "warps": 4}))},
              "before-configs": {**FLAGS["shipped"], "adaptive": (
                  (2, dict(block_n=128, piece_tiles=2, warps=4, stages=3)),
                  (None, dict(block_n=64, piece_tiles=4, warps=2, stages=3)))}})
if os.environ.get("A8_PICK"):  # `picked`: attention_pick.py's DECODE_ADAPTIVE from a sweep of the same call
    FLAGS["picked"] = {**FLAGS["shipped"], "adaptive": tuple(
        (most, cfg) for most, cfg in json.load(open(os.environ["A8_PICK"]))["adaptive"])}


def install(ex, name, shipped):
    flags = FLAGS[name]
    acfg.ATTENTION_PDL = flags["attention_pdl"]
    acfg.PREFETCH_KV = flags["prefetch"]
    dl._TRIGGER_MODES = flags["trigger"]
    acfg.ATTENTION_TRIGGER = flags["attn_trigger"]
    acfg.DECODE_OVERRIDE.clear()
    acfg.DECODE_OVERRIDE.update(flags.get("override", {}))
    acfg.DECODE_ADAPTIVE = flags.get("adaptive", SHIPPED_ADAPTIVE)
    ops = shipped
    if name in ("old", "kernel"):
        ops = dataclasses.replace(ops, rope_in_attention=lambda *a: False)
    if name == "old":
        old = importlib.import_module("trtgraph.kernels.attention_old")
        old.set_attention_invariant(acfg._INVARIANT_ATTENTION[0])
        ops = dataclasses.replace(ops, paged_attention=old.paged_attention)
    ex.loaded.model.ops = ops


def main():
    only = BATCHES
    if "--batches" in sys.argv:  # --batches 1,8: only these batch sizes of every variant
        at = sys.argv.index("--batches")
        only = tuple(int(b) for b in sys.argv[at + 1].split(","))
        del sys.argv[at:at + 2]
    out_path = sys.argv[1]
    cfg = Config.from_yaml(sys.argv[2] if len(sys.argv) > 2 else "examples/llama-3.2-1b-synthetic.yaml")
    keys = {b: GraphKey(b, 0, 0, "greedy") for b in only}
    ex = Executor.build(cfg, BucketPlan.from_config(cfg).with_keys(list(keys.values())))
    shipped = ex.loaded.model.ops
    bw = measure_bandwidth(ex.device) if ex.device.type == "cuda" else 1e12
    floors = {b: floor_ms(ex, b, bw) for b in keys}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; floor ms: " + ", ".join(f"bs {b} {v:.3f}" for b, v in floors.items()),
          flush=True)
    for key in keys.values():
        ex.warmup(key)
    results = {"floor_ms": floors, "bandwidth_GBps": bw / 1e9}
    names = sys.argv[3:] or ["new", "pdl"]
    for i, name in enumerate(names + names[::-1]):
        install(ex, name, shipped)
        tag = f"{name}#{1 + (i >= len(names))}"
        batches = [b for b in FLAGS[name].get("batches", BATCHES) if b in keys]
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
