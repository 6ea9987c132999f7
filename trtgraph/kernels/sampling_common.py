"""Triton helpers the sampler's kernels share (kernels/sampling.py, sampling_rejection.py,
processors.py): order-preserving integer keys, the counter-based hash and Gumbel noise (the
reference's `_mix32`, `row_hash`, `gumbel_at` in kernels/sampler_reference.py, bit for bit), a
row's sampling parameters, the bisection over keys held in registers, and the arrival counters of the kernels whose last program for a
row reduces the row's chunks."""

import torch
import triton
import triton.language as tl

# Arrival counters of the kernels whose last program per row reduces the row (int32, zero
# between launches: that program resets its own), per (kernel, device). Allocated at the first
# launch (warm-up, before any capture) and never freed, so every recorded graph keeps valid
# addresses; a larger need adds a larger buffer.
_ARRIVALS: dict = {}


def kept_buffer(store: dict, key, device: torch.device, n: int, least: int, fill: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The newest of `key`'s persistent buffers in `store` (never freed: recorded graphs keep their
    addresses), a larger one added when n needs it (made at a warm-up, before any capture)."""
    held = store.setdefault(key, [])
    if not held or held[-1].numel() < n:
        held.append(torch.full((max(n, least),), fill, dtype=dtype, device=device))
    return held[-1]


def arrival_counters(name: str, n: int, device: torch.device) -> torch.Tensor:
    return kept_buffer(_ARRIVALS, (name, device), device, n, 1 << 10, 0, torch.int32)


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


@triton.jit
def _largest_where(skey, weight, bound, lo, hi, STRICT: tl.constexpr, G: tl.constexpr, WAYS: tl.constexpr):
    """The largest v in [0, 2**32) with sum(weight where key >= v (key > v if STRICT)) > bound
    (>= when not STRICT), -1 where v = 0 fails: the reference's bisection, over values in
    registers, G bits a step (WAYS - 1 thresholds counted a step). The answer,
    when found, lies in [lo, hi], so the leading bits they share are taken from hi without
    counting; a count (not STRICT, one bit a step) equal to the bound ends the search early.
    skey: the key minus 2**31 as int32 (same order, half the registers)."""
    lo = tl.maximum(lo, 0)
    hi = tl.maximum(hi, lo)
    n = tl.full((), 0, tl.int32)  # bits below the shared prefix, rounded up to a multiple of G
    for i in tl.static_range(32):
        n = tl.where(((lo ^ hi) >> i) != 0, i + 1, n)
    n = (n + G - 1) // G * G
    ans = (hi >> n) << n
    # WAYS - 1 one-dimensional counts a step, not one [WAYS, N] count: Triton 3.6's layout pass
    # shared the broadcast's layout conversion between the two inlined calls of a select (top-k
    # in one branch, top-p in another) when N is small (one chunk: a 320-token vocabulary) and
    # refused the kernel ("operand #0 does not dominate this use")
    s = n * 0
    exact = s  # 1 once a count equals the bound (not STRICT, G = 1): the answer is then the
    # smallest counted key at or above ans, and no more steps are needed
    while (s < n) & (exact == 0):
        base = ans
        for w in tl.static_range(1, WAYS):
            cand = base | (tl.full((), w, tl.int64) << (n - s - G))
            v = (cand - 2147483648).to(tl.int32)
            if STRICT:
                ok = tl.sum(tl.where(skey > v, weight, 0.0), 0) > bound
            else:
                cnt = tl.sum(tl.where(skey >= v, weight, 0), 0)
                ok = cnt >= bound
                if WAYS == 2:
                    exact = (cnt == bound).to(tl.int32)
            ans = tl.where(ok, cand, ans)  # the counts fall with w: the last that holds is the largest
        s += G
    if not STRICT:
        if exact != 0:
            v = (ans - 2147483648).to(tl.int32)
            ans = tl.min(tl.where((skey >= v) & (weight != 0), skey, 2147483647), 0).to(tl.int64) + 2147483648
    if STRICT:
        found = tl.sum(tl.where(skey > -2147483648, weight, 0.0), 0) > bound
    else:
        found = tl.sum(weight, 0) >= bound
    return tl.where(found, ans, -1)
