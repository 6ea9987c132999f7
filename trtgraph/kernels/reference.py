"""Torch reference kernels. Every op here is capture-safe: fixed shapes for a fixed graph
key, no host syncs, no data-dependent shapes. Triton versions share these signatures and
are held against them in tests.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back: x [T, H], weight [H]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def embed_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(table[ids], rms_norm of it): the embedding lookup and the first layer's norm [T, H] each."""
    h = torch.nn.functional.embedding(ids, table)
    return h, rms_norm(h, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, heads, D]; cos_sin [max_pos, D] (cos | sin halves); positions [T]."""
    cs = cos_sin.index_select(0, positions)  # [T, D]
    cos, sin = cs.chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(x.dtype)  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at flat slots [T].

    Padding rows carry slots inside block 0, the null block no sequence owns.
    """
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, slots, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE on q [T, Hq, D] and k [T, Hkv, D]; rotated k and v written to the cache at
    slot_mapping [T]. Returns the rotated q."""
    write_kv(kv_cache, apply_rope(k, cos_sin, positions), v, slot_mapping)
    return apply_rope(q, cos_sin, positions)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    """Attention of a uniform-query-length step against the paged cache.

    q [B*q_len, Hq, D]; kv_cache [2, N, bs, Hkv, D]; block_tables [B, MB] (block ids);
    positions [B*q_len]: query token t sees cached keys 0..positions[t] of its sequence.
    The step's own keys must already be written. Returns [B*q_len, Hq, D].
    """
    num_tokens, num_heads, head_dim = q.shape
    batch = num_tokens // q_len
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    tables = block_tables[:batch]  # [B, MB]
    max_len = tables.shape[1] * block_size
    k = kv_cache[0][tables].reshape(batch, max_len, num_kv_heads, head_dim)  # [B, S, Hkv, D]
    v = kv_cache[1][tables].reshape(batch, max_len, num_kv_heads, head_dim)
    k = k.permute(0, 2, 3, 1)  # [B, Hkv, D, S]
    v = v.permute(0, 2, 1, 3)  # [B, Hkv, S, D]
    # queries grouped by kv head: [B, Hkv, q_len*G, D]
    qg = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(batch, num_kv_heads, q_len * group, head_dim)
    scores = torch.matmul(qg.float(), k.float()) * scale  # [B, Hkv, q_len*G, S]
    pos = positions[:num_tokens].view(batch, q_len, 1, 1).expand(batch, q_len, group, 1)
    pos = pos.reshape(batch, 1, q_len * group, 1)
    key_idx = torch.arange(max_len, device=q.device).view(1, 1, 1, max_len)
    scores = scores.masked_fill(key_idx > pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float())  # [B, Hkv, q_len*G, D]
    out = out.view(batch, num_kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)


def rope_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                         positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         block_tables: torch.Tensor, q_len: int, scale: float) -> torch.Tensor:
    """RoPE + the KV-cache write + attention in one op: q [T, Hq, D], k and v [T, Hkv, D] not
    yet rotated; rope_write_kv, then paged_attention of the rotated q. Returns [T, Hq, D]."""
    q = rope_write_kv(q, k, v, cos_sin, positions, kv_cache, slot_mapping)
    return paged_attention(q, kv_cache, block_tables, positions, q_len, scale)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias)."""
    return torch.nn.functional.linear(x, weight, bias)
