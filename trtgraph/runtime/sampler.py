"""The in-graph sampler.

greedy: argmax. sampled: per-row temperature, top-k, top-p, then the Gumbel-max trick with
noise from a counter-based hash of (seed, position, vocab id). The noise of a row depends on
nothing else, so a seeded request draws the same tokens whatever shares its batch, however
it is padded, and whether replayed or run eagerly. Rows with temperature 0 take the argmax.
All shapes are fixed by the logits' shape: the sampler can be recorded into a graph.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31 keep every product of two 32-bit values inside int64.
_M1, _M2, _M3 = 0x7FEB352D, 0x646F1B35, 0x5BD1E995


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors (values kept in [0, 2**32))."""
    x = x & _MASK32
    x = (x ^ (x >> 16)) * _M1 & _MASK32
    x = (x ^ (x >> 15)) * _M2 & _MASK32
    x = (x ^ (x >> 16)) * _M3 & _MASK32
    return x ^ (x >> 15)


def row_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] int64 in [0, 2**32): what a row's noise depends on."""
    return _mix32(_mix32(seeds ^ (seeds >> 32)) ^ (positions * 0x9E3779B1 & _MASK32))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0,1) fp32 of shape [R, V] from (seed [R], position [R], vocab id)."""
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return _uniform_at(row_hash(seeds, positions), vocab.unsqueeze(0))


def _uniform_at(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    bits = _mix32(rows.unsqueeze(1) ^ _mix32(ids + 0x3C6EF372))  # [R, V]
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_at(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [R, N] for vocab ids [R, N] (any order). On CUDA one fused Triton pass
    computes the same bits; elsewhere torch ops (~20 passes over [R, N] int64)."""
    rows = row_hash(seeds, positions)
    if ids.is_cuda:
        from ..kernels.triton_ops import gumbel_noise

        return gumbel_noise(rows, ids)
    return -torch.log(-torch.log(_uniform_at(rows, ids)))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32; temperature, top_p [R] fp32; top_k, seeds, positions [R] int64.
    top_k <= 0 or >= V means no top-k; top_p >= 1 means no top-p. positions: the index in
    its sequence of the token being drawn."""
    R, V = logits.shape
    is_greedy = temperature <= 0
    # Tiny positive temperatures act as 1e-6: dividing by a subnormal would overflow to inf.
    temp = torch.where(is_greedy, torch.ones_like(temperature), temperature.clamp_min(1e-6))
    scaled = logits / temp.unsqueeze(1)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(V, device=logits.device).unsqueeze(0)
    k = torch.where((top_k <= 0) | (top_k > V), torch.full_like(top_k, V), top_k)
    drop = rank >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop = drop | (before > top_p.unsqueeze(1))  # always keeps the best token
    gumbel = gumbel_at(seeds, positions, sorted_ids)  # the noise of each vocab id, in sorted order
    choice = (sorted_logits + gumbel).masked_fill(drop, float("-inf")).argmax(dim=-1, keepdim=True)
    drawn = sorted_ids.gather(1, choice).squeeze(1)
    return torch.where(is_greedy, logits.argmax(dim=-1), drawn)
