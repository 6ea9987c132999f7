"""The sampler's split threshold search for top-p without top-k (kernels/sampling.py): rows
whose kept set reaches past the per-chunk candidates (a near-flat distribution) find the
reference's top-p threshold over rows x chunks programs instead of one program per row.

The select (sampling.py) knows such a row's max m, the mass above the largest value left
out b (every key above it is a candidate) and that the threshold lies at or below b; it
writes the first BINS bins, (a, b] cut in equal widths, a the row's smallest finite value
(at most 88 below m, where exp(x - m) underflows). Each of ROUNDS rounds (`bins_kernel`):
every chunk sums exp(x - m) and counts its tokens per bin; the row's last chunk to arrive
adds them in chunk order, takes the highest bin whose lower edge still has more than
top_p * z above it (the threshold's key lies in it) and cuts that bin again. After the last
round (`band_kernel`) each chunk writes its tokens in the bin (at most CAP per chunk, else
the row takes the rejection rounds) and the Gumbel-max of its tokens above the bin; the
row's last chunk runs the reference's bisection over the bin's tokens with the mass above
the bin added, then the Gumbel-max over the kept tokens. Rows on the other paths return at
once, except that the last chunk of a row marked for rejection draws it there
(kernels/sampling_rejection.py). The chunks depend on V only: batch-invariant."""

import triton
import triton.language as tl

from .sampling_common import _gumbel, _keys, _largest_where, _row_hash
from .sampling_rejection import reject_row

BINS = 32  # bins per round (a power of two)
ROUNDS = 2  # so the last bin is (b - a) / BINS**ROUNDS wide


@triton.jit
def first_bins(state_ptr, bounds_ptr, r, m, s_hi, budget, a, b, NB: tl.constexpr):
    """Row r's search state [m, mass above the bins, top_p * z] and its first bin edges."""
    tl.store(state_ptr + r * 3, m)
    tl.store(state_ptr + r * 3 + 1, s_hi)
    tl.store(state_ptr + r * 3 + 2, budget)
    _cut(bounds_ptr + r * (NB + 1), a, b, NB)


@triton.jit
def _cut(edges_ptr, lo, hi, NB: tl.constexpr):
    j = tl.arange(0, NB)
    tl.store(edges_ptr + j, lo + (hi - lo) * (j.to(tl.float32) / NB))
    tl.store(edges_ptr + NB, hi)


@triton.jit
def _row_x(logits_ptr, proc_ptr, active_ptr, temp_ptr, r, c, V, stride, CH: tl.constexpr):
    """(cols, inside, x = logits / t) of chunk c of row r."""
    src = logits_ptr + r * stride
    if tl.load(active_ptr + r) != 0:
        src = proc_ptr + r * stride
    t = tl.maximum(tl.load(temp_ptr + r), 1e-6)  # rows on these paths have temperature > 0
    cols = c * CH + tl.arange(0, CH)
    inside = cols < V
    return cols, inside, tl.load(src + cols, mask=inside, other=-float("inf")) / t


@triton.jit
def bins_kernel(logits_ptr, proc_ptr, active_ptr, temp_ptr, path_ptr, state_ptr, bounds_ptr, part_m_ptr, part_n_ptr,
                arrivals_ptr, V, stride, C, CH: tl.constexpr, CAP: tl.constexpr, LAST: tl.constexpr,
                C_PAD: tl.constexpr, NB: tl.constexpr):
    """One round for the rows on path 1 (module docstring); a row whose threshold is found in
    no bin, or (last round) whose bin holds more than CAP tokens of a chunk, goes to path 2."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    if tl.load(path_ptr + r) == 1:
        cols, inside, x = _row_x(logits_ptr, proc_ptr, active_ptr, temp_ptr, r, c, V, stride, CH)
        e = tl.exp(x - tl.load(state_ptr + r * 3))
        edges = bounds_ptr + r * (NB + 1)
        base = (r * C + c) * NB
        for j in range(NB):
            inb = inside & (x > tl.load(edges + j)) & (x <= tl.load(edges + j + 1))
            tl.store(part_m_ptr + base + j, tl.sum(tl.where(inb, e, 0.0), 0))
            tl.store(part_n_ptr + base + j, tl.sum(inb.to(tl.int32), 0))
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + r, 1, sem="acq_rel") == C - 1:
            cc = tl.arange(0, C_PAD)[:, None]
            jr = tl.arange(0, NB)
            off = (r * C + cc) * NB + jr[None, :]
            mass = tl.sum(tl.load(part_m_ptr + off, mask=cc < C, other=0.0), 0)
            most = tl.max(tl.load(part_n_ptr + off, mask=cc < C, other=0), 0)
            s_hi = tl.load(state_ptr + r * 3 + 1)
            above = s_hi + tl.sum(tl.where(jr[None, :] >= jr[:, None], mass[None, :], 0.0), 1)  # over bin j's lower edge
            js = tl.max(tl.where(above > tl.load(state_ptr + r * 3 + 2), jr, -1), 0)
            ok = js >= 0
            if LAST:  # the draw needs the bin's tokens of each chunk in CAP slots
                ok = ok & (tl.sum(tl.where(jr == js, most, 0), 0) <= CAP)
            if ok:
                tl.store(state_ptr + r * 3 + 1, s_hi + tl.sum(tl.where(jr > js, mass, 0.0), 0))
                lo = tl.load(edges + js)
                hi = tl.load(edges + js + 1)
                if LAST:
                    tl.store(edges, lo)
                    tl.store(edges + NB, hi)
                else:
                    _cut(edges, lo, hi, NB)
            else:
                tl.store(path_ptr + r, 2)
            tl.atomic_xchg(arrivals_ptr + r, 0)


@triton.jit
def band_kernel(logits_ptr, proc_ptr, active_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, pos_ptr,
                band_x_ptr, band_id_ptr, sf_ptr, si_ptr, state_ptr, bounds_ptr, arrivals_ptr, out_ptr, path_ptr, V,
                stride, C, CH: tl.constexpr, CAP: tl.constexpr, C_PAD: tl.constexpr, NB: tl.constexpr, G: tl.constexpr,
                WAYS: tl.constexpr):
    """Path 1: the draw from the last bin (module docstring); path 2: the rejection rounds, in
    the row's last chunk to arrive. Per chunk it writes its bin tokens compacted (the
    candidates' buffers), their number (si slot 2) and its Gumbel-max above the bin (sf / si
    slot 1)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    path = tl.load(path_ptr + r)
    if path != 0:
        s = (r * C + c) * 4
        row_hash = _row_hash(seeds_ptr, pos_ptr, r)
        edges = bounds_ptr + r * (NB + 1)
        m = tl.load(state_ptr + r * 3)
        min_p = tl.load(min_p_ptr + r)
        if path == 1:
            cols, inside, x = _row_x(logits_ptr, proc_ptr, active_ptr, temp_ptr, r, c, V, stride, CH)
            hi = tl.load(edges + NB)
            band = inside & (x > tl.load(edges)) & (x <= hi)
            pos = tl.cumsum(band.to(tl.int32), 0) - 1
            band = band & (pos < CAP)
            tl.store(band_x_ptr + (r * C + c) * CAP + pos, x, mask=band)
            tl.store(band_id_ptr + (r * C + c) * CAP + pos, cols.to(tl.int32), mask=band)
            tl.store(si_ptr + s + 2, tl.sum(band.to(tl.int64), 0))
            kept = inside & (x > hi) & (tl.exp(x - m) >= min_p)
            y = tl.where(kept, x + _gumbel(row_hash, cols), -float("inf"))
            best = tl.max(y, 0)
            tl.store(sf_ptr + s + 1, best)
            tl.store(si_ptr + s + 1, tl.min(tl.where(kept & (y == best), cols, V), 0).to(tl.int64))
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + r, 1, sem="acq_rel") == C - 1:
            if path == 1:
                i = tl.arange(0, C_PAD * CAP)  # slot i: chunk i // CAP, entry i % CAP
                chunk = i // CAP
                valid = (chunk < C) & (i % CAP < tl.load(si_ptr + (r * C + chunk) * 4 + 2, mask=chunk < C, other=0))
                xs = tl.load(band_x_ptr + r * C * CAP + i, mask=valid, other=-float("inf"))
                ids = tl.load(band_id_ptr + r * C * CAP + i, mask=valid, other=0).to(tl.int64)
                key = tl.where(valid, _keys(xs), -1)
                e = tl.where(valid, tl.exp(xs - m), 0.0)
                k_lo = _keys(tl.load(edges))
                k_hi = _keys(tl.load(edges + NB))
                bound = tl.load(state_ptr + r * 3 + 2) - tl.load(state_ptr + r * 3 + 1)
                over = _largest_where((key - 2147483648).to(tl.int32), e, bound, k_lo, k_hi - 1, True, G, WAYS) + 1
                over = tl.minimum(tl.maximum(over, k_lo + 1), k_hi)
                keep = valid & (key >= over) & (e >= min_p)
                y = tl.where(keep, xs + _gumbel(row_hash, ids), -float("inf"))
                best = tl.max(y, 0)
                tok = tl.min(tl.where(keep & (y == best), ids, V), 0)
                cc = tl.arange(0, C_PAD)
                best_c = tl.load(sf_ptr + (r * C + cc) * 4 + 1, mask=cc < C, other=-float("inf"))
                above = tl.max(best_c, 0)
                tok_a = tl.min(tl.where((cc < C) & (best_c == above), tl.load(si_ptr + (r * C + cc) * 4 + 1, mask=cc < C,
                                                                                other=V), V), 0)
                tok = tl.where(above > best, tok_a, tl.where(best > above, tok, tl.minimum(tok, tok_a)))
                tl.store(out_ptr + r, tok.to(tl.int64))
            else:
                reject_row(logits_ptr, proc_ptr, active_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr,
                           pos_ptr, out_ptr, r, V, stride, CH)
            tl.atomic_xchg(arrivals_ptr + r, 0)
