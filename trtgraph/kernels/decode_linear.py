"""Fused decode GEMVs: the four fused ops of kernels/composed.py as single Triton kernels for
steps of few rows (T <= FUSED_MAX_ROWS = 16, 32 with `deterministic`: decode and verification keys;
up to 64 for the WIDE shapes of kernels/decode_tuned.py). This module holds the launch configs, the
launches, the ops and the fused-or-composed choice; the kernel itself is kernels/decode_kernel.py.

One kernel, four epilogues. Swap-AB: a program multiplies a weight tile [BLOCK_N, BLOCK_K]
by BLOCK_T (16, 32 or 64) rows of x (padded, masked) transposed, acc[BLOCK_N, BLOCK_T], so the
weights fill the MMA's M side and are streamed from HBM once; rows past 64 are more programs
(m-tiles vary fastest in the grid, so they meet the same weight tile in L2).

- RMSNorm in the prologue at no extra pass: the x tile is multiplied by norm_weight[k] as it
  is loaded and sum(x^2) is accumulated alongside; rmsnorm is linear in x given the row's
  rstd, so rstd = rsqrt(ss / K + eps) scales the accumulator in the epilogue.
- PRENORM shapes (a config flag) norm x in a row pass first (`_prenorm`: x * norm_weight and
  each row's rstd) and stream it straight to shared memory; the epilogue applies the rstd.
- Split-K where a shape has too few N-blocks to fill the GPU: fp32 partials (and partial sums
  of squares) go to a workspace and an arrival counter per output tile (triton_ops'
  `arrival_counters`); the program that arrives last sums the partials in split order (fixed:
  deterministic), runs the epilogue and puts the counter back to 0.
- Paired rows: SiLU-and-mul (a program owns gate rows n and up rows I + n) and RoPE (a program
  owns the first halves of heads, rows h*D + d, and their partners h*D + D/2 + d) accumulate two
  tiles, so the epilogue has both operands in registers.
- Epilogues: plain store (fp32 logits for the LM head), residual add (o, down), silu(g) * u,
  RoPE with q written out and the rotated k and the v written to the paged cache.
- Programmatic dependent launch, per op (`_PDL_MODES`, off: it did not pay on the H200): the
  kernel launches while its predecessor drains, prefetches its weight slice into L2, then waits.
- Steps of one row on the shapes `choose_fused` installs (`_LIGHT_ON`, from decode_tuned.LIGHT)
  take the light CUDA-core kernel instead (kernels/decode_light.py: same arguments, epilogues
  and split-K tail; launched with PDL per `_LIGHT_PDL`, where the overlap paid: bs 1 -6 to -8%).

Batch invariance by construction: the launch config (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
is a function of (N, K) and the device only (`decode_config`), never of T; a row is one
column of an m-tile and every column is reduced over K in the same order, so its result does
not depend on how many rows share the step.

Which shapes run these kernels is decided once at build time (`choose_fused`), recorded in
the manifest, and the composition of single ops runs elsewhere (prefill, tensor parallelism,
Qwen3's q/k norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import decode_tuned
from .composed import FusedOps, QKVHeads
from .decode_kernel import _decode_kernel, _prenorm_kernel
from .decode_light import LIGHT_MAX_ROWS, _light_kernel
from . import decode_occupancy as occ
from .triton_ops import argmax_best, arrival_counters, pdl_capable

# The fused kernels run for steps of at most this many rows (they take any: 64-row tiles, then
# m-tiles). On the H200 the 64-row tiles lost to the composition at 40-64 rows (branch h/k), and
# since the fourteenth session the path of more rows (cuBLAS qkv / o, RoPE inside attention, hoisted
# norms, the split down projection; the LM head's fused GEMV up to 32 rows) serves 17-32 too: the
# step 34-62 us faster there, 7-9 us slower at 16 (decode_ablation.py cut32 / light / cut8;
# docs/performance.md). `deterministic` installs none of that path's split or rounding, so there the
# fused kernels serve up to DETERMINISTIC_MAX_ROWS (choose_fused installs the band in _MAX_ROWS).
FUSED_MAX_ROWS, DETERMINISTIC_MAX_ROWS = 16, 32
_MAX_ROWS = [FUSED_MAX_ROWS]
_RECORD_PLAIN_ROWS = 32  # "fused" alone in the manifest: up to 32 rows (earlier builds' band); others named
# ... except for the (op, N, K) in decode_tuned.WIDE, whose fused kernel beat the composition at
# 40 and 64 rows too (scripts/tune_decode_linear.py): those run it for steps of up to 64 rows.
WIDE_MAX_ROWS = 64
FUSED, COMPOSED = "fused", "composed"
_PLAIN, _RESIDUAL, _SILU, _ROPE = 0, 1, 2, 3
_ARGMAX = -1  # the plain store and the greedy argmax (decode_kernel._argmax_epilogue)
_ARGMAX_ONLY = -2  # the greedy argmax, no logits stored


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    stack: bool = False  # paired rows (gate_up, qkv): both halves in one tile, one MMA twice as tall
    prenorm: bool = False  # RMSNorm ops: x normed once by a row pass, not in every program (_prenorm)


# (N, K) -> (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages[, stack[, prenorm]]), measured on the H200 with
# scripts/tune_decode_linear.py (kernels/decode_tuned.py); N counts output rows of the weight
# (for gate_up and qkv the paired-row kernels use BLOCK_N pairs, i.e. 2 * BLOCK_N weight rows).
_TUNED: dict[tuple[int, int], tuple] = dict(decode_tuned.TUNED)


def decode_config(n: int, k: int, device: torch.device) -> DecodeConfig:
    """The launch configuration for a weight [n, k]: a pure function of the shape and device."""
    if (n, k) in _TUNED:
        return DecodeConfig(*_TUNED[(n, k)])
    if device.type != "cuda":
        return DecodeConfig(16, 32 if k >= 32 else 16, 2 if k >= 64 else 1, 1, 1)  # small, interpreter
    # untuned: 64-row tiles, split K until the tiles fill the SMs about once, 512+ columns a split
    tiles = triton.cdiv(n, 64)
    split = 1
    while tiles * split * 2 <= 132 and k // (split * 2) >= 512:
        split *= 2
    return DecodeConfig(64, 128, split, 4, 4)


# The rows of x a program multiplies (the MMA's N side): the fewest of 16, 32, 64 that hold the
# step, so a 64-row step streams each weight tile once, not once per 16 rows. A row's column of
# the accumulator is reduced over K in the same order whatever the tile's width (the MMA
# computes each column alone); tests/test_decode_linear.py checks row 0 bitwise on the GPU for
# T = 1 .. 64. None: always 16 (a grid of m-tiles past 16 rows).
_ROW_TILES: tuple[int, ...] | None = (16, 32, 64)


def row_tile(rows: int) -> int:
    if _ROW_TILES is None:
        return 16
    return next((t for t in _ROW_TILES if rows <= t), _ROW_TILES[-1])


def _launch(mode: int, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, n_cols: int, *,
            norm_weight=None, eps=0.0, bias=None, residual=None, pair_offset=0, half=1, rope=None,
            tokens=None) -> torch.Tensor:
    """Run the fused kernel: x [T, K] (row stride free), weight [N_w, K], out [T, ...] contiguous rows;
    `tokens` (int64 [T], mode _ARGMAX): each row's first maximal column of out (fp32)."""
    T, K = x.shape
    N_w = weight.shape[0]
    assert x.stride(-1) == 1 and weight.is_contiguous()
    if T == 0:
        return out
    light = light_config(N_w, K) if T <= LIGHT_MAX_ROWS and (N_w, K) in _LIGHT_ON and tokens is None else None
    cfg = light or decode_config(N_w, K, x.device)
    split = cfg.split_k
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)  # never an empty split
    bt = 1 if light else row_tile(T)
    grid = (triton.cdiv(T, bt), triton.cdiv(n_cols, cfg.block_n), split)
    nacc = 2 if mode >= _SILU else 1
    ws, cnt = _split_scratch(grid, nacc * cfg.block_n + 1, bt, out)
    rs = out
    if cfg.prenorm and norm_weight is not None and not light:  # x normed once here, rstd applied in the epilogue
        x, rs = _prenorm(x, norm_weight, eps)
        norm_weight = None
    cs, pos, slots, kv, hq, hkv = rope if rope is not None else (out, out, out, out, 0, 0)
    if tokens is not None:  # the argmax's running maxima, tokens and m-tile counters in three free pointers
        assert mode in (_ARGMAX, _ARGMAX_ONLY) and out.dtype == torch.float32 and n_cols < 1 << 24
        tiles = grid[0] * grid[1]
        residual, slots, kv = argmax_best(T, x.device), tokens, arrival_counters(tiles + grid[0], x.device)[tiles:]
    even = K % k_per_split == 0 and n_cols % cfg.block_n == 0
    wide_pdl = not light and T > _MAX_ROWS[0] and _WIDE_PDL and pdl_capable(x.device)
    pdl = (mode in _LIGHT_PDL if light else mode in _PDL_MODES or wide_pdl) and pdl_capable(x.device)
    args = (x, norm_weight if norm_weight is not None else weight, rs, weight, bias if bias is not None else weight,
            out, residual if residual is not None else out, cs, pos, slots, kv, ws, cnt,
            T, n_cols, K, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
            residual.stride(0) if residual is not None else 0, float(eps), pair_offset,
            kv.stride(0) if rope is not None else 0, kv.stride(2) if rope is not None else 0,
            kv.stride(3) if rope is not None else 0, hq, hkv)
    meta = dict(MODE=mode, HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None, HALF=half,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, NACC=nacc, BLOCK_T=bt, EVEN=even, PDL=pdl,
                PRENORM=rs is not out, TRIGGER=mode in _TRIGGER_MODES and pdl_capable(x.device),
                num_warps=cfg.num_warps, **({"launch_pdl": True} if pdl else {}))
    if light:
        _light_kernel[grid](*args, num_stages=1, **meta)
        return out
    _decode_kernel[grid](
        *args, PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", STACK=cfg.stack and mode >= _SILU,
        PREFETCH=min(k_per_split * weight.element_size(), _PREFETCH_BYTES) if pdl and even else 0,
        num_stages=occ.fit_stages(cfg, nacc, weight.element_size(), x.device, bt, grid[0] * grid[1] * grid[2],
                                  two=wide_pdl), **meta)
    return out


def _split_scratch(grid: tuple[int, int, int], slot: int, bt: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K's workspace (fp32 partials: `slot` columns x bt rows per tile and split) and the
    tiles' arrival counters; without split-K, placeholders (out)."""
    if grid[2] == 1:
        return out, out
    tiles = grid[0] * grid[1]
    ws = torch.empty(tiles * grid[2] * slot * bt, dtype=torch.float32, device=out.device)
    return ws, arrival_counters(tiles, out.device)


def _prenorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * norm_weight in x's dtype [T, K], rsqrt(mean(x^2) + eps) [T] fp32): one program per row,
    so a row's values do not depend on T. For PRENORM shapes (the LM head), whose 1002 programs
    would each norm the step's whole x tile again, which at 32-64 rows costs more than the row pass."""
    T, K = x.shape
    xs = torch.empty((T, K), dtype=x.dtype, device=x.device)
    rs = torch.empty(T, dtype=torch.float32, device=x.device)
    _prenorm_kernel[(T,)](x, norm_weight, xs, rs, K, x.stride(0), float(eps),
                          BLOCK_K=min(triton.next_power_of_2(K), 2048), num_warps=4)
    return xs, rs


# The light CUDA-core kernel (kernels/decode_light.py) for steps of <= LIGHT_MAX_ROWS rows: the
# weight shapes (N, K) it runs for, installed by choose_fused from decode_tuned.LIGHT (empty
# unless installed: the ops called directly run the tensor-core kernel), and the ops (by MODE)
# whose light kernel is launched with programmatic dependent launch (its first weight tile
# loaded before it waits for the previous kernel).
_LIGHT_ON: set[tuple[int, int]] = set()
_LIGHT_PDL: frozenset[int] = frozenset(decode_tuned.LIGHT_PDL)


def light_config(n: int, k: int) -> DecodeConfig | None:
    """The light kernel's launch config for a weight [n, k] (BLOCK_N, BLOCK_K, SPLIT_K, warps;
    decode_tuned.LIGHT), or None where it has none."""
    c = _LIGHT_TUNED.get((n, k))
    return DecodeConfig(c[0], c[1], c[2], c[3], 1) if c else None


_LIGHT_TUNED: dict[tuple[int, int], tuple] = dict(decode_tuned.LIGHT)


# Programmatic dependent launch: the ops (by MODE) whose kernel is launched with it, so that it
# starts while the previous kernel drains, puts the first _PREFETCH_BYTES of each of its weight
# rows on their way to L2 and only then waits for the previous kernel's writes; such a kernel
# lets its successor launch from its start. Hopper and later, CUDA only. Off: in the replayed
# 1B step on the H200 it gained nothing at bs 1 and lost at bs 8-64 (docs/performance.md,
# branch h/k4; scripts/decode_ablation.py measures it per op).
_PDL_MODES: frozenset[int] = frozenset()
_PREFETCH_BYTES = 1024  # per weight row and program (a multiple of 16)
# The ops (by MODE) whose kernel lets its successor launch from its start even when it is not
# PDL-launched itself (for the qkv: attention, when kernels/attention.py's ATTENTION_PDL launches
# it with PDL past one row). Empty: attention after the tensor-core qkv gained nothing at bs 8-32
# on the H200 (docs/performance.md, branch h/a7; scripts/attention_ab.py `pdl`).
_TRIGGER_MODES: frozenset[int] = frozenset()


# Steps of more than FUSED_MAX_ROWS rows (the WIDE shapes): every op launched with PDL and its
# pipeline depth cut until two programs share an SM, so that an early-launched successor finds
# room beside it (`decode_occupancy.fit_stages(two=True)`). Off: with qkv, o and down WIDE too
# (decode_ablation.py's `wide-pdl`), the H200's replayed step took 1.52-1.55 ms at bs 40-64 against
# 1.11-1.20 (86 kernels against 118; docs/performance.md, seventh session).
_WIDE_PDL = False


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_linear(x, norm_weight, eps, weight, bias=None, out_dtype=None):
    """rms_norm(x) @ weight.T (+ bias), written in out_dtype (the weight's by default)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype or weight.dtype, device=x.device)
    return _launch(_PLAIN, _rows(x), weight, out, weight.shape[0], norm_weight=norm_weight, eps=eps, bias=bias)


def norm_linear_argmax(x, norm_weight, eps, weight, tokens, store=True):
    """norm_linear's fp32 logits, and each row's first maximal column written into `tokens`
    (int64 [T]) by the same kernel's epilogue (the greedy LM head: no argmax kernel of its own).
    store=False: the tokens only, no logits written (None returned)."""
    out = torch.empty((x.shape[0], weight.shape[0] if store else 1), dtype=torch.float32, device=x.device)
    _launch(_ARGMAX if store else _ARGMAX_ONLY, _rows(x), weight, out, weight.shape[0], norm_weight=norm_weight,
            eps=eps, tokens=tokens)
    return out if store else None


def linear_residual(x, weight, residual):
    """residual + x @ weight.T, written into residual's storage."""
    assert residual.stride(-1) == 1
    return _launch(_RESIDUAL, _rows(x), weight, residual, weight.shape[0], residual=residual)


def norm_gate_up_silu(x, norm_weight, eps, weight):
    """silu(gate) * up of rms_norm(x) @ [gate; up].T -> [T, I]."""
    inter = weight.shape[0] // 2
    out = torch.empty((x.shape[0], inter), dtype=weight.dtype, device=x.device)
    return _launch(_SILU, _rows(x), weight, out, inter, norm_weight=norm_weight, eps=eps, pair_offset=inter)


def norm_qkv_rope(x, norm_weight, eps, weight, bias, heads: QKVHeads, cos_sin, positions, kv_cache, slot_mapping):
    """RMSNorm, the qkv projection, RoPE; rotated k and v into the paged cache; q [T, Hq, D] out.
    (No q/k norms: Qwen3's take the composition.)"""
    assert heads.q_norm is None and kv_cache.is_contiguous()
    T, D = x.shape[0], heads.head_dim
    q = torch.empty((T, heads.num_heads, D), dtype=weight.dtype, device=x.device)
    rope = (cos_sin, positions, slot_mapping, kv_cache, heads.num_heads, heads.num_kv_heads)
    _launch(_ROPE, _rows(x), weight, q.view(T, heads.sizes()[0]), weight.shape[0] // 2, norm_weight=norm_weight,
            eps=eps, bias=bias, half=D // 2, rope=rope)
    return q


FUSED_OPS = FusedOps(norm_qkv_rope, linear_residual, norm_gate_up_silu, norm_linear)
FUSED_ARGMAX = norm_linear_argmax

# ---------------------------------------------------------------------------------------
# The choice: which (op, weight shape) runs the fused kernel for steps of <= max_rows rows
# ---------------------------------------------------------------------------------------

_CHOICE: dict[tuple[str, int, int], str] = {}  # (op, N, K) -> FUSED | COMPOSED; unlisted: composed
# (op, N, K) where the H200 measurement found the composition faster (kernels/decode_tuned.py)
_SLOWER: set[tuple[str, int, int]] = set(decode_tuned.SLOWER)
_WIDE: set[tuple[str, int, int]] = set(decode_tuned.WIDE)


def max_rows(op: str, n: int, k: int) -> int:
    """The most rows a step may have for (op, N, K) to run the fused kernel, where chosen."""
    return WIDE_MAX_ROWS if (op, n, k) in _WIDE else _MAX_ROWS[0]


def choose_fused(shapes: list[tuple[str, int, int]], row_counts: dict[tuple[int, int], list[int]],
                 device: torch.device, deterministic: bool, tensor_parallel: bool,
                 qk_norm: bool = False, *, dtype: torch.dtype) -> dict[str, str]:
    """Install, per fused op and weight shape (op, N, K), whether steps of <= max_rows(op, N, K)
    rows (FUSED_MAX_ROWS, DETERMINISTIC_MAX_ROWS with `deterministic`, WIDE_MAX_ROWS for WIDE shapes)
    run the fused kernel: on CUDA, on one GPU, for 16-bit weights (the table was tuned and
    proven on the H200 in bf16; fp32 models keep the composition), not for Qwen3's q/k-normed
    qkv, and where the H200 table does not say the composition is faster. With `deterministic`, a shape whose
    plan also runs steps of more rows keeps the composition for every step (one path for every
    T: the fused kernel is invariant, but past max_rows the composition would take over
    with another reduction order). A pure function of its arguments (a fixed table, no timing), so
    the compiler and the runtime install the same choice; the compiler records it in the
    manifest. Returns `installed_choice()`."""
    _CHOICE.clear()
    _LIGHT_ON.clear()
    _MAX_ROWS[0] = DETERMINISTIC_MAX_ROWS if deterministic else FUSED_MAX_ROWS
    for op, n, k in shapes:
        ok = (device.type == "cuda" and not tensor_parallel and (op, n, k) not in _SLOWER and dtype.itemsize == 2
              and not (qk_norm and op == "norm_qkv_rope"))
        most = max(row_counts.get((n, k), [0]), default=0)
        if ok and deterministic:
            ok = most <= max_rows(op, n, k)
        _CHOICE[(op, n, k)] = FUSED if ok else COMPOSED
        # the light kernel rounds otherwise than the tensor-core one: with `deterministic`, only
        # where no step of the plan has more rows than it serves
        if ok and (n, k) in _LIGHT_TUNED and (not deterministic or most <= LIGHT_MAX_ROWS):
            _LIGHT_ON.add((n, k))
    from .decode_persistent import choose_tail

    choose_tail(_CHOICE, device, deterministic, tensor_parallel, dtype)
    from .tma_head import choose_tma_head

    head = next(((n, k) for op, n, k in shapes if op == "norm_linear"), None)  # the LM head at 33-64 rows, TMA-fed
    choose_tma_head(head, row_counts.get(head, []), device, deterministic, tensor_parallel, dtype)
    return installed_choice()


def installed_choice() -> dict[str, str]:
    """The installed choice as the manifest records it: "composed", "fused" (steps of <= 32 rows:
    `deterministic`'s band, and every build's before the fourteenth session), or "fused<=ROWS" for
    another band ("fused<=16" without `deterministic`, "fused<=64" for a WIDE shape), "+light<=1"
    where the light kernel serves one row, "+tail<=64" for the persistent layer tail's three shapes,
    so that a manifest captured with another band is refused (Recapture) rather than replayed another
    way; and the split down projection's shapes (split_residual.installed_split:
    "linear_residual_norm:NxK": "split4:17-64")."""
    from .decode_persistent import TAIL_MAX_ROWS, tail_shapes

    tail = tail_shapes()

    def name(op: str, n: int, k: int, c: str) -> str:
        rows = max_rows(op, n, k)
        c = f"{FUSED}<={rows}" if c == FUSED and rows != _RECORD_PLAIN_ROWS else c
        c = f"{c}+light<={LIGHT_MAX_ROWS}" if (n, k) in _LIGHT_ON else c
        return f"{c}+tail<={TAIL_MAX_ROWS}" if (op, n, k) in tail else c
    from .split_residual import installed_split
    from .tma_head import installed_tma_head

    return {**{f"{op}:{n}x{k}": name(op, n, k, c) for (op, n, k), c in sorted(_CHOICE.items())}, **installed_split(),
            **installed_tma_head()}


def fused(name: str, weight: torch.Tensor, rows: int) -> bool:
    """Whether dispatch's op `name` runs its fused kernel for this weight at `rows` rows."""
    return _CHOICE.get((name, *weight.shape)) == FUSED and rows <= max_rows(name, *weight.shape)


def dispatch(composed: FusedOps) -> FusedOps:
    """The four ops (and the greedy LM head, norm_linear_argmax): each call runs the fused kernel
    when its (op, shape) was chosen and the step has at most max_rows(op, shape) rows, the
    composition otherwise (a shape-only test: the same for every replay of a key). `composed`
    carries norm_linear_argmax (kernels/__init__ gives it the set's argmax)."""

    def pick(name: str, weight: torch.Tensor, rows: int):
        return getattr(FUSED_OPS if fused(name, weight, rows) else composed, name)

    def norm_qkv_rope(x, norm_weight, eps, weight, bias, heads, *rest):
        fn = composed.norm_qkv_rope if heads.q_norm is not None else pick("norm_qkv_rope", weight, x.shape[0])
        return fn(x, norm_weight, eps, weight, bias, heads, *rest)

    def linear_residual(x, weight, residual):
        return pick("linear_residual", weight, x.shape[0])(x, weight, residual)

    def norm_gate_up_silu(x, norm_weight, eps, weight):
        return pick("norm_gate_up_silu", weight, x.shape[0])(x, norm_weight, eps, weight)

    def norm_linear(x, norm_weight, eps, weight, bias=None, out_dtype=None):
        if tma.runs_tma(x, weight, norm_weight, bias, out_dtype):
            return tma.linear(x, weight)
        return pick("norm_linear", weight, x.shape[0])(x, norm_weight, eps, weight, bias, out_dtype)

    def norm_linear_argmax(x, norm_weight, eps, weight, tokens, store=True):
        if tma.runs_tma(x, weight, norm_weight, None, torch.float32):
            return tma.linear_argmax(x, weight, tokens, store=store)
        if fused("norm_linear", weight, x.shape[0]) and weight.shape[0] < 1 << 24:
            return FUSED_ARGMAX(x, norm_weight, eps, weight, tokens, store)
        return composed.norm_linear_argmax(x, norm_weight, eps, weight, tokens, store)

    from . import tma_head as tma
    from .decode_persistent import with_tail

    return with_tail(FusedOps(norm_qkv_rope, linear_residual, norm_gate_up_silu, norm_linear,
                              norm_linear_argmax=norm_linear_argmax))
