"""The replayed decode step of Llama-3.2-1B shapes (bf16, 128 cached tokens) with weights put on
their way to L2 by a side-stream kernel (kernels/prefetch.py) while latency-bound ops run, one
variant at a time, interleaved (forwards then backwards), each replay's logits checked bitwise
against the same variant's eager run:
- `base`: the shipped step;
- `o`: after each layer's qkv op, the o projection's weights prefetched beside attention;
- `o-guN`: the same plus the first N MB of gate_up's;
- `qkv`: after each gate_up op, the next layer's qkv weights prefetched beside down;
- `o-gu16-qkv`: both.
The forward is the model's own ops in the same order (attention's qkv, attention, o + residual,
norm + gate_up + SiLU, down + residual), with the forks between them; an experiment, not the
product's path.
Usage: python scripts/prefetch_ab.py OUT.json [CONFIG.yaml] [VARIANT ...] [--batches 1,8,...]
"""

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_ablation import floor_ms, kernels_per_step, measure  # noqa: E402

from trtgraph.bench import measure_bandwidth  # noqa: E402
from trtgraph.buckets import BucketPlan, GraphKey  # noqa: E402
from trtgraph.config import Config  # noqa: E402
from trtgraph.kernels.prefetch import prefetch_l2  # noqa: E402
from trtgraph.models import llama  # noqa: E402

MB = 1 << 20
VARIANTS = {"base": None, "o": dict(gu=0, qkv=False), "o-gu16": dict(gu=16 * MB, qkv=False),
            "o-gu32": dict(gu=32 * MB, qkv=False), "qkv": dict(gu=None, qkv=True), "o-gu16-qkv": dict(gu=16 * MB, qkv=True)}
ORIGINAL = llama.CausalLM.forward


def patched(v: dict):
    side = torch.cuda.Stream()

    def fork(*args, **kw):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch_l2(*args, **kw)

    def layer(self, i, h, positions, kv_cache, meta, ops):
        attn, mlp, norm = self.layers[i].self_attn, self.layers[i].mlp, self.layers[i].post_attention_layernorm
        ln, T, heads, w = self.layers[i].input_layernorm, h.shape[0], attn.heads(), attn.qkv_proj.weight
        slots = meta.slot_mapping[:T]
        if ops.rope_in_attention(w, T, meta.q_len, heads):
            q, k, vv = ops.norm_qkv(h, ln.weight, ln.eps, w, attn.qkv_proj.bias, heads)
            if v["gu"] is not None:
                fork(attn.o_proj.weight, mlp.gate_up_proj.weight, v["gu"])
            out = ops.rope_paged_attention(q, k, vv, self.cos_sin, positions, kv_cache, slots, meta.block_tables,
                                           meta.q_len, attn.scale)
        else:
            q = ops.norm_qkv_rope(h, ln.weight, ln.eps, w, attn.qkv_proj.bias, heads, self.cos_sin, positions,
                                  kv_cache, slots)
            if v["gu"] is not None:
                fork(attn.o_proj.weight, mlp.gate_up_proj.weight, v["gu"])
            out = ops.paged_attention(q, kv_cache, meta.block_tables, positions, meta.q_len, attn.scale)
        out = out.reshape(T, attn.cfg.q_size)
        h = ops.linear_residual(out, attn.o_proj.weight, h)
        act = ops.norm_gate_up_silu(h, norm.weight, norm.eps, mlp.gate_up_proj.weight)
        if v["qkv"] and i + 1 < len(self.layers):
            fork(self.layers[i + 1].self_attn.qkv_proj.weight)
        return ops.linear_residual(act, mlp.down_proj.weight, h)

    def forward(self, input_ids, positions, meta):
        h = self.embed(input_ids)
        for i, kv_cache in enumerate(meta.kv_caches):
            h = layer(self, i, h, positions, kv_cache, meta, self.ops)
        torch.cuda.current_stream().wait_stream(side)
        return h
    return forward


def main():
    from trtgraph.runtime.step.executor import Executor

    only = (1, 8, 32, 40, 64)
    if "--batches" in sys.argv:
        at = sys.argv.index("--batches")
        only = tuple(int(b) for b in sys.argv[at + 1].split(","))
        del sys.argv[at:at + 2]
    out_path = sys.argv[1]
    cfg = Config.from_yaml(sys.argv[2] if len(sys.argv) > 2 else "examples/llama-3.2-1b-synthetic.yaml")
    keys = {b: GraphKey(b, 0, 0, "greedy") for b in only}
    ex = Executor.build(cfg, BucketPlan.from_config(cfg).with_keys(list(keys.values())))
    bw = measure_bandwidth(ex.device)
    floors = {b: floor_ms(ex, b, bw) for b in keys}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; floor ms: " + ", ".join(f"bs {b} {v:.3f}" for b, v in floors.items()),
          flush=True)
    for key in keys.values():
        ex.warmup(key)
    results = {"floor_ms": floors, "bandwidth_GBps": bw / 1e9}
    names = sys.argv[3:] or list(VARIANTS)
    for i, name in enumerate(names + names[::-1]):
        v = VARIANTS[name]
        llama.CausalLM.forward = ORIGINAL if v is None else patched(v)
        tag = f"{name}#{1 + (i >= len(names))}"
        try:
            results[tag] = {b: measure(ex, keys[b]) for b in keys}
            if i < len(names):
                counts = {b: kernels_per_step(ex, keys[b]) for b in (1, 64) if b in keys}
                results[tag + " kernels"] = counts
        except Exception as e:  # a variant that does not run is a result too
            results[tag] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"{tag:14s} " + "  ".join(f"bs {b}: {r[0]:.3f} ms ({r[0] / floors[b]:.2f}x)"
                                       f"{'' if r[1] else ' REPLAY != EAGER'}"
                                       for b, r in results[tag].items() if b != "error")
              + results[tag].get("error", ""), flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    print("medians of the two passes:")
    for name in names:
        a, b = results.get(f"{name}#1", {}), results.get(f"{name}#2", {})
        if "error" not in a and "error" not in b:
            print(f"  {name:12s} " + "  ".join(f"bs {k}: {statistics.mean([a[k][0], b[k][0]]):.3f}" for k in a))


if __name__ == "__main__":
    main()
