"""Kernel families behind one registry.

Each family has a torch reference (kernels/reference.py); faster implementations share
its signature and are tested against it. `get_kernels(name)` returns a KernelSet the
model calls through, so the choice is made once, at build time, never per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from . import reference, sampler_reference
from .composed import argmax_op, compose, norm_qkv_op


@dataclass(frozen=True)
class KernelSet:
    name: str
    rms_norm: Callable
    embed_norm: Callable  # (ids, table, norm weight, eps) -> (table[ids], its RMSNorm): hoisted-norm steps
    silu_and_mul: Callable
    rope_write_kv: Callable
    paged_attention: Callable
    linear: Callable
    # a matrix multiply with its neighbours (kernels/composed.py defines them; the Triton set
    # runs its fused kernels, kernels/decode_linear.py, for the shapes chosen at build time and
    # steps of few rows, the composition elsewhere)
    norm_qkv_rope: Callable
    linear_residual: Callable
    norm_gate_up_silu: Callable
    norm_linear: Callable
    # a layer after attention: o + residual, norm + gate_up + SiLU-mul, down + residual (composed.tail_op;
    # the Triton set's persistent kernel for steps of 33-64 rows, kernels/decode_persistent.py)
    layer_tail: Callable
    # the down projection + residual with the next layer's RMSNorm of the result, and layer_tail
    # with it (composed.py; the Triton set's two-kernel form at 17-64 rows: kernels/split_residual.py),
    # for steps whose next qkv takes its input normed (the model asks rope_in_attention)
    linear_residual_norm: Callable
    layer_tail_norm: Callable
    # the LM head of a greedy step: fp32 logits, each row's argmax written into `tokens` (composed.argmax_op;
    # the Triton set's fused GEMV and TMA head take it in their epilogue, decode_kernel._argmax_epilogue);
    # store=False (the greedy step, models/llama.py greedy_tokens): the tokens alone, no logits written
    norm_linear_argmax: Callable
    # decode steps whose qkv is not one fused kernel: norm + qkv (+ Qwen3's q/k norms) not
    # rotated, then RoPE + KV write + attention in one op; rope_in_attention(qkv weight, rows,
    # q_len, heads) says which steps (a shape-only test, the same for every replay of a key)
    norm_qkv: Callable
    rope_paged_attention: Callable
    rope_in_attention: Callable
    # the sampler (kernels/sampler_reference.py is the torch reference, kernels/sampling.py the Triton twin)
    sample: Callable
    process_logits: Callable
    top_logprobs: Callable
    gumbel_noise: Callable  # the sampler's noise alone: (row hashes [R], vocab ids [R, N]) -> [R, N]
    argmax: Callable  # greedy keys: logits [R, V] (, out=int64 [R]) -> int64 [R], the first maximal index


_REGISTRY: dict[str, Callable[[], KernelSet]] = {
    "torch": lambda: KernelSet(
        name="torch",
        rms_norm=reference.rms_norm,
        embed_norm=reference.embed_norm,
        silu_and_mul=reference.silu_and_mul,
        rope_write_kv=reference.rope_write_kv,
        paged_attention=reference.paged_attention,
        linear=reference.linear,
        **_with_argmax(compose(reference.rms_norm, reference.linear, reference.silu_and_mul, reference.rope_write_kv),
                       sampler_reference.greedy)._asdict(),
        norm_qkv=norm_qkv_op(reference.rms_norm, reference.linear),
        rope_paged_attention=reference.rope_paged_attention,
        rope_in_attention=lambda weight, rows, q_len, heads: q_len == 1,  # the same rounding as the two ops
        sample=sampler_reference.sample,
        process_logits=sampler_reference.process,
        top_logprobs=sampler_reference.top_logprobs,
        gumbel_noise=sampler_reference.gumbel_noise,
        argmax=sampler_reference.greedy,
    ),
    "triton": lambda: _triton_set(),
}


def _triton_set() -> KernelSet:
    from . import decode_linear as dl
    from . import linear as lin
    from . import attention as at
    from . import triton_ops as t

    from . import processors as pr
    from . import sampling as s
    from .split_residual import with_split

    fused = with_split(dl.dispatch(_with_argmax(compose(t.rms_norm, lin.linear, t.silu_and_mul, t.rope_write_kv,
                                                        lin.linear_residual), s.argmax)), t.rms_norm)
    return KernelSet(name="triton", rms_norm=t.rms_norm, embed_norm=t.embed_norm, silu_and_mul=t.silu_and_mul,
                     rope_write_kv=t.rope_write_kv, paged_attention=at.paged_attention, linear=lin.linear,
                     **fused._asdict(),
                     norm_qkv=norm_qkv_op(t.rms_norm, lin.linear), rope_paged_attention=at.rope_paged_attention,
                     rope_in_attention=_rope_in_attention,
                     sample=s.sample, process_logits=pr.process, top_logprobs=pr.top_logprobs,
                     gumbel_noise=t.gumbel_noise, argmax=s.argmax)


def _with_argmax(ops, argmax: Callable):
    """ops with the greedy LM head as its head then `argmax` (composed.argmax_op)."""
    return ops._replace(norm_linear_argmax=argmax_op(ops.norm_linear, argmax))


def _rope_in_attention(weight, rows: int, q_len: int, heads) -> bool:
    """The Triton set: decode steps whose qkv is not the fused kernel (which writes the cache in
    its epilogue) rotate and write the cache inside the attention kernel."""
    from . import decode_linear as dl

    return q_len == 1 and (heads.q_norm is not None or not dl.fused("norm_qkv_rope", weight, rows))


def resolve(name: str, device_type: str) -> str:
    """`auto` is Triton on CUDA and the torch references elsewhere. `triton` off CUDA runs
    only through Triton's interpreter (TRITON_INTERPRET=1: slow, for tests)."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    interpreted = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
    if name == "triton" and device_type != "cuda" and not interpreted:
        raise ConfigError(f"kernels = 'triton' needs a CUDA device, and this run is on {device_type}. Use "
                          f"kernels: torch (or auto) off the GPU, or set TRITON_INTERPRET=1 to run the Triton "
                          f"kernels through Triton's interpreter (slow; for tests).")
    return name


def get_kernels(name: str = "torch") -> KernelSet:
    if name not in _REGISTRY:
        raise ValueError(f"unknown kernel set {name!r}; available: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()
