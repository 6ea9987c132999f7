"""Triton twins of the sampler's torch reference (kernels/sampler_reference.py), same signatures.

`sample`. (1) Rows x chunks of CHUNK tokens: each chunk's max and first argmax of x =
logits/T, the Gumbel-max of rows without filters, and for filtered rows the chunk's
candidates: at most CAP of its largest keys (order-preserving integer keys of x), found by a
bisection over the chunk in registers, and the largest key left out. The chunk program of a
row that arrives last (an arrival counter it puts back to 0) combines the row's chunks in
chunk order and runs the reference's threshold searches (top-k count, top-p mass, min-p) over
the candidates alone, then the Gumbel-max over the kept ones. Every key above the largest key
left out (NC) is a candidate, so the result is the reference's token whenever the filters
exclude NC (path 0: top-k <= CAP without ties across the cut, or a peaked distribution).
Otherwise a row under top-p without top-k (a near-flat row) finds the threshold by a search
over bins split over rows x chunks (path 1, kernels/sampling_topp.py: ROUNDS launches and a
last one that draws); any other row, or one whose last bin holds too many tokens, is drawn
by rejection rounds over the whole row (path 2, kernels/sampling_rejection.py) in that last
launch. 2 + ROUNDS launches whatever the rows ask; rows not on a path return at once.
Chunks, candidates and bins depend on V only, so a row's token never depends on the batch.

`argmax`: torch.argmax's index (first maximal, NaN above every number) in one launch of rows
x chunks, the last chunk of a row to arrive reducing the chunks' results.

The logits processors and logprobs are in kernels/processors.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_common import _gumbel, _keys, _largest_where, _row_hash, _row_params, arrival_counters
from .sampling_topp import BINS, ROUNDS, band_kernel, bins_kernel, first_bins

# Vocabulary elements per loop iteration and warps per row: one program streams a whole row,
# so few, wide iterations (each ends in block reductions) keep a pass short.
BLOCK = 8192
NUM_WARPS = 16
# The split draw: tokens per chunk program, candidates kept per chunk, warps.
CHUNK = 4096
CAP = 64
STEPS = 12  # at most this many halvings of a chunk's candidate cut: (max - min) / 2**12 apart
ENOUGH = 32  # the cut's bisection stops once this many candidates are kept (1 to CAP; rows with
# top-p and no top-k always bisect to CAP)
CHUNK_WARPS = 4  # 8 halves the registers (128, not 212) but ran slower at bs 64 (docs/performance.md)
SEARCH_BITS = 1  # the selects' key bisections: bits decided per counting step
ARGMAX_CHUNK = 4096  # argmax: tokens per program


@triton.jit
def _candidate_cut(x, inside, n_in, mc, xmin, enough, CAP: tl.constexpr, STEPS: tl.constexpr):
    """tau keeping at most CAP of the chunk's x >= tau: a bisection between the chunk's max mc
    and its smallest finite x xmin (at most 64 below) of at most STEPS halvings, which stops
    once hi keeps `enough` (a data-dependent count of steps, a function of the chunk and the
    row's filters alone);
    count(x >= hi) <= CAP always, count(x >= lo) > CAP while bisecting. Ties at the max
    beyond CAP: +inf (none); a chunk of <= CAP (n_in tokens): -inf."""
    lo = tl.maximum(xmin, mc - 64.0)
    few = tl.sum((inside & (x >= lo)).to(tl.int32), 0) <= CAP
    hi = mc
    hi_n = tl.sum((x >= mc).to(tl.int32), 0)
    ties = hi_n > CAP
    i = 0
    while (i < STEPS) & (hi_n < enough) & (few == 0):
        mid = lo + (hi - lo) * 0.5
        cnt = tl.sum((x >= mid).to(tl.int32), 0)
        more = cnt > CAP
        lo = tl.where(more, mid, lo)
        hi = tl.where(more, hi, mid)
        hi_n = tl.where(more, hi_n, cnt)
        i += 1
    tau = tl.where(few, lo, hi)
    tau = tl.where(ties, float("inf"), tau)
    return tl.where(n_in <= CAP, -float("inf"), tau)


@triton.jit
def _chunk_kernel(logits_ptr, proc_ptr, active_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, pos_ptr,
                  cand_x_ptr, cand_id_ptr, sf_ptr, si_ptr, arrivals_ptr, out_ptr, path_ptr, state_ptr, bounds_ptr, V,
                  stride, C, CH: tl.constexpr, CAP: tl.constexpr, STEPS: tl.constexpr, C_PAD: tl.constexpr,
                  NB: tl.constexpr, G: tl.constexpr, WAYS: tl.constexpr, ENOUGH: tl.constexpr):
    """Program (row r, chunk c) over CH tokens of the row: the chunk's max of x = l/t and its
    first argmax; rows without filters: the Gumbel-max (value, id); filtered rows: the chunk's
    candidates, the tokens with x >= tau for a tau that keeps at most CAP of them (a bisection
    on values between the chunk's max and its smallest finite x, at most 64 below, over the
    chunk held in registers), written compacted, the largest key left out and, for top-p
    without top-k, the chunk's mass sum(exp(x - chunk max)). Per chunk: sf [m, gumbel best
    (filtered rows: the smallest finite x), mass, x left out], si [argmax, gumbel argmax,
    candidates, key left out]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)  # int32 columns: half the registers of int64 ones
    src = logits_ptr + r * stride
    if tl.load(active_ptr + r) != 0:
        src = proc_ptr + r * stride
    temp, k, top_p, min_p, k_on, p_on, filtered = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, r, V)
    t = tl.where(temp <= 0, 1.0, tl.maximum(temp, 1e-6))
    cols = c * CH + tl.arange(0, CH)
    inside = cols < V
    x = tl.load(src + cols, mask=inside, other=-float("inf")) / t
    mc = tl.max(x, 0)
    ax = c * CH  # the chunk's first argmax: greedy rows only
    if temp <= 0:
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
        by = tl.min(tl.where(inside & (x > -float("inf")), x, float("inf")), 0)
        n_in = tl.minimum(V - c * CH, CH)
        # top-p without top-k may keep many tokens: the full cut (more rows settled from the
        # candidates); with top-k or min-p alone, ENOUGH candidates per chunk settle nearly every row
        enough = tl.where(p_on & (k_on == 0), CAP, ENOUGH)
        sel = inside & (x >= _candidate_cut(x, inside, n_in, mc, by, enough, CAP, STEPS))
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        sel = sel & (pos < CAP)  # only +inf logits could pass CAP
        base = (r * C + c) * CAP
        tl.store(cand_x_ptr + base + pos, x, mask=sel)
        tl.store(cand_id_ptr + base + pos, cols.to(tl.int32), mask=sel)
        n = tl.sum(sel.to(tl.int64), 0)
        nc_x = tl.max(tl.where(inside & (sel == 0), x, -float("inf")), 0)
        # the largest key left out is the key of the largest x left out (keys keep the order)
        nc_key = tl.where(n_in > n, _keys(nc_x), -1)
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
    # The chunk that arrives last draws the row (from every chunk, in chunk order) and puts
    # the counter back to 0 for the next launch: no second kernel.
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr + r, 1, sem="acq_rel") == C - 1:
        tok, path = _select_row(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, pos_ptr, cand_x_ptr, cand_id_ptr,
                                sf_ptr, si_ptr, state_ptr, bounds_ptr, r, V, C, C_PAD, CAP, NB, G, WAYS)
        tl.store(out_ptr + r, tok.to(tl.int64))
        tl.store(path_ptr + r, path)
        tl.atomic_xchg(arrivals_ptr + r, 0)


@triton.jit
def _select_row(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, pos_ptr, cand_x_ptr, cand_id_ptr, sf_ptr,
                si_ptr, state_ptr, bounds_ptr, r, V, C, C_PAD: tl.constexpr, CAP: tl.constexpr, NB: tl.constexpr,
                G: tl.constexpr, WAYS: tl.constexpr):
    """(token, path) of row r: the row's token from its chunks, combined in chunk order. Greedy rows: the
    first argmax; rows without filters: the first Gumbel-max; filtered rows: the reference's
    thresholds (kernels/sampler_reference.keep_mask) over the candidates, then the Gumbel-max over
    the kept ones. The candidates hold every key above the largest key left out (NC), so a
    threshold found above NC is exact. A row whose kept set could reach NC gets path 1 (top-p
    without top-k: the split threshold search of kernels/sampling_topp.py, whose state and
    first bins are written here) or 2 (the rejection rounds)."""
    temp, k, top_p, min_p, k_on, p_on, filtered = _row_params(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, r, V)
    ci = tl.arange(0, C_PAD)
    cm = ci < C
    s = (r * C + ci) * 4
    m_c = tl.load(sf_ptr + s, mask=cm, other=-float("inf"))
    m = tl.max(m_c, 0)
    tok = tl.min(tl.where(cm & (m_c == m), tl.load(si_ptr + s, mask=cm, other=V), V), 0)
    path = tl.full((), 0, tl.int64)
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
            kth = _largest_where(skey, valid.to(tl.int32), k, lo, tl.max(key, 0), False, G, WAYS)
        in_k = valid & (key >= kth)
        over = tl.full((), 0, tl.int64)
        z = 0.0
        if p_on:
            if k_on:
                z = tl.sum(tl.where(in_k, e, 0.0), 0)
            else:
                mass_c = tl.load(sf_ptr + s + 2, mask=cm, other=0.0)
                z = tl.sum(tl.where(m_c == -float("inf"), 0.0, mass_c * tl.exp(m_c - m)), 0)
            lo = tl.min(tl.where(in_k, key, 1 << 32), 0) - 1
            hi = tl.max(tl.where(in_k, key, -1), 0) - 1
            over = _largest_where(skey, tl.where(in_k, e, 0.0), top_p * z, lo, hi, True, G, WAYS) + 1
        keep = in_k & (key >= over) & (e >= min_p)
        y = tl.where(keep, xs + _gumbel(_row_hash(seeds_ptr, pos_ptr, r), ids), -float("inf"))
        best = tl.max(y, 0)
        tok = tl.min(tl.where(keep & (y == best), ids, V), 0)
        # Is NC (and so every token left out) outside the kept set, by a threshold known exactly?
        z_exact = (k_on == 0) | (kth > nc)
        out = (nc < 0) | (k_on & (kth > nc)) | (p_on & z_exact & (over > nc)) | ((nc_e < min_p) & (z_exact | (p_on == 0)))
        if out == 0:
            path = tl.where(p_on & (k_on == 0), 1, 2).to(tl.int64)
            if path == 1:  # the mass above NC fits top_p * z: search below NC
                b = tl.max(tl.load(sf_ptr + s + 3, mask=cm, other=-float("inf")), 0)
                a = tl.minimum(tl.maximum(tl.min(tl.load(sf_ptr + s + 1, mask=cm, other=float("inf")), 0), m - 88.0), b)
                s_hi = tl.sum(tl.where(key > nc, e, 0.0), 0)  # candidates below NC are in the bins
                first_bins(state_ptr, bounds_ptr, r, m, s_hi, top_p * z, a, b, NB)
    return tok, path


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, min_p: torch.Tensor | None = None,
           processed: torch.Tensor | None = None, active: torch.Tensor | None = None,
           block: int = CHUNK, cap: int = CAP) -> torch.Tensor:
    """kernels/sampler_reference.sample's tokens. With `processed` [R, V] and `active` [R], rows whose
    active flag is set read `processed` instead of `logits`. `block`: tokens per chunk (and per
    iteration of the rejection rounds); `cap`: candidates per chunk (and bin tokens per chunk
    on path 1). The launches are in the module docstring; the chunking depends on V only, so
    a row's token never depends on the batch."""
    return draw(logits, temperature, top_k, top_p, seeds, positions, min_p, processed, active, block, cap)[0]


def draw(logits, temperature, top_k, top_p, seeds, positions, min_p, processed, active, block, cap,
         rounds: int = ROUNDS, bins: int = BINS, warps: int = CHUNK_WARPS, steps: int = STEPS,
         search_bits: int = SEARCH_BITS, enough: int = ENOUGH):
    """(tokens [R], path [R]: 0 settled from the candidates, 1 by the split threshold search,
    2 by the rejection rounds)."""
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
    path = torch.empty(R, dtype=torch.int64, device=dev)
    state = torch.empty(R, 3, dtype=torch.float32, device=dev)
    bounds = torch.empty(R, bins + 1, dtype=torch.float32, device=dev)
    part_m = torch.empty(R, C, bins, dtype=torch.float32, device=dev)
    part_n = torch.empty(R, C, bins, dtype=torch.int32, device=dev)
    params = (temperature, top_k, top_p, min_p)
    arrivals = arrival_counters("sample", R, dev)
    pads = dict(C_PAD=triton.next_power_of_2(C), NB=bins, num_warps=warps)
    search = dict(G=search_bits, WAYS=2**search_bits)
    _chunk_kernel[(R, C)](logits, processed, active, *params, *hashes, cand_x, cand_id, sf, si, arrivals, out, path,
                          state, bounds, V, V, C, CH=block, CAP=cap, STEPS=steps, ENOUGH=min(enough, cap), **pads, **search)
    for last in [False] * (rounds - 1) + [True]:
        bins_kernel[(R, C)](logits, processed, active, temperature, path, state, bounds, part_m, part_n, arrivals,
                            V, V, C, CH=block, CAP=cap, LAST=last, **pads)
    band_kernel[(R, C)](logits, processed, active, *params, *hashes, cand_x, cand_id, sf, si, state, bounds, arrivals,
                        out, path, V, V, C, CH=block, CAP=cap, **pads, **search)
    return out, path


# ---- greedy argmax -----------------------------------------------------------------------------


@triton.jit
def _argmax_kernel(x_ptr, key_ptr, idx_ptr, arrivals_ptr, out_ptr, V, stride, C, CH: tl.constexpr,
                   C_PAD: tl.constexpr):
    """Program (row r, chunk c): the chunk's largest key and its first index (NaN above every
    number, -0.0 == +0.0, as torch.argmax); the last chunk of the row to arrive reduces the
    row's chunks (first chunk on ties) and puts the counter back to 0."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CH + tl.arange(0, CH)
    inside = cols < V
    x = tl.load(x_ptr + r * stride + cols, mask=inside, other=0.0).to(tl.float32)
    key = tl.where(inside, tl.where(x != x, 4294967296, _keys(x)), -1)
    best = tl.max(key, 0)
    tl.store(key_ptr + r * C + c, best)
    tl.store(idx_ptr + r * C + c, tl.min(tl.where(key == best, cols, V), 0))
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr + r, 1, sem="acq_rel") == C - 1:
        ci = tl.arange(0, C_PAD)
        keys = tl.load(key_ptr + r * C + ci, mask=ci < C, other=-1)
        idx = tl.load(idx_ptr + r * C + ci, mask=ci < C, other=V)
        tl.store(out_ptr + r, tl.min(tl.where(keys == tl.max(keys, 0), idx, V), 0).to(tl.int64))
        tl.atomic_xchg(arrivals_ptr + r, 0)


def argmax(logits: torch.Tensor, chunk: int = ARGMAX_CHUNK, out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/sampler_reference.greedy (torch.argmax over the last dim of [R, V]) -> int64 [R],
    written into `out` (contiguous int64 [R]) when given."""
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    C = triton.cdiv(V, chunk)
    key = torch.empty(R, C, dtype=torch.int64, device=logits.device)
    idx = torch.empty(R, C, dtype=torch.int32, device=logits.device)
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    assert out.shape == (R,) and out.dtype == torch.int64 and out.is_contiguous()
    _argmax_kernel[(R, C)](logits, key, idx, arrival_counters("argmax", R, logits.device), out, V, logits.stride(0),
                           C, CH=chunk, C_PAD=triton.next_power_of_2(C), num_warps=4)
    return out
