"""Triton twins of the sampler reference's logits processors and logprobs
(kernels/sampler_reference.py), same signatures. `process`: rows without a processor return
at once; others get the penalties in one pass and then their logit_bias / min_tokens
entries, one program per row. `top_logprobs`: rows that asked only, split over rows x
vocabulary chunks (the split depends on V only). A row's result never depends on the other
rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling import BLOCK, NUM_WARPS
from .sampling_common import arrival_counters

LOGPROBS_CHUNK = 4096  # top_logprobs: tokens per program

# ---- logits processors ------------------------------------------------------------------------


@triton.jit
def _penalised(x, counts, rep, presence, frequency):
    """The reference's arithmetic, in its order: repetition, then frequency and presence."""
    gen = (counts & 0xFFFFFF).to(tl.float32)
    x = tl.where(counts != 0, tl.where(x > 0, x / rep, x * rep), x)
    return x - frequency * gen - presence * (gen > 0).to(tl.float32)


@triton.jit
def _process_kernel(logits_ptr, out_ptr, active_ptr, slots_ptr, counts_ptr, bias_ids_ptr, bias_vals_ptr,
                    stop_ids_ptr, pos_ptr, until_ptr, rep_ptr, pres_ptr, freq_ptr, V, n_bias, n_stop,
                    BLOCK: tl.constexpr, BIAS_BLOCK: tl.constexpr, STOP_BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    if tl.load(active_ptr + r) != 0:
        slot = tl.load(slots_ptr + r)
        rep = tl.load(rep_ptr + r)
        presence = tl.load(pres_ptr + r)
        frequency = tl.load(freq_ptr + r)
        src, dst, cnt = logits_ptr + r * V, out_ptr + r * V, counts_ptr + slot * V
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            x = tl.load(src + cols, mask=inside, other=0.0)
            c = tl.load(cnt + cols, mask=inside, other=0)
            tl.store(dst + cols, _penalised(x, c, rep, presence, frequency), mask=inside)
        tl.debug_barrier()
        j = tl.arange(0, BIAS_BLOCK)
        ids = tl.load(bias_ids_ptr + slot * n_bias + j, mask=j < n_bias, other=-1)
        listed = ids >= 0
        b = tl.load(bias_vals_ptr + slot * n_bias + j, mask=listed, other=0.0)
        x = tl.load(src + ids, mask=listed, other=0.0) + b
        c = tl.load(cnt + ids, mask=listed, other=0)
        tl.store(dst + ids, _penalised(x, c, rep, presence, frequency), mask=listed)
        tl.debug_barrier()
        if tl.load(pos_ptr + r) < tl.load(until_ptr + r):
            s = tl.arange(0, STOP_BLOCK)
            stop = tl.load(stop_ids_ptr + slot * n_stop + s, mask=s < n_stop, other=0)
            tl.store(dst + stop, tl.full((STOP_BLOCK,), -float("inf"), tl.float32), mask=s < n_stop)


def process(logits: torch.Tensor, rows, state, positions: torch.Tensor) -> torch.Tensor:
    """kernels/sampler_reference.process for the rows with `active` set; the other rows of the result
    are left unwritten (the sampler reads `logits` for them)."""
    R, V = logits.shape
    logits = logits.contiguous()
    out = torch.empty_like(logits)
    n_bias, n_stop = state.bias_ids.shape[1], state.stop_ids.shape[1]
    _process_kernel[(R,)](logits, out, rows.active, rows.slots, state.token_counts, state.bias_ids, state.bias_values,
                          state.stop_ids, positions, rows.eos_until, rows.repetition, rows.presence, rows.frequency,
                          V, n_bias, n_stop, BLOCK=BLOCK, num_warps=NUM_WARPS, BIAS_BLOCK=triton.next_power_of_2(n_bias),
                          STOP_BLOCK=triton.next_power_of_2(n_stop))
    return out


# ---- logprobs ------------------------------------------------------------------------------------


@triton.jit
def _logprobs_kernel(logits_ptr, tokens_ptr, want_ptr, cand_v_ptr, cand_i_ptr, sums_ptr, arrivals_ptr, vals_ptr, ids_ptr,
                     V, C, K: tl.constexpr, CH: tl.constexpr, C_PAD: tl.constexpr, KC_PAD: tl.constexpr):
    """Program (row r, chunk c) of a row that asked: the chunk's max, its sum of exp(x - max) and
    its top K in (value desc, id asc) order, K passes over the chunk in registers. The row's
    chunk that arrives last (an arrival counter it puts back to 0) merges them in chunk order:
    log Z, the drawn token's log-probability, the row's top K from the C x K candidates."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if tl.load(want_ptr + r) != 0:
        src = logits_ptr + r * V
        cols = c * CH + tl.arange(0, CH)
        inside = cols < V
        x = tl.load(src + cols, mask=inside, other=-float("inf"))
        mc = tl.max(x, 0)
        zc = tl.where(mc == -float("inf"), 0.0, tl.sum(tl.exp(x - mc), 0))
        base = (r * C + c) * K
        avail = inside
        for j in range(K):
            b = tl.max(tl.where(avail, x, -float("inf")), 0)
            i = tl.min(tl.where(avail & (x == b), cols, V), 0)
            tl.store(cand_v_ptr + base + j, b)
            tl.store(cand_i_ptr + base + j, i)
            avail = avail & (cols != i)
        tl.store(sums_ptr + (r * C + c) * 2, mc)
        tl.store(sums_ptr + (r * C + c) * 2 + 1, zc)
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + r, 1, sem="acq_rel") == C - 1:
            ci = tl.arange(0, C_PAD)
            m_c = tl.load(sums_ptr + (r * C + ci) * 2, mask=ci < C, other=-float("inf"))
            z_c = tl.load(sums_ptr + (r * C + ci) * 2 + 1, mask=ci < C, other=0.0)
            m = tl.max(m_c, 0)
            log_z = tl.log(tl.sum(tl.where(m_c == -float("inf"), 0.0, z_c * tl.exp(m_c - m)), 0))
            # log_softmax as torch computes it: (x - max) - log(sum(exp(x - max)))
            tl.store(vals_ptr + r * (K + 1), (tl.load(src + tl.load(tokens_ptr + r)) - m) - log_z)
            n = tl.arange(0, KC_PAD)
            v = tl.load(cand_v_ptr + r * C * K + n, mask=n < C * K, other=-float("inf"))
            ids = tl.load(cand_i_ptr + r * C * K + n, mask=n < C * K, other=V)
            left = ids < V
            for j in range(K):
                b = tl.max(tl.where(left, v, -float("inf")), 0)
                a = tl.min(tl.where(left & (v == b), ids, V), 0)
                tl.store(vals_ptr + r * (K + 1) + 1 + j, (b - m) - log_z)
                tl.store(ids_ptr + r * K + j, a.to(tl.int64))
                left = left & (ids != a)
            tl.atomic_xchg(arrivals_ptr + r, 0)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, want: torch.Tensor, k: int, chunk: int = LOGPROBS_CHUNK):
    """kernels/sampler_reference.top_logprobs for the rows with `want` set (others left unwritten);
    ties in value in (id asc) order. One launch of rows x chunks of `chunk` tokens (the chunking
    depends on V only)."""
    R, V = logits.shape
    dev = logits.device
    logits = logits.contiguous()
    C = triton.cdiv(V, chunk)
    vals = torch.empty(R, 1 + k, dtype=torch.float32, device=dev)
    ids = torch.empty(R, k, dtype=torch.int64, device=dev)
    cand_v = torch.empty(R, C, k, dtype=torch.float32, device=dev)
    cand_i = torch.empty(R, C, k, dtype=torch.int32, device=dev)
    sums = torch.empty(R, C, 2, dtype=torch.float32, device=dev)
    _logprobs_kernel[(R, C)](logits, tokens.contiguous(), want, cand_v, cand_i, sums, arrival_counters("logprobs", R, dev),
                             vals, ids, V, C, K=k, CH=chunk, C_PAD=triton.next_power_of_2(C),
                             KC_PAD=triton.next_power_of_2(C * k), num_warps=4)
    return vals, ids
