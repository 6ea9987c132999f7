"""Triton twins of the sampler reference's logits processors and logprobs
(kernels/sampler_reference.py), same signatures. `process`: rows without a processor return
at once; others get the penalties in one pass and then their logit_bias / min_tokens
entries. `top_logprobs`: rows that asked only. One program per row: a row's result never
depends on the other rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling import BLOCK, NUM_WARPS

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
def _logprobs_kernel(logits_ptr, tokens_ptr, want_ptr, vals_ptr, ids_ptr, V, K: tl.constexpr, BLOCK: tl.constexpr):
    """Rows that asked: log_softmax at the drawn token, then the top K in (value desc, id asc)
    order, one pass each (the row stays in L2)."""
    r = tl.program_id(0).to(tl.int64)
    if tl.load(want_ptr + r) != 0:
        src = logits_ptr + r * V
        m = -float("inf")
        z = 0.0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < V, other=-float("inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            z = z * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        log_z = m + tl.log(z)
        tl.store(vals_ptr + r * (K + 1), tl.load(src + tl.load(tokens_ptr + r)) - log_z)
        prev_v = float("inf")
        prev_i = -1
        for j in range(K):
            best = -float("inf")
            arg = V
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(src + cols, mask=cols < V, other=-float("inf"))
                after = (x < prev_v) | ((x == prev_v) & (cols > prev_i))
                y = tl.where(after & (cols < V), x, -float("inf"))
                b = tl.max(y, 0)
                i = tl.min(tl.where((y == b) & after & (cols < V), cols, V), 0)
                take = (b > best) | ((b == best) & (i < arg))
                arg = tl.where(take, i, arg)
                best = tl.where(take, b, best)
            tl.store(vals_ptr + r * (K + 1) + 1 + j, best - log_z)
            tl.store(ids_ptr + r * K + j, arg.to(tl.int64))
            prev_v = best
            prev_i = arg


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, want: torch.Tensor, k: int):
    """kernels/sampler_reference.top_logprobs for the rows with `want` set (others left unwritten)."""
    R, V = logits.shape
    logits = logits.contiguous()
    vals = torch.empty(R, 1 + k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(R, k, dtype=torch.int64, device=logits.device)
    _logprobs_kernel[(R,)](logits, tokens.contiguous(), want, vals, ids, V, K=k, BLOCK=BLOCK,
                           num_warps=NUM_WARPS)
    return vals, ids
