"""Host-side choices of the paged-attention launch (kernels/attention.py): the decode config per
split mode and key shape, the launch shape (grid, pieces, tile), and the knobs of the decode
launch (PDL, L2 prefetch, when attention releases its successor). Pure functions of the key's
shapes and these module constants, so a recorded graph always launches the same grid; tests and
scripts/attention_sweep.py / attention_ab.py set the constants here (monkeypatch this module)."""

from __future__ import annotations

import torch
import triton

from .triton_ops import pdl_capable

_NUM_SMS: dict = {}
# Batch-invariant split-KV (fixed pieces of KV tiles) or the faster adaptive split (as many
# pieces as fill the GPU for this key's batch). The executor sets it once at build from the
# config's `deterministic`, before any warm-up or capture.
_INVARIANT_ATTENTION = [True]
# Decode (q = 1) launches on CUDA: KV tile, tiles per piece (the fixed piece of the invariant
# mode, the least of an adaptive one), warps, pipeline stages, and (invariant mode) programs
# per SM the grid aims at (0: one program per piece of the table's longest context). The tile,
# piece and warps fix a row's rounding, so the invariant mode's are constants, never a function
# of the batch; stages and the grid only change who computes a piece, and when.
# `fold` (adaptive mode only, RoPE + KV write inside attention; 1 element-wise, 2 as a 16-key
# tile through the tile's dots, 0 off): the step's new key and value enter the row's softmax from
# registers after its cached tiles, instead of being written to the cache and read back after a
# barrier (the write still happens, last, off the critical path). It changes the reduction order
# against the fused-qkv path's, so the invariant mode never folds (a row's bits there must not
# depend on which path its bucket takes). `fill` (adaptive): the key gets as many pieces as make
# about `fill` programs per SM. `early` (adaptive): a row's first tile's pages read beside the
# context lengths, its K and V loaded before q, the tile taken last (attention.py's EARLY).
# Measured on the H200 (scripts/attention_sweep.py; docs/performance.md, "branch h/a6" and the
# eighth session's "branch h/a8"): up to one row program per SM 128-key tiles on 4 warps (the 1B
# runs the fused qkv there: no RoPE inside attention, so no fold); up to three (bs 17-49 on the 1B)
# the same with fold 1 (bs 48: -11% at 128 cached tokens, -19% at 512; bs 17-32, which take RoPE
# inside attention since the fourteenth session: the replayed step -15 to -41 us against no fold
# over two calls, the best of four configs in the fifteenth session's sweep, decode_ablation.py's
# `a128w4f1`); past that (bs 50-64) 128-key tiles on 2 warps, 2 stages, fold 2 (bs 64: -3% / -8%; on
# 4 warps three programs fit an SM, so 512 run in two waves: +2 to +35%; 64-key tiles on 2 warps and
# 3 stages: -3 to -5 us a step at 128 cached tokens (fifteenth session), +9 at 512 (the eighth
# session's sweep): not taken).
# `early` lost at bs 1-32 (0 to +10%: 255 registers) and is off; `fill` 8 lost at bs 48-64
# (+12 to +46%).
DECODE_INVARIANT = dict(block_n=64, piece_tiles=4, warps=4, stages=3, per_sm=0, fold=0)
# (row programs per SM at most, config), first match
DECODE_ADAPTIVE = ((1, dict(block_n=128, piece_tiles=2, warps=4, stages=3, fold=0)),
                   (3, dict(block_n=128, piece_tiles=2, warps=4, stages=3, fold=1)),
                   (None, dict(block_n=128, piece_tiles=2, warps=2, stages=2, fold=2)))
DECODE_OVERRIDE: dict = {}  # scripts/attention_sweep.py's variant, over either mode's config
_CPU_DECODE = dict(block_n=16, piece_tiles=2, warps=4, stages=3, per_sm=2)  # the interpreter (tests)


def set_attention_invariant(invariant: bool) -> None:
    _INVARIANT_ATTENTION[0] = bool(invariant)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def decode_config(row_programs: int, device: torch.device) -> dict:
    """The decode launch's config for a key of `row_programs` (sequence, kv head) programs."""
    if device.type != "cuda":
        return {**_CPU_DECODE, "fold": 1, "early": True}  # both adaptive-only (fold_mode, loads_first_tile_early)
    if _INVARIANT_ATTENTION[0]:
        return {**DECODE_INVARIANT, **DECODE_OVERRIDE}
    sms = _num_sms(device)
    cfg = next(c for most, c in DECODE_ADAPTIVE if most is None or row_programs <= most * sms)
    return {**cfg, **DECODE_OVERRIDE}


def attention_launch_shape(batch: int, q_len: int, group: int, num_kv_heads: int, max_len: int,
                           device: torch.device) -> tuple[int, int, int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, query blocks per sequence, KV pieces, KV tiles per piece, programs
    per row, warps, stages): a pure function of the key's shapes, so a recorded graph always
    launches the same grid.

    Batch-invariant (the default, and `deterministic: true`): decode cuts the KV range into
    fixed pieces of `tiles per piece` tiles (flash-decoding), so a row's reduction order
    depends on its own context length only: the same in every bucket and whatever else shares
    the step. The grid's third axis holds a program per piece of the longest context the table
    holds (or, with `per_sm`, as many as fill the GPU: each strides over the row's pieces);
    pieces past a row's context do no work. Adaptive (`deterministic: false`): tiles per piece
    is 0 and the key gets as many pieces as fill the GPU about twice over, each row's tiles
    shared out over them, at least a piece each (a context of one piece is one program: no
    partials to merge) — faster at large batches, but a row's rounding then depends on its
    bucket. Verification and prefill (q > 1): one program per query block, 64-key tiles."""
    rows = q_len * group
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    q_blocks = triton.cdiv(rows, block_m)
    row_programs = batch * q_blocks * num_kv_heads
    cfg = decode_config(row_programs, device)
    block_n, piece, warps, stages = cfg["block_n"], cfg["piece_tiles"], cfg["warps"], cfg["stages"]
    if q_len > 1:
        block_n, warps, stages = (64 if device.type == "cuda" else 16), 4, 3
    max_tiles = triton.cdiv(max_len, block_n)
    if _INVARIANT_ATTENTION[0]:
        pieces = 1 if q_len > 1 else triton.cdiv(max_tiles, piece)
        fill = triton.cdiv(cfg["per_sm"] * _num_sms(device), row_programs) if cfg.get("per_sm") else pieces
        return block_m, block_n, q_blocks, pieces, piece, max(1, min(pieces, fill)), warps, stages
    fill = cfg.get("fill", 2) * _num_sms(device) // row_programs
    pieces = 1 if q_len > 1 else max(1, min(triton.cdiv(max_tiles, piece), fill, 32))
    return block_m, block_n, q_blocks, pieces, 0, pieces, warps, stages


def fold_mode(row_programs: int, device: torch.device) -> int:
    """How a decode launch with RoPE + KV write inside folds the step's key and value in from
    registers (the config's `fold`: 0 not, the write-then-read; 1 element-wise; 2 as a 16-key tile
    through the tile's dots; never in the invariant mode)."""
    if _INVARIANT_ATTENTION[0]:
        return 0
    return int(DECODE_OVERRIDE.get("fold", decode_config(row_programs, device).get("fold", 0)))


def loads_first_tile_early(row_programs: int, device: torch.device) -> bool:
    """Whether a decode launch reads its first tile's pages beside the context lengths and loads
    that tile before q, taking it last (the config's `early`; never in the invariant mode: it
    changes the order of a row's sum)."""
    return _adaptive_flag("early", row_programs, device)


def _adaptive_flag(name: str, row_programs: int, device: torch.device) -> bool:
    flag = DECODE_OVERRIDE.get(name, decode_config(row_programs, device).get(name))  # the interpreter's too
    return not _INVARIANT_ATTENTION[0] and bool(flag)


def launches_with_pdl(q_len: int, rope: bool, batch: int, device: torch.device) -> bool:
    """Whether the attention launch is PDL-launched: decode keys (q = 1) of at most ATTENTION_PDL's
    sequences for the path, on a device with programmatic dependent launch (the key's shapes only)."""
    return q_len == 1 and batch <= ATTENTION_PDL["rope" if rope else "decode"] and pdl_capable(device)


# The attention kernel lets its successor start early: 1 from its first instruction, 2 the same
# unless it is PDL-launched itself, then once it has waited. Only a successor launched with
# programmatic dependent launch can start early: the one-row steps' light o projection
# (decode_tuned.LIGHT_PDL), which loads its first weight tile, then waits for this kernel. From
# the start: -14 to -19 us per batch-1 step on the H200 (docs/performance.md, h/k6 `light-attn`).
# After the wait when PDL-launched: from its start, the whole step's chain of early launches can
# run ahead of the qkv (h/a7, two calls: bs 1 -8 to +10 us with 1, -5 to -15 with 2).
ATTENTION_TRIGGER = 2
# Decode keys (q = 1) of at most ATTENTION_PDL[path] sequences launch attention with programmatic
# dependent launch, per path: "decode" (after the qkv's own kernel: the fused qkv, which
# triggers it from its start at one row, light and PDL-launched itself, and with decode_linear.
# _TRIGGER_MODES at more; or the composition's RoPE kernel) and "rope" (RoPE + KV write inside
# attention, after the composition's qkv GEMM). A program reads the block table and context
# lengths (and with PREFETCH_KV puts its first PREFETCH_ROWS K and V rows on their way to L2),
# then waits for the predecessor; q, the step's k / v and every K / V load come after the wait.
# Why the pre-wait reads are safe: docs/design.md, "Paged attention". Measured on the H200
# (docs/performance.md, branch h/a7): at bs 1 without the prefetch -5 to -15 us per step (at the
# edge of the run-to-run spread), with it +6 to +22; bs 8-32 no gain; bs 64 (after cuBLAS) +8 to
# +13 us, +51 with the prefetch. So: bs 1 only, no prefetch.
ATTENTION_PDL: dict[str, int] = {"decode": 1, "rope": 0}  # path -> most sequences launched with PDL
PREFETCH_KV = False
PREFETCH_ROWS = 256  # at most this many K and V rows prefetched per program (the first of its first piece)
