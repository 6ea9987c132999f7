"""Triton twins of the sampler's torch reference (kernels/sampler_reference.py), same signatures.

`sample`, in three launches. (1) Rows x chunks of CHUNK tokens: each chunk's max and first
argmax of x = logits/T, the Gumbel-max of rows without filters, and for filtered rows the
chunk's candidates: at most CAP of its largest keys (order-preserving integer keys of x),
found by a bisection over the chunk in registers, and the largest key left out. (2) One
program per row combines its chunks in chunk order and runs the reference's threshold
searches (top-k count, top-p mass, min-p) over the candidates alone, then the Gumbel-max
over the kept ones. Every key above the largest key left out (NC) is a candidate, so the
result is the reference's token whenever the filters exclude NC; otherwise (3) the row is
marked, and one program per marked row draws it by rejection over the whole row: the
Gumbel-max candidate over all tokens is checked against the filters (one counting pass:
tokens strictly above it, their mass, and the best candidate among them); a rejected
candidate proves the threshold lies above it, so the next candidate is the best one
strictly above; top-k together with top-p also needs the top-k set's mass (a bisection).
With top-k <= CAP (no ties across the cut) or a peaked distribution the third launch
returns at once for every row; a near-flat row under top-p alone keeps more tokens than
the candidates and takes the rejection path. Chunks and candidates depend on V only, so a
row's token never depends on the batch.

The logits processors and logprobs are in kernels/processors.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_common import _gumbel, _keys, _row_hash, _row_params

# Vocabulary elements per loop iteration and warps per row: one program streams a whole row,
# so few, wide iterations (each ends in block reductions) keep a pass short.
BLOCK = 8192
NUM_WARPS = 16
# The split draw: tokens per chunk program, candidates kept per chunk, warps.
CHUNK = 4096
CAP = 64
STEPS = 12  # bisection steps for a chunk's candidate cut: (max - min) / 2**12 apart
CHUNK_WARPS = 4
SELECT_WARPS = 4


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
def _sample_kernel(logits_ptr, proc_ptr, active_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr,
                   pos_ptr, out_ptr, todo_ptr, V, stride, BLOCK: tl.constexpr):
    """The exact draw by rejection rounds, one program per row, for the rows `todo` marks (those
    whose kept set reaches below the candidates of `_chunk_kernel`)."""
    r = tl.program_id(0).to(tl.int64)
    if tl.load(todo_ptr + r) != 0:
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


@triton.jit
def _candidate_cut(x, inside, mc, CAP: tl.constexpr, STEPS: tl.constexpr):
    """tau keeping at most CAP of the chunk's x >= tau: a bisection between the chunk's max mc
    and its smallest finite x (at most 64 below); count(x >= hi) <= CAP always, count(x >= lo)
    > CAP while bisecting. Ties at the max beyond CAP: +inf (none); a chunk of <= CAP: -inf."""
    lo = tl.maximum(tl.min(tl.where(inside & (x > -float("inf")), x, float("inf")), 0), mc - 64.0)
    few = tl.sum((inside & (x >= lo)).to(tl.int32), 0) <= CAP
    hi = mc
    for _ in tl.static_range(STEPS):
        mid = lo + (hi - lo) * 0.5
        more = tl.sum((x >= mid).to(tl.int32), 0) > CAP
        lo = tl.where(more, mid, lo)
        hi = tl.where(more, hi, mid)
    tau = tl.where(few, lo, hi)
    tau = tl.where(tl.sum((x >= mc).to(tl.int32), 0) > CAP, float("inf"), tau)
    return tl.where(tl.sum(inside.to(tl.int32), 0) <= CAP, -float("inf"), tau)


@triton.jit
def _chunk_kernel(logits_ptr, proc_ptr, active_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, pos_ptr,
                  cand_x_ptr, cand_id_ptr, sf_ptr, si_ptr, V, stride, C, CH: tl.constexpr, CAP: tl.constexpr,
                  STEPS: tl.constexpr):
    """Program (row r, chunk c) over CH tokens of the row: the chunk's max of x = l/t and its
    first argmax; rows without filters: the Gumbel-max (value, id); filtered rows: the chunk's
    candidates, the tokens with x >= tau for a tau that keeps at most CAP of them (a bisection
    on values between the chunk's max and its smallest finite x, at most 64 below, over the
    chunk held in registers), written compacted, the largest key left out and, for top-p
    without top-k, the chunk's mass sum(exp(x - chunk max)). Per chunk: sf [m, gumbel best,
    mass, x left out], si [argmax, gumbel argmax, candidates, key left out]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    src = logits_ptr + r * stride
    if tl.load(active_ptr + r) != 0:
        src = proc_ptr + r * stride
    temp, k, top_p, min_p, k_on, p_on, filtered = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, r, V)
    t = tl.where(temp <= 0, 1.0, tl.maximum(temp, 1e-6))
    cols = c * CH + tl.arange(0, CH)
    inside = cols < V
    x = tl.load(src + cols, mask=inside, other=-float("inf")) / t
    mc = tl.max(x, 0)
    ax = tl.min(tl.where(inside & (x == mc), cols, V), 0)
    by = -float("inf")
    ay = ax
    mass = 0.0
    n = tl.full((), 0, tl.int64)
    nc_key = tl.full((), -1, tl.int64)
    nc_x = -float("inf")
    if (temp > 0) & (filtered == 0):
        y = tl.where(inside, x + _gumbel(_row_hash(seeds_ptr, pos_ptr, r), cols), -float("inf"))
        by = tl.max(y, 0)
        ay = tl.min(tl.where(inside & (y == by), cols, V), 0)
    if filtered:
        sel = inside & (x >= _candidate_cut(x, inside, mc, CAP, STEPS))
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        sel = sel & (pos < CAP)  # only +inf logits could pass CAP
        base = (r * C + c) * CAP
        tl.store(cand_x_ptr + base + pos, x, mask=sel)
        tl.store(cand_id_ptr + base + pos, cols.to(tl.int32), mask=sel)
        n = tl.sum(sel.to(tl.int64), 0)
        left = inside & (sel == 0)
        nc_key = tl.max(tl.where(left, _keys(x), -1), 0)
        nc_x = tl.max(tl.where(left, x, -float("inf")), 0)
        if p_on & (k_on == 0):
            mass = tl.sum(tl.where(x == -float("inf"), 0.0, tl.exp(x - mc)), 0)
    s = (r * C + c) * 4
    tl.store(sf_ptr + s, mc)
    tl.store(sf_ptr + s + 1, by)
    tl.store(sf_ptr + s + 2, mass)
    tl.store(sf_ptr + s + 3, nc_x)
    tl.store(si_ptr + s, ax.to(tl.int64))
    tl.store(si_ptr + s + 1, ay.to(tl.int64))
    tl.store(si_ptr + s + 2, n)
    tl.store(si_ptr + s + 3, nc_key)


@triton.jit
def _largest_where(skey, weight, bound, lo, hi, STRICT: tl.constexpr):
    """The largest v in [0, 2**32) with sum(weight where key >= v (key > v if STRICT)) > bound
    (>= when not STRICT), -1 where v = 0 fails: the reference's bisection, over values in
    registers. The answer, when found, lies in [lo, hi], so the bits they share are taken
    from hi without counting. skey: the key minus 2**31 as int32 (same order, half the
    registers)."""
    ans = tl.full((), 0, tl.int64)
    lo = tl.maximum(lo, 0)
    hi = tl.maximum(hi, lo)
    for i in tl.static_range(32):
        bit = tl.full((), 1, tl.int64) << (31 - i)
        cand = ans | bit
        if ((lo ^ hi) >> (31 - i)) == 0:  # a shared leading bit
            ans = tl.where((hi & bit) != 0, cand, ans)
        else:
            v = (cand - 2147483648).to(tl.int32)
            if STRICT:
                ok = tl.sum(tl.where(skey > v, weight, 0.0), 0) > bound
            else:
                ok = tl.sum(tl.where(skey >= v, weight, 0), 0) >= bound
            ans = tl.where(ok, cand, ans)
    if STRICT:
        found = tl.sum(tl.where(skey > -2147483648, weight, 0.0), 0) > bound
    else:
        found = tl.sum(weight, 0) >= bound
    return tl.where(found, ans, -1)


@triton.jit
def _select_kernel(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, pos_ptr, cand_x_ptr, cand_id_ptr, sf_ptr,
                   si_ptr, out_ptr, todo_ptr, V, C, C_PAD: tl.constexpr, CAP: tl.constexpr):
    """Program r: the row's token from its chunks, combined in chunk order. Greedy rows: the
    first argmax; rows without filters: the first Gumbel-max; filtered rows: the reference's
    thresholds (kernels/sampler_reference.keep_mask) over the candidates, then the Gumbel-max over
    the kept ones. The candidates hold every key above the largest key left out (NC), so a
    threshold found above NC is exact; a row whose kept set could reach NC is marked in
    `todo` for `_sample_kernel`."""
    r = tl.program_id(0).to(tl.int64)
    temp, k, top_p, min_p, k_on, p_on, filtered = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, r, V)
    ci = tl.arange(0, C_PAD)
    cm = ci < C
    s = (r * C + ci) * 4
    m_c = tl.load(sf_ptr + s, mask=cm, other=-float("inf"))
    m = tl.max(m_c, 0)
    tok = tl.min(tl.where(cm & (m_c == m), tl.load(si_ptr + s, mask=cm, other=V), V), 0)
    todo = tl.full((), 0, tl.int64)
    if (temp > 0) & (filtered == 0):
        by_c = tl.load(sf_ptr + s + 1, mask=cm, other=-float("inf"))
        by = tl.max(by_c, 0)
        tok = tl.min(tl.where(cm & (by_c == by), tl.load(si_ptr + s + 1, mask=cm, other=V), V), 0)
    if filtered:
        i = tl.arange(0, C_PAD * CAP)  # candidate slot i: chunk i // CAP, entry i % CAP
        chunk = i // CAP
        valid = (chunk < C) & (i % CAP < tl.load(si_ptr + (r * C + chunk) * 4 + 2, mask=chunk < C, other=0))
        xs = tl.load(cand_x_ptr + r * C * CAP + i, mask=valid, other=-float("inf"))
        ids = tl.load(cand_id_ptr + r * C * CAP + i, mask=valid, other=0).to(tl.int64)
        key = tl.where(valid, _keys(xs), -1)
        skey = (key - 2147483648).to(tl.int32)
        e = tl.where(valid, tl.exp(xs - m), 0.0)
        nc = tl.max(tl.load(si_ptr + s + 3, mask=cm, other=-1), 0)
        nc_e = tl.exp(tl.max(tl.load(sf_ptr + s + 3, mask=cm, other=-float("inf")), 0) - m)
        kth = tl.full((), 0, tl.int64)
        if k_on:
            lo = tl.min(tl.where(valid, key, 1 << 32), 0)
            kth = _largest_where(skey, valid.to(tl.int32), k, lo, tl.max(key, 0), False)
        in_k = valid & (key >= kth)
        over = tl.full((), 0, tl.int64)
        if p_on:
            if k_on:
                z = tl.sum(tl.where(in_k, e, 0.0), 0)
            else:
                mass_c = tl.load(sf_ptr + s + 2, mask=cm, other=0.0)
                z = tl.sum(tl.where(m_c == -float("inf"), 0.0, mass_c * tl.exp(m_c - m)), 0)
            lo = tl.min(tl.where(in_k, key, 1 << 32), 0) - 1
            hi = tl.max(tl.where(in_k, key, -1), 0) - 1
            over = _largest_where(skey, tl.where(in_k, e, 0.0), top_p * z, lo, hi, True) + 1
        keep = in_k & (key >= over) & (e >= min_p)
        y = tl.where(keep, xs + _gumbel(_row_hash(seeds_ptr, pos_ptr, r), ids), -float("inf"))
        best = tl.max(y, 0)
        tok = tl.min(tl.where(keep & (y == best), ids, V), 0)
        # Is NC (and so every token left out) outside the kept set, by a threshold known exactly?
        z_exact = (k_on == 0) | (kth > nc)
        out = (nc < 0) | (k_on & (kth > nc)) | (p_on & z_exact & (over > nc)) | ((nc_e < min_p) & (z_exact | (p_on == 0)))
        todo = (out == 0).to(tl.int64)
    tl.store(out_ptr + r, tok.to(tl.int64))
    tl.store(todo_ptr + r, todo)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, min_p: torch.Tensor | None = None,
           processed: torch.Tensor | None = None, active: torch.Tensor | None = None,
           block: int = CHUNK, cap: int = CAP) -> torch.Tensor:
    """kernels/sampler_reference.sample's tokens. With `processed` [R, V] and `active` [R], rows whose
    active flag is set read `processed` instead of `logits`. `block`: tokens per chunk (and per
    iteration of the rejection kernel); `cap`: candidates per chunk. Three launches whatever the
    rows ask: chunks (rows x chunks programs), the per-row select, the rejection rounds for the
    rows the select could not settle (the others return at once). The chunking depends on V
    only, so a row's token never depends on the batch."""
    return draw(logits, temperature, top_k, top_p, seeds, positions, min_p, processed, active, block, cap)[0]


def draw(logits, temperature, top_k, top_p, seeds, positions, min_p, processed, active, block, cap):
    """(tokens [R], rejected [R]: 1 where the row took the rejection rounds)."""
    R, V = logits.shape
    dev = logits.device
    logits = logits.contiguous()
    if processed is None:
        processed, active = logits, torch.zeros(R, dtype=torch.int64, device=dev)
    processed = processed.contiguous()
    min_p = torch.zeros_like(top_p) if min_p is None else min_p
    temperature, top_k = temperature.float().contiguous(), top_k.contiguous()
    top_p, min_p = top_p.float().contiguous(), min_p.float().contiguous()
    hashes = (seeds.contiguous(), positions.contiguous())
    C = triton.cdiv(V, block)
    cand_x = torch.empty(R, C, cap, dtype=torch.float32, device=dev)
    cand_id = torch.empty(R, C, cap, dtype=torch.int32, device=dev)
    sf = torch.empty(R, C, 4, dtype=torch.float32, device=dev)
    si = torch.empty(R, C, 4, dtype=torch.int64, device=dev)
    out = torch.empty(R, dtype=torch.int64, device=dev)
    todo = torch.empty(R, dtype=torch.int64, device=dev)
    params = (temperature, top_k, top_p, min_p)
    _chunk_kernel[(R, C)](logits, processed, active, *params, *hashes, cand_x, cand_id, sf, si, V, V, C,
                          CH=block, CAP=cap, STEPS=STEPS, num_warps=CHUNK_WARPS)
    _select_kernel[(R,)](*params, *hashes, cand_x, cand_id, sf, si, out, todo, V, C,
                         C_PAD=triton.next_power_of_2(C), CAP=cap, num_warps=SELECT_WARPS)
    _sample_kernel[(R,)](logits, processed, active, *params, *hashes, out, todo, V, V, BLOCK=2 * block,
                         num_warps=NUM_WARPS)
    return out, todo
