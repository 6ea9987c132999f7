"""Triton kernels for the decode hot path. Each shares its signature with the torch
reference in kernels/reference.py and is tested against it (on the CPU under
TRITON_INTERPRET=1, on the GPU with `pytest -m gpu`).

All are capture-safe: launch grids and every constexpr depend only on tensor shapes (fixed
per graph key); sequence lengths are read inside the kernels from device tensors; no host
syncs. Outputs are allocated per call (inside a graph they come from the graph's pool).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .sampling_common import _mix32_i64, kept_buffer

# ---------------------------------------------------------------------------------------
# RMSNorm; the embedding lookup with the first layer's RMSNorm
# ---------------------------------------------------------------------------------------


def row_warps(block: int) -> int:
    """Warps of a one-row-per-program kernel over a row of `block` elements (RMSNorm, the embedding's
    norm, split_residual's sum + norm): one 16-byte load of fp32 per thread and partial at 2,048 and
    more, at least 4. A function of the row's length only, so every kernel that takes a row's RMSNorm
    this way reduces it in the same order (their outputs are bitwise equal). On the H200 the split
    down projection's sum kernel at 16 warps against 4: the bs-64 step 9-27 us faster
    (scripts/decode_ablation.py sumw4 / light; docs/performance.md, fourteenth session)."""
    return max(4, min(16, block // 128))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, x_stride, out_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[-1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, n, x2.stride(0), out.stride(0), eps, BLOCK=block,
                                     num_warps=row_warps(block))
    return out.view(x.shape)


@triton.jit
def _embed_norm_kernel(ids_ptr, table_ptr, w_ptr, h_ptr, out_ptr, n_cols, table_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(table_ptr + tl.load(ids_ptr + row).to(tl.int64) * table_stride + cols, mask=mask, other=0.0)
    tl.store(h_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)  # _rms_norm_kernel's arithmetic
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def embed_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(table[ids], its RMSNorm) [T, H] each, in one kernel (ids valid: checked on admission)."""
    T, n = ids.shape[0], table.shape[1]
    h = torch.empty((T, n), dtype=table.dtype, device=table.device)
    out = torch.empty_like(h)
    if T > 0:
        block = triton.next_power_of_2(n)
        _embed_norm_kernel[(T,)](ids, table, weight, h, out, n, table.stride(0), eps, BLOCK=block,
                                 num_warps=row_warps(block))
    return h, out


# ---------------------------------------------------------------------------------------
# SiLU(gate) * up
# ---------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, gu_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gu = _rows(gate_up)
    n = gu.shape[-1] // 2
    out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, out, n, gu.stride(0), out.stride(0), BLOCK=block)
    return out


# ---------------------------------------------------------------------------------------
# RoPE on q and k, fused with the KV-cache write through the slot mapping
# ---------------------------------------------------------------------------------------


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cs_ptr, pos_ptr, slot_ptr, q_out_ptr, kv_ptr,
                    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    cache_kv_stride, cache_slot_stride, cache_head_stride,
                    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * (2 * HALF) + d)[None, :]
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + d)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    # q: rotate and write out (heads padded to a power of two)
    qm = h < NUM_Q_HEADS
    q1 = tl.load(q_ptr + t * q_stride_t + h * q_stride_h + d[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + t * q_stride_t + h * q_stride_h + HALF + d[None, :], mask=qm, other=0.0).to(tl.float32)
    qo = q_out_ptr + t * (NUM_Q_HEADS * 2 * HALF) + h * (2 * HALF) + d[None, :]
    tl.store(qo, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(qo + HALF, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    # k: rotate; k and v go straight into the cache slot
    km = h < NUM_KV_HEADS
    k1 = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d[None, :], mask=km, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + HALF + d[None, :], mask=km, other=0.0).to(tl.float32)
    kc = kv_ptr + slot * cache_slot_stride + h * cache_head_stride + d[None, :]
    tl.store(kc, (k1 * cos - k2 * sin).to(kv_ptr.dtype.element_ty), mask=km)
    tl.store(kc + HALF, (k2 * cos + k1 * sin).to(kv_ptr.dtype.element_ty), mask=km)
    vc = kc + cache_kv_stride
    v1 = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d[None, :], mask=km, other=0.0)
    v2 = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + HALF + d[None, :], mask=km, other=0.0)
    tl.store(vc, v1, mask=km)
    tl.store(vc + HALF, v2, mask=km)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] (strided views are fine) -> rotated q [T, Hq, D];
    rotated k and v written to kv_cache [2, N, bs, Hkv, D] at slot_mapping [T]."""
    T, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((T, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and kv_cache.is_contiguous()
    _rope_kv_kernel[(T,)](
        q, k, v, cos_sin, positions, slot_mapping, q_out, kv_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_kv_heads)))
    return q_out




def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): CUDA devices of compute capability 9.0+."""
    return device.type == "cuda" and _capability(device.index) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# Split-KV arrival counters (int32, zero between launches: the last split resets its own),
# per device. Allocated at the first split launch (warm-up, before any capture) and never
# freed, so every recorded graph keeps valid addresses; a larger need adds a larger buffer.
_ARRIVALS: dict = {}


_BEST: dict = {}  # the fused argmax's running maxima, per device (the same lifetime)


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    return kept_buffer(_ARRIVALS, device, device, n, 1 << 14, 0, torch.int32)


def argmax_best(n: int, device: torch.device) -> torch.Tensor:
    """Persistent int64 running maxima of the fused greedy argmax (decode_kernel._argmax_epilogue),
    at least n of them, all -1 between launches (the kernel puts them back)."""
    return kept_buffer(_BEST, device, device, n, 1 << 10, -1, torch.int64)


# ---------------------------------------------------------------------------------------
# Gumbel noise for the sampler: the same 32-bit hash as kernels/sampler_reference.py, one pass
# ---------------------------------------------------------------------------------------


@triton.jit
def _gumbel_kernel(rows_ptr, ids_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ids = tl.load(ids_ptr + r * n_cols + cols, mask=mask, other=0).to(tl.int64)
    row = tl.load(rows_ptr + r)
    bits = _mix32_i64(row ^ _mix32_i64(ids + 0x3C6EF372))
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    tl.store(out_ptr + r * n_cols + cols, -tl.log(-tl.log(u)), mask=mask)


def gumbel_noise(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """rows [R] int64 row hashes, ids [R, N] int64 vocab ids -> Gumbel noise [R, N] fp32."""
    ids = ids.contiguous()
    out = torch.empty(ids.shape, dtype=torch.float32, device=ids.device)
    block = 1024
    _gumbel_kernel[(ids.shape[0], triton.cdiv(ids.shape[1], block))](rows.contiguous(), ids, out, ids.shape[1],
                                                                     BLOCK=block)
    return out
