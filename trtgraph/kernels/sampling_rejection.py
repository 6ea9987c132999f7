"""The sampler's exact fallback (kernels/sampling.py): a row's draw by rejection rounds over the
whole row, for the rows whose kept set reaches past what the split passes hold. The Gumbel-max
candidate over all tokens is checked against the filters (one counting pass: tokens strictly
above it, their mass, and the best candidate among them); a rejected candidate proves the
threshold lies above it, so the next candidate is the best one strictly above; top-k together
with top-p also needs the top-k set's mass (a bisection). One program per row: serial, and
taken only by rows no split pass could settle."""

import triton
import triton.language as tl

from .sampling_common import _gumbel, _keys, _row_hash, _row_params


@triton.jit
def _running_argmax(v, cols, V, best, arg):
    """(best, arg) after one more block of values v at cols: the first index of a strictly
    larger block maximum replaces the running one (ties keep the earlier, lower id)."""
    b = tl.max(v, 0)
    i = tl.min(tl.where(v == b, cols, V), 0)
    take = b > best
    return tl.where(take, b, best), tl.where(take, i, arg)


@triton.jit
def _first_pass(src, V, t, row_hash, BLOCK: tl.constexpr):
    """(max of x = l/t, argmax of l, argmax of x + noise), first index on ties."""
    m = -float("inf")
    best_l = -float("inf")
    arg_l = 0
    best_y = -float("inf")
    arg_y = 0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        lg = tl.load(src + cols, mask=inside, other=-float("inf"))
        x = lg / t
        m = tl.maximum(m, tl.max(x, 0))
        best_l, arg_l = _running_argmax(lg, cols, V, best_l, arg_l)
        y = tl.where(inside, x + _gumbel(row_hash, cols), -float("inf"))
        best_y, arg_y = _running_argmax(y, cols, V, best_y, arg_y)
    return m, arg_l, arg_y


@triton.jit
def _block_above(src, start, V, t, m, above, BLOCK: tl.constexpr):
    """One block of a row from `start`: (cols, x = logits / t, sel = key(x) > above, the count
    of sel, the sum of exp(x - m) over sel)."""
    cols = start + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(src + cols, mask=inside, other=-float("inf")) / t
    sel = inside & (_keys(x) > above)
    return cols, x, sel, tl.sum(sel.to(tl.int64), 0), tl.sum(tl.where(sel, tl.exp(x - m), 0.0), 0)


@triton.jit
def _round(src, V, t, m, row_hash, above, BLOCK: tl.constexpr):
    """Over tokens with key > above: (count, sum of exp(x - m), argmax of x + noise)."""
    cnt = tl.full((), 0, tl.int64)
    mass = 0.0
    best = -float("inf")
    arg = 0
    for start in range(0, V, BLOCK):
        cols, x, sel, c, w = _block_above(src, start, V, t, m, above, BLOCK)
        cnt += c
        mass += w
        y = tl.where(sel, x + _gumbel(row_hash, cols), -float("inf"))
        best, arg = _running_argmax(y, cols, V, best, arg)
    return cnt, mass, arg


@triton.jit
def _count_mass(src, V, t, m, above, BLOCK: tl.constexpr):
    cnt = tl.full((), 0, tl.int64)
    mass = 0.0
    for start in range(0, V, BLOCK):
        cols, x, sel, c, w = _block_above(src, start, V, t, m, above, BLOCK)
        cnt += c
        mass += w
    return cnt, mass


@triton.jit
def _top_k_mass(src, V, t, m, k, lo, lo_cnt, lo_mass, hi, hi_cnt, BLOCK: tl.constexpr):
    """The mass of the top-k set {key > lo} once (lo, hi] holds at most one token or one key
    (P(v) = count(key > v) < k is false at lo and true at hi)."""
    while (lo_cnt - hi_cnt > 1) & (hi - lo > 1):
        mid = lo + (hi - lo) // 2
        cnt, mass = _count_mass(src, V, t, m, mid, BLOCK)
        if cnt < k:
            hi = mid
            hi_cnt = cnt
        else:
            lo = mid
            lo_cnt = cnt
            lo_mass = mass
    return lo_mass


@triton.jit
def reject_row(logits_ptr, proc_ptr, active_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, pos_ptr,
               out_ptr, r, V, stride, BLOCK: tl.constexpr):
    """Row r's exact draw by rejection rounds, stored at out_ptr + r."""
    src = logits_ptr + r * stride
    if tl.load(active_ptr + r) != 0:
        src = proc_ptr + r * stride
    temp, k, top_p, min_p, k_on, p_on, filtered = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, r, V)
    greedy = temp <= 0
    t = tl.where(greedy, 1.0, tl.maximum(temp, 1e-6))
    row_hash = _row_hash(seeds_ptr, pos_ptr, r)
    m, arg_l, c = _first_pass(src, V, t, row_hash, BLOCK)
    if filtered:
        z = 0.0
        if p_on & (k_on == 0):
            _n, z = _count_mass(src, V, t, m, tl.full((), -1, tl.int64), BLOCK)
        need_z = p_on & k_on
        lo = tl.full((), -1, tl.int64)
        lo_cnt = tl.full((), 0, tl.int64) + V
        lo_mass = z
        go = temp > 0  # true here
        while go:
            xc = tl.load(src + c) / t
            kc = _keys(xc)
            cnt, mass, nxt = _round(src, V, t, m, row_hash, kc, BLOCK)
            in_k = (cnt < k) | (k_on == 0)
            if in_k & need_z:
                z = _top_k_mass(src, V, t, m, k, lo, lo_cnt, lo_mass, kc, cnt, BLOCK)
            need_z = need_z & (in_k == 0)
            ok = in_k & ((mass <= top_p * z) | (p_on == 0)) & (tl.exp(xc - m) >= min_p)
            if ok == 0:
                if in_k == 0:
                    lo = kc
                    lo_cnt = cnt
                    lo_mass = mass
                c = nxt
            go = ok == 0
    tl.store(out_ptr + r, tl.where(greedy, arg_l, c).to(tl.int64))


