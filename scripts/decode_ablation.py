"""The replayed decode step of Llama-3.2-1B shapes (bf16, 128 cached tokens) with one change at
a time: how the o / down residual add runs past the fused GEMVs' rows, which shapes run the
fused GEMVs up to 64 rows (decode_tuned.WIDE), the tuned table, and programmatic dependent
launch (PDL) per op.

Variants (each captured afresh for every key, timed as `trtgraph bench` times a replay; the
sequence runs forwards then backwards, so a drift over the run shows as a difference between
a variant's two results):
- `main`: main 5b27c9f's step: its tuned table, every shape fused up to 32 rows, the
  composition's residual add in its own kernel;
- `separate-add`: today's table and choice, the residual add in its own kernel;
- `epilogue`: the add rides in the GEMM (cuBLAS addmm_ in place), 32 fused rows everywhere;
- `new`: `epilogue` + the WIDE shapes fused up to 64 rows: the shipped default (no PDL);
- `new-o-fused`: `new` with the o projection fused too (the table says the composition);
- `pdl`: `new` + PDL for every fused op, `pdl-<op>`: for that op alone, `pdl-no-prefetch`:
  every op, waiting at the start with no L2 prefetch;
- `one-per-sm`: `new` with the LM head's tuned depth at 32 and 64-row tiles
  (decode_occupancy.TWO_PER_SM off), at bs 32-64;
- `main81`: main 81adfc0's kernels (`one-per-sm`, the LM head normed in every program);
  `no-prenorm`: `new` with that LM head; `wide-qkv-down`, `wide-all`: `new` with qkv and down
  (and o) fused up to 64 rows too, at bs 40 and 64;
- `light`: `new` + the light CUDA-core kernel (kernels/decode_light.py) for steps of <= 2 rows on
  decode_tuned.LIGHT's shapes, with PDL for decode_tuned.LIGHT_PDL's ops (the shipped default:
  `new` is the tree before it); `light-no-pdl`, `light-no-gate-up`, `light-o-qkv`: without PDL,
  gate_up on the tensor-core kernel, only o and qkv light; `light-attn`: `light` with the
  attention kernel letting its successor (o) launch early (attention.ATTENTION_TRIGGER);
- `tail`: `light` + the persistent layer tail (kernels/decode_persistent.py: o, norm + gate_up
  + SiLU, down in one launch) for steps of 33-64 rows; `tail-pf1k`, `tail-pf4k`: with 1 / 4 KB
  per weight row of L2 prefetch before each phase boundary (none in `tail`); `tail-w4`: 4 warps
  (the most of the three configs' in `tail`: 8); `tail-all`: the
  tail for steps of 2-64 rows;
- `wide-pdl`: `light` with qkv, o and down fused up to 64 rows too (WIDE), and past 32 rows every
  fused op launched with PDL at a depth where two programs share an SM (decode_linear._WIDE_PDL);
  `wide-light`: the same WIDE shapes without that;
- `deep`: `light` with gate_up's and the LM head's weight pipelines in 64-wide K steps, 6 and 5
  stages deep (scripts/depth_probe.py), `deep-gu`: gate_up's only (shipped since: with today's
  table `light` and `deep-gu` are the same step);
- `nosplit`: `light` without the split down projection at 33-64 rows (kernels/split_residual.py:
  the norms still taken in the tails, by addmm_ + the norm kernel); `split2`, `split8`: 2 / 8 K
  slices instead of decode_tuned.SPLIT_DOWN's; `nohoist`: no norm hoisted (each qkv and the LM head
  norm their own input, the embedding a lookup, the greedy argmax a kernel of its own: the step
  before the ninth session); `sep-argmax`: `light` with the argmax a kernel of its own, not in the
  LM head's epilogue;
- `notma`: `light` with the LM head at 33-64 rows on the fused GEMV, not the TMA-fed GEMM
  (kernels/tma_head.py; `light` takes decode_tuned.TMA_HEAD's config); `tma64`: the TMA head in
  64-wide tiles (BLOCK_N 64, 3 stages: the probe's best at 64 rows, slower at 40); `tmak128`: the
  TMA head's config before the eleventh session (128-wide K steps: one program per SM); `rt16`:
  `light` with steps of 17-32 rows as two 16-row m-tiles in the fused GEMVs (decode_linear._ROW_TILES
  (16, 64), not one 32-row tile; with the fused band at 32 rows, as then); `cut32`: the fused GEMVs'
  band before the fourteenth session (up to 32 rows; the path of more rows, cuBLAS qkv and o, RoPE
  inside attention, hoisted norms and the split down projection, from 33); `light` has that path from
  17 rows (decode_linear.FUSED_MAX_ROWS 16; = `cut16-head33`), `cut16` with the TMA LM head from 17
  rows too (it serves 33-64 in `light`), `cut24` / `cut8` the path from 25 / 9 rows; `logits`: `light`
  with the greedy LM head writing its fp32 logits, as before the twelfth session (the step writes none
  since); `sumw4`: `light` with the split down projection's sum kernel on 4 warps, as before the
  fourteenth session (row_warps: 16); `a64w2f2`, `a128w2f2`, `a128w4f2`, `a128w4f1`: `light` with
  decode attention's config overridden for every key (ATTN: tile, warps, stages, fold) at 17-32 and 64 rows;
  `f0-17`: `light` at 17-32 rows without the fold (decode attention's config there before the fifteenth
  session: `light` folds from 17 rows since).
Each replay's logits (a greedy key's: its head run again on the step's head input) are checked bitwise against the eager run of the same variant; the kernels
per step of bs 1 and 64 (one eager step under the profiler) are printed in the first pass.
Usage: python scripts/decode_ablation.py OUT.json [CONFIG.yaml] [VARIANT ...] [--batches 1,2,...]
"""

import dataclasses
import json
import statistics
import sys
import types

import torch

from trtgraph.bench import _timed, decode_rows, measure_bandwidth
from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.config import Config
from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels import decode_occupancy as occ
from trtgraph.kernels import decode_persistent as dp
from trtgraph.kernels import decode_tuned
from trtgraph.kernels import linear as lin
from trtgraph.kernels import split_residual as sr
from trtgraph.kernels import tma_head
from trtgraph.kernels import attention_config as attention
from trtgraph.kernels import triton_ops as t
from trtgraph.kernels.composed import argmax_op, compose
from trtgraph.kernels import _with_argmax
from trtgraph.kernels import sampling as smp
from trtgraph.runtime.step.executor import Executor

BATCHES = (1, 2, 8, 16, 17, 24, 32, 33, 40, 48, 64)
ALL = frozenset({dl._PLAIN, dl._RESIDUAL, dl._SILU, dl._ROPE})
OPS = {"qkv": dl._ROPE, "o_down": dl._RESIDUAL, "gate_up": dl._SILU, "lm_head": dl._PLAIN}
# main 5b27c9f's kernels/decode_tuned.py (no SLOWER, no WIDE)
MAIN_TUNED = {(2048, 2048): (64, 128, 4, 4, 4, False), (2048, 8192): (64, 256, 4, 4, 3, False),
              (3072, 2048): (64, 128, 4, 8, 3, True), (16384, 2048): (64, 128, 1, 8, 3, True),
              (128256, 2048): (128, 128, 1, 8, 3, False)}
NEW = dict(epilogue=True, wide=set(decode_tuned.WIDE), pdl=frozenset(), prefetch=0, tuned=dict(decode_tuned.TUNED),
           slower=set(decode_tuned.SLOWER), batches=BATCHES, two_per_sm=True, light=set(), light_pdl=set())
LIGHT = dict(light=set(decode_tuned.LIGHT), light_pdl=set(decode_tuned.LIGHT_PDL))
QKV, O, DOWN = ("norm_qkv_rope", 3072, 2048), ("linear_residual", 2048, 2048), ("linear_residual", 2048, 8192)
LM, LM_PLAIN = (128256, 2048), (128, 128, 1, 8, 3, False)  # main 81adfc0's LM head config: no PRENORM
# 64-wide K steps, deeper pipelines (scripts/depth_probe.py, eighth session)
GU, GU_DEEP, LM_DEEP = (16384, 2048), (64, 64, 1, 8, 6, True), (128, 64, 1, 8, 5, False, True)
# Decode attention's config over the shipped one for every key (attention_config.DECODE_OVERRIDE), at
# the 17-32 rows that take RoPE inside attention since the fourteenth session (not swept there) and 64
ATTN = {"a64w2f2": dict(block_n=64, warps=2, stages=3, fold=2), "a128w2f2": dict(block_n=128, warps=2, stages=2, fold=2),
        "a128w4f2": dict(block_n=128, warps=4, stages=3, fold=2), "a128w4f1": dict(block_n=128, warps=4, stages=3, fold=1)}
VARIANTS = {"main": {**NEW, "epilogue": False, "wide": set(), "tuned": MAIN_TUNED, "slower": set(), "two_per_sm": False},
            "one-per-sm": {**NEW, "two_per_sm": False, "batches": (32, 40, 64)},
            "main81": {**NEW, "two_per_sm": False, "tuned": {**NEW["tuned"], LM: LM_PLAIN}},
            "no-prenorm": {**NEW, "tuned": {**NEW["tuned"], LM: LM_PLAIN}},
            "wide-qkv-down": {**NEW, "wide": set(decode_tuned.WIDE) | {QKV, DOWN}, "batches": (40, 64)},
            "wide-all": {**NEW, "wide": set(decode_tuned.WIDE) | {QKV, O, DOWN}, "batches": (40, 64)},
            "separate-add": {**NEW, "epilogue": False, "wide": set()},
            "epilogue": {**NEW, "wide": set()},
            "new": NEW,
            "new-o-fused": {**NEW, "slower": set(), "batches": (1, 8, 32)},
            "light": {**NEW, **LIGHT},
            "light-no-pdl": {**NEW, **LIGHT, "light_pdl": set(), "batches": (1, 2)},
            "light-no-gate-up": {**NEW, **LIGHT, "light": LIGHT["light"] - {(16384, 2048)}, "batches": (1, 2)},
            "light-o-qkv": {**NEW, **LIGHT, "light": LIGHT["light"] & {(2048, 2048), (3072, 2048)}, "batches": (1, 2)},
            "light-attn": {**NEW, **LIGHT, "attn_trigger": True, "batches": (1,)},
            "tail": {**NEW, **LIGHT, "tail": True, "batches": (33, 40, 48, 64)},
            "tail-pf1k": {**NEW, **LIGHT, "tail": True, "tail_prefetch": 1024, "batches": (33, 40, 48, 64)},
            "tail-pf4k": {**NEW, **LIGHT, "tail": True, "tail_prefetch": 4096, "batches": (33, 40, 48, 64)},
            "tail-w4": {**NEW, **LIGHT, "tail": True, "tail_warps": 4, "batches": (33, 40, 48, 64)},
            "tail-all": {**NEW, **LIGHT, "tail": True, "tail_min": 2, "batches": (2, 8, 32)},
            "wide-pdl": {**NEW, **LIGHT, "wide": set(decode_tuned.WIDE) | {QKV, O, DOWN}, "wide_pdl": True,
                         "batches": (33, 40, 48, 64)},
            "wide-light": {**NEW, **LIGHT, "wide": set(decode_tuned.WIDE) | {QKV, O, DOWN}, "batches": (33, 40, 48, 64)},
            "deep": {**NEW, **LIGHT, "tuned": {**NEW["tuned"], GU: GU_DEEP, LM: LM_DEEP}},
            "deep-gu": {**NEW, **LIGHT, "tuned": {**NEW["tuned"], GU: GU_DEEP}},
            "nosplit": {**NEW, **LIGHT, "split": {}},
            "nohoist": {**NEW, **LIGHT, "split": {}, "hoist": False, "fused_argmax": False},
            "sep-argmax": {**NEW, **LIGHT, "fused_argmax": False},
            "notma": {**NEW, **LIGHT, "tma": {}},
            "logits": {**NEW, **LIGHT, "store_logits": True},
            "sumw4": {**NEW, **LIGHT, "sum_warps": 4, "batches": (40, 64)},
            "tma64": {**NEW, **LIGHT, "tma": {LM: (64, 128, 3, 4)}, "batches": (33, 40, 48, 64)},
            "tmak128": {**NEW, **LIGHT, "tma": {LM: (128, 128, 4, 4)}, "batches": (33, 40, 48, 64)},
            "rt16": {**NEW, **LIGHT, "row_tiles": (16, 64), "bands": 32, "batches": (16, 17, 24, 32)},
            "cut16": {**NEW, **LIGHT, "bands": 16, "tma_min": 17, "batches": (16, 17, 24, 32)},
            "cut24": {**NEW, **LIGHT, "bands": 24, "tma_min": 25, "batches": (24, 32)},
            "cut8": {**NEW, **LIGHT, "bands": 8, "batches": (16, 17)},
            "cut16-head33": {**NEW, **LIGHT, "bands": 16, "tma_min": 33, "batches": (17, 24, 32)},
            "cut32": {**NEW, **LIGHT, "bands": 32, "batches": (16, 17, 24, 32)},
            **{name: {**NEW, **LIGHT, "attn": cfg, "batches": (17, 24, 32, 64)} for name, cfg in ATTN.items()},
            "f0-17": {**NEW, **LIGHT, "attn": {"fold": 0}, "batches": (17, 24, 32)},
            "split2": {**NEW, **LIGHT, "split": {DOWN[1:]: 2}, "batches": (33, 40, 48, 64)},
            "split8": {**NEW, **LIGHT, "split": {DOWN[1:]: 8}, "batches": (33, 40, 48, 64)},
            "pdl": {**NEW, "pdl": ALL, "prefetch": dl._PREFETCH_BYTES},
            "pdl-no-prefetch": {**NEW, "pdl": ALL, "batches": (1, 64)},
            "pdl-o-lm": {**NEW, "pdl": frozenset({dl._RESIDUAL, dl._PLAIN}), "prefetch": dl._PREFETCH_BYTES},
            **{f"pdl-{name}": {**NEW, "pdl": frozenset({mode}), "prefetch": dl._PREFETCH_BYTES, "batches": (1, 64)}
               for name, mode in OPS.items()}}


def install(ex, v):
    dl._WIDE, dl._PDL_MODES, dl._PREFETCH_BYTES = set(v["wide"]), frozenset(v["pdl"]), v["prefetch"]
    occ.TWO_PER_SM, dl._WIDE_PDL = v["two_per_sm"], v.get("wide_pdl", False)
    attention.ATTENTION_TRIGGER = 1 if dl._RESIDUAL in v["pdl"] or v.get("attn_trigger", False) else 2  # 2: the shipped
    attention.DECODE_OVERRIDE.clear()
    attention.DECODE_OVERRIDE.update(v.get("attn", {}))
    dl._TUNED = dict(v["tuned"])
    dl._ROW_TILES = v.get("row_tiles", (16, 32, 64))
    cut = v.get("bands", dl.FUSED_MAX_ROWS)  # the fused qkv / o / down up to `cut` rows; the other path from cut + 1
    dl._MAX_ROWS[0], tma_head.TMA_MIN_ROWS = cut, v.get("tma_min", 33)
    dl._LIGHT_ON, dl._LIGHT_PDL = set(v["light"]), frozenset(v["light_pdl"])
    for key in dl._CHOICE:  # bf16 on one GPU, deterministic off: fused unless the table says slower
        dl._CHOICE[key] = dl.COMPOSED if key in v["slower"] else dl.FUSED
    decode_tuned.TAIL, dp.TAIL_MIN_ROWS = v.get("tail", False), v.get("tail_min", 33)
    dp._PREFETCH_BYTES, dp._NUM_WARPS = v.get("tail_prefetch", 0), v.get("tail_warps")
    dp.choose_tail(dl._CHOICE, ex.device, False, False, torch.bfloat16)
    fused = _with_argmax(compose(t.rms_norm, lin.linear, t.silu_and_mul, t.rope_write_kv,
                                 lin.linear_residual if v["epilogue"] else None), smp.argmax)
    sr.NUM_WARPS = v.get("sum_warps")  # None: the shipped triton_ops.row_warps
    sr._SPLITS.clear()
    sr._SPLITS.update({shape: (n, cut + 1) for shape, n in v.get("split", decode_tuned.SPLIT_DOWN).items()})
    tma_head._ON.clear()
    tma_head._ON.update(v.get("tma", decode_tuned.TMA_HEAD))
    model = ex.loaded.model
    model.__dict__.pop("forward_normed", None)
    if not v.get("hoist", True):
        model.forward_normed = types.MethodType(_unhoisted, model)
    ops = sr.with_split(dl.dispatch(fused), t.rms_norm)
    if not v.get("fused_argmax", True):
        ops = ops._replace(norm_linear_argmax=argmax_op(ops.norm_linear, smp.argmax))  # the dispatched head
    if v.get("store_logits"):  # the greedy head writes its fp32 logits, as before the twelfth session
        head = ops.norm_linear_argmax
        ops = ops._replace(norm_linear_argmax=lambda x, nw, eps, w, tok, store=True: head(x, nw, eps, w, tok))
    ex.loaded.model.ops = dataclasses.replace(ex.loaded.model.ops, **ops._asdict())


def _unhoisted(model, ids, pos, meta):
    """CausalLM.forward_normed with no norm hoisted (the step before the ninth session)."""
    h = model.embed(ids)
    for layer, kv_cache in zip(model.layers, meta.kv_caches):
        h, _ = layer(h, None, None, pos, model.cos_sin, kv_cache, meta, model.ops)
    return h, None


def floor_ms(ex, batch, bw):
    """The bench's floor: the weights and the cached K/V read once at the copy bandwidth."""
    cfg, elt = ex.loaded.config, ex.loaded.model.lm_head_weight.element_size()
    kv_bytes = batch * 129 * cfg.num_layers * 2 * cfg.kv_size * elt
    return (cfg.parameter_count() * elt + kv_bytes) / bw * 1e3


def kernels_per_step(ex, key):
    """CUDA kernels one eager step of the prepared key launches (what its graph replays)."""
    from torch.profiler import ProfilerActivity, profile
    ex.prepare(key, decode_rows(ex, key.batch_size, 128))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        ex.execute(key, eager=True)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(ex, key):
    ex.runner._graphs.pop(key, None)  # re-record this variant's graph
    ex.prepare(key, decode_rows(ex, key.batch_size, 128))
    with torch.inference_mode():
        ex.execute(key, eager=True)  # the variant's lazy state (scratch, counters) made before its capture
    ex.capture(key)
    ex.prepare(key, decode_rows(ex, key.batch_size, 128))
    with torch.inference_mode():
        replay = ex.logits(ex.execute(key)).clone()
        eager = ex.logits(ex.execute(key, eager=True)).clone()
        ms = statistics.median(_timed(ex.device, lambda: ex.execute(key), 20) for _ in range(5)) * 1e3
    return ms, bool(torch.equal(replay, eager))


def main():
    only = None
    if "--batches" in sys.argv:  # --batches 1,2: only these batch sizes of every variant
        at = sys.argv.index("--batches")
        only = {int(b) for b in sys.argv[at + 1].split(",")}
        del sys.argv[at:at + 2]
    out_path = sys.argv[1]
    cfg = Config.from_yaml(sys.argv[2] if len(sys.argv) > 2 else "examples/llama-3.2-1b-synthetic.yaml")
    keys = {b: GraphKey(b, 0, 0, "greedy") for b in BATCHES if not only or b in only}
    ex = Executor.build(cfg, BucketPlan.from_config(cfg).with_keys(list(keys.values())))
    bw = measure_bandwidth(ex.device) if ex.device.type == "cuda" else 1e12
    floors = {b: floor_ms(ex, b, bw) for b in keys}
    print(f"choice: {dl.installed_choice()}\nbackends: {lin.installed_backends()}\ncopy bandwidth "
          f"{bw / 1e9:.0f} GB/s; floor ms: " + ", ".join(f"bs {b} {v:.3f}" for b, v in floors.items()), flush=True)
    for key in keys.values():
        ex.warmup(key)
    results = {"floor_ms": floors, "bandwidth_GBps": bw / 1e9}
    names = sys.argv[3:] or list(VARIANTS)
    for i, name in enumerate(names + names[::-1]):
        v = VARIANTS[name]
        if only:
            v = {**v, "batches": tuple(b for b in v["batches"] if b in only)}
        install(ex, v)
        tag = f"{name}#{1 + (i >= len(names))}"
        try:
            results[tag] = {b: measure(ex, keys[b]) for b in v["batches"]}
            if i < len(names) and ex.device.type == "cuda":
                counts = {b: kernels_per_step(ex, keys[b]) for b in (1, 64) if b in v["batches"]}
                results[tag + " kernels"] = counts
                print(f"{tag:20s} kernels per step: {counts}", flush=True)
        except Exception as e:  # a variant that does not run is a result too
            results[tag] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"{tag:20s} " + "  ".join(f"bs {b}: {r[0]:.3f} ms ({r[0] / floors[b]:.2f}x)"
                                       f"{'' if r[1] else ' REPLAY != EAGER'}"
                                       for b, r in results[tag].items() if b != "error")
              + results[tag].get("error", ""), flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
