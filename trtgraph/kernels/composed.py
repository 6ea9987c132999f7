"""The decoder's fused ops, defined as compositions of the single ops.

A decode step moves each layer's weights once, and everything between two matrix multiplies
is small; so the model calls four fused ops, each a matrix multiply with its neighbours:

- `norm_qkv_rope(x, norm_weight, eps, weight, bias, heads, cos_sin, positions, kv_cache,
  slot_mapping) -> q [T, Hq, D]`: RMSNorm, the qkv projection, (Qwen3's q/k norms), RoPE, and
  the rotated k and v written to the paged cache;
- `linear_residual(x, weight, residual) -> residual + x @ weight.T` (the o and down
  projections; the result may reuse `residual`'s storage, so the caller drops the old one);
- `norm_gate_up_silu(x, norm_weight, eps, weight) -> silu(gate) * up [T, I]`;
- `norm_linear(x, norm_weight, eps, weight, bias=None, out_dtype=None)`: RMSNorm then a
  projection (the LM head, writing fp32 logits);
- `layer_tail(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight)`: a
  layer after attention, o + residual then the MLP (`tail_op`: the three ops above in order; the
  Triton set runs it as one persistent kernel at 33-64 rows, kernels/decode_persistent.py).
- `norm_linear_argmax(x, norm_weight, eps, weight, tokens, store=True)`: the LM head of a greedy
  step, the argmax written into `tokens` (`argmax_op`; the Triton set's fused GEMV and TMA head take
  it in their epilogue); store=False (the greedy step): the tokens only, no logits returned (the
  Triton set's kernels then write none: at 64 rows 33 MB of fp32 writes fewer);
- `linear_residual_norm(x, weight, residual, norm_weight, eps) -> (residual + x @ weight.T, its
  RMSNorm)`: the down projection of a step whose next layer takes its normed input ready (the
  Triton set's two-kernel form at 33-64 rows: kernels/split_residual.py), and `layer_tail_norm`
  (layer_tail's arguments plus the next norm's weight and eps -> (residual, normed)) over it.

Decode steps whose qkv projection is not one fused kernel split the first op differently:
`norm_qkv(x, norm_weight, eps, weight, bias, heads) -> (q, k, v)` (RMSNorm, the projection,
Qwen3's q/k norms; not rotated), then the kernel set's `rope_paged_attention` rotates, writes the
cache and attends in one op (`KernelSet.rope_in_attention` says which steps do).

`compose(...)` builds them from a kernel set's single ops: the torch references (the numbers
every faster version is held against, and exactly the unfused model's rounding) and the
Triton set's path for shapes where its fused kernels are not chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


@dataclass(frozen=True)
class QKVHeads:
    """How the qkv projection's output splits: heads of this rank, and Qwen3's per-head norms."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: torch.Tensor | None = None  # [D] (qk-norm models only)
    k_norm: torch.Tensor | None = None
    qk_eps: float = 0.0

    def sizes(self) -> tuple[int, int]:
        """(q columns, k or v columns) of the qkv projection's output."""
        return self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim


class FusedOps(NamedTuple):
    norm_qkv_rope: Callable
    linear_residual: Callable
    norm_gate_up_silu: Callable
    norm_linear: Callable
    layer_tail: Callable | None = None  # tail_op's signature (compose: tail_op of the four)
    linear_residual_norm: Callable | None = None  # residual_norm_op's signature
    layer_tail_norm: Callable | None = None  # tail_norm_op's signature
    norm_linear_argmax: Callable | None = None  # argmax_op's signature


def tail_op(ops: FusedOps) -> Callable:
    """layer_tail(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight) -> the
    residual stream after the layer: o + residual, then norm + gate_up + SiLU-mul, down + residual,
    as ops' own three calls (the result may reuse residual's storage)."""

    def layer_tail(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight):
        h = ops.linear_residual(attn, o_weight, residual)
        return ops.linear_residual(ops.norm_gate_up_silu(h, norm_weight, eps, gate_up_weight), down_weight, h)

    return layer_tail


def residual_norm_op(linear_residual: Callable, rms_norm: Callable) -> Callable:
    """linear_residual_norm(x, weight, residual, norm_weight, eps) -> (h, rms_norm(h)) where h =
    linear_residual(x, weight, residual): the next layer's norm taken where the residual is made."""

    def linear_residual_norm(x, weight, residual, norm_weight, eps):
        h = linear_residual(x, weight, residual)
        return h, rms_norm(h, norm_weight, eps)

    return linear_residual_norm


def tail_norm_op(ops: FusedOps) -> Callable:
    """layer_tail_norm(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight,
    next_norm_weight, next_eps) -> (the residual stream after the layer, the next layer's RMSNorm
    of it): tail_op's three ops, the last one ops.linear_residual_norm."""

    def layer_tail_norm(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight, next_norm_weight,
                        next_eps):
        h = ops.linear_residual(attn, o_weight, residual)
        return ops.linear_residual_norm(ops.norm_gate_up_silu(h, norm_weight, eps, gate_up_weight), down_weight, h,
                                        next_norm_weight, next_eps)

    return layer_tail_norm


def argmax_op(norm_linear: Callable, argmax: Callable) -> Callable:
    """norm_linear_argmax(x, norm_weight, eps, weight, tokens, store=True) -> fp32 logits [T, V]
    (None with store=False), each row's first maximal column written into tokens (int64 [T]): the
    LM head of a greedy step, as the head then the kernel set's argmax."""

    def norm_linear_argmax(x, norm_weight, eps, weight, tokens, store=True):
        logits = norm_linear(x, norm_weight, eps, weight, None, torch.float32)
        argmax(logits, out=tokens)
        return logits if store else None

    return norm_linear_argmax


def norm_qkv_op(rms_norm: Callable, linear: Callable) -> Callable:
    """norm_qkv(x, norm_weight, eps, weight, bias, heads) -> q [T, Hq, D], k, v [T, Hkv, D]: views
    of the projection's output (Qwen3's normed q and k are new tensors), not rotated. norm_weight
    None: x is already normed (the previous layer's linear_residual_norm)."""

    def norm_qkv(x, norm_weight, eps, weight, bias, heads: QKVHeads):
        T, D = x.shape[0], heads.head_dim
        qkv = linear(x if norm_weight is None else rms_norm(x, norm_weight, eps), weight, bias)  # [T, (Hq + 2 Hkv) D]
        q_size, kv_size = heads.sizes()
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = q.reshape(T, heads.num_heads, D), k.reshape(T, heads.num_kv_heads, D), v.reshape(T, heads.num_kv_heads, D)
        if heads.q_norm is not None:
            q, k = rms_norm(q, heads.q_norm, heads.qk_eps), rms_norm(k, heads.k_norm, heads.qk_eps)
        return q, k, v

    return norm_qkv


def compose(rms_norm: Callable, linear: Callable, silu_and_mul: Callable, rope_write_kv: Callable,
            linear_residual: Callable | None = None) -> FusedOps:
    """The four fused ops as sequences of a kernel set's single ops; `linear_residual`, where
    the set has one (a GEMM with the residual add in its epilogue), replaces residual + linear."""

    def norm_linear(x, norm_weight, eps, weight, bias=None, out_dtype=None):  # norm_weight None: x normed
        y = linear(x if norm_weight is None else rms_norm(x, norm_weight, eps), weight, bias)
        return y if out_dtype is None else y.to(out_dtype)

    norm_qkv = norm_qkv_op(rms_norm, linear)

    def norm_qkv_rope(x, norm_weight, eps, weight, bias, heads: QKVHeads, cos_sin, positions, kv_cache, slot_mapping):
        return rope_write_kv(*norm_qkv(x, norm_weight, eps, weight, bias, heads), cos_sin, positions, kv_cache,
                             slot_mapping)

    def add_linear(x, weight, residual):
        return residual + linear(x, weight)

    def norm_gate_up_silu(x, norm_weight, eps, weight):
        return silu_and_mul(norm_linear(x, norm_weight, eps, weight))

    ops = FusedOps(norm_qkv_rope, linear_residual or add_linear, norm_gate_up_silu, norm_linear)
    ops = ops._replace(layer_tail=tail_op(ops), linear_residual_norm=residual_norm_op(ops.linear_residual, rms_norm))
    return ops._replace(layer_tail_norm=tail_norm_op(ops))
