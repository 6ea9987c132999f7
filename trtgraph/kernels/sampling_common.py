"""Triton helpers the sampler's kernels share (kernels/sampling.py): order-preserving integer
keys, the counter-based hash and Gumbel noise (the reference's `_mix32`, `row_hash`,
`gumbel_at` in kernels/sampler_reference.py, bit for bit), and a row's sampling parameters."""

import triton
import triton.language as tl


@triton.jit
def _keys(x):
    """fp32 -> int64 in [0, 2**32) with the order of the values (-0.0 == +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2147483648


@triton.jit
def _mix32(x):
    """kernels/sampler_reference._mix32 in native uint32 arithmetic (products wrap mod 2**32, as the
    reference's masks make them): the same bits, without 64-bit multiplies."""
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x646F1B35
    x = (x ^ (x >> 16)) * 0x5BD1E995
    return x ^ (x >> 15)


@triton.jit
def _gumbel(row_hash, cols):
    bits = _mix32(row_hash.to(tl.uint32) ^ _mix32(cols.to(tl.uint32) + 0x3C6EF372))
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _mix32_i64(x):
    """kernels/sampler_reference._mix32 itself: int64 values masked to 32 bits after each product."""
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x646F1B35) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _row_hash(seeds_ptr, pos_ptr, r):
    """kernels/sampler_reference.row_hash of row r, in the kernel (in torch it is ~36 tiny launches)."""
    seed = tl.load(seeds_ptr + r).to(tl.int64)
    pos = tl.load(pos_ptr + r).to(tl.int64)
    return _mix32_i64(_mix32_i64(seed ^ (seed >> 32)) ^ ((pos * 0x9E3779B1) & 0xFFFFFFFF))


@triton.jit
def _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, r, V):
    temp = tl.load(temp_ptr + r)
    k = tl.load(top_k_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    min_p = tl.load(min_p_ptr + r)
    k_on = (k > 0) & (k < V)
    p_on = top_p < 1.0
    filtered = (temp > 0) & (k_on | p_on | (min_p > 0.0))
    return temp, k, top_p, min_p, k_on, p_on, filtered
