"""The in-graph sampler's torch reference (kernels/sampling.py and triton_ops.gumbel_noise are
the Triton twins; the runtime reaches both through the KernelSet).

greedy: argmax. sampled, per row, in this order:
  1. logits processors (rows whose `active` flag is set; `process`): logit_bias (OpenAI),
     repetition_penalty (Hugging Face: over prompt + generated tokens, positive logits divided,
     negative multiplied), presence / frequency penalty (OpenAI: over generated tokens,
     l - frequency * count - presence * (count > 0)), min_tokens (EOS and stop ids at -inf
     while fewer than min_tokens tokens have been generated);
  2. temperature (rows with temperature 0 take the argmax of the processed logits);
  3. filters, each keeping an upper set of the scaled logits x (`keep_mask`):
     top-k keeps every token with fewer than k tokens strictly above it (ties at the k-th
     value are all kept); top-p keeps a token when the probability mass strictly above it,
     renormalised over the top-k set, is <= top_p; min-p keeps p >= min_p * p_max;
  4. the Gumbel-max draw: argmax over the kept set of x + gumbel, with noise from a
     counter-based hash of (seed, position, vocab id).
The thresholds are found by a bitwise search over the order-preserving integer keys of x
(32 counting passes per filter), never by sorting. The noise of a row depends on nothing
else, so a seeded request draws the same tokens whatever shares its batch, however it is
padded, and whether replayed or run eagerly. All shapes are fixed by the logits' shape:
the sampler can be recorded into a graph.

logprobs come from the raw model logits (before processors, temperature and filters, as
vLLM's default): log_softmax of the logits, the drawn token's value and the top MAX_LOGPROBS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31 keep every product of two 32-bit values inside int64.
_M1, _M2, _M3 = 0x7FEB352D, 0x646F1B35, 0x5BD1E995


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors (values kept in [0, 2**32))."""
    x = x & _MASK32
    x = (x ^ (x >> 16)) * _M1 & _MASK32
    x = (x ^ (x >> 15)) * _M2 & _MASK32
    x = (x ^ (x >> 16)) * _M3 & _MASK32
    return x ^ (x >> 15)


def row_hash(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] int64 in [0, 2**32): what a row's noise depends on."""
    return _mix32(_mix32(seeds ^ (seeds >> 32)) ^ (positions * 0x9E3779B1 & _MASK32))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0,1) fp32 of shape [R, V] from (seed [R], position [R], vocab id)."""
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return _uniform_at(row_hash(seeds, positions), vocab.unsqueeze(0))


def _uniform_at(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    bits = _mix32(rows.unsqueeze(1) ^ _mix32(ids + 0x3C6EF372))  # [R, V]
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """rows [R] int64 row hashes (`row_hash`), ids [R, N] int64 vocab ids (any order) -> Gumbel
    noise [R, N] fp32. triton_ops.gumbel_noise has this signature; kernels/sampling.py computes
    the same bits inside its sampling kernel."""
    return -torch.log(-torch.log(_uniform_at(rows, ids)))


def gumbel_at(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [R, N] for vocab ids [R, N] of rows (seed, position)."""
    return gumbel_noise(row_hash(seeds, positions), ids)


def greedy(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first maximal index of each row, int64 [R] (written into `out` when given)."""
    return torch.argmax(logits, dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 in [0, 2**32) with the order of the values (-0.0 and +0.0 equal)."""
    bits = (x + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + (1 << 31)


def _largest_key_where(pred, device: torch.device) -> torch.Tensor:
    """Per row, the largest v in [0, 2**32) with pred(v) true, for a predicate that is true
    below some point and false above; -1 where pred(0) is false. 32 passes."""
    found = pred(torch.zeros(1, dtype=torch.int64, device=device))
    ans = torch.zeros_like(found, dtype=torch.int64)
    for bit in range(31, -1, -1):
        cand = ans | (1 << bit)
        ans = torch.where(pred(cand), cand, ans)
    return torch.where(found, ans, torch.full_like(ans, -1))


def keep_mask(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: the tokens the filters keep (module docstring) for scaled logits x [R, V]."""
    R, V = x.shape
    key = ordered_keys(x)
    k = torch.where((top_k <= 0) | (top_k > V), torch.full_like(top_k, V), top_k)
    # top-k: the k-th largest key is the largest v with at least k keys >= v
    kth = _largest_key_where(lambda v: (key >= v.unsqueeze(-1)).sum(-1) >= k, x.device)
    keep = key >= kth.unsqueeze(1)
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)  # the max is 1
    kept_e = torch.where(keep, e, torch.zeros_like(e))
    budget = top_p * kept_e.sum(-1)
    # top-p: the smallest v whose strictly-greater mass fits the budget
    over = _largest_key_where(lambda v: (kept_e * (key > v.unsqueeze(-1))).sum(-1) > budget, x.device) + 1
    keep &= (key >= over.unsqueeze(1)) | (top_p >= 1).unsqueeze(1)
    return keep & (e >= min_p.unsqueeze(1))


def scale(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_greedy [R], logits / temperature [R, V])."""
    is_greedy = temperature <= 0
    # Tiny positive temperatures act as 1e-6: dividing by a subnormal would overflow to inf.
    temp = torch.where(is_greedy, torch.ones_like(temperature), temperature.clamp_min(1e-6))
    return is_greedy, logits / temp.unsqueeze(1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, min_p: torch.Tensor | None = None,
           processed: torch.Tensor | None = None, active: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] fp32 (rows with `active` set read `processed` instead); temperature, top_p, min_p [R] fp32; top_k, seeds,
    positions [R] int64. top_k <= 0 or >= V means no top-k; top_p >= 1 no top-p; min_p 0 no
    min-p. positions: the index in its sequence of the token being drawn."""
    if processed is not None:
        logits = torch.where(active.unsqueeze(1) != 0, processed, logits)
    R, V = logits.shape
    min_p = torch.zeros_like(top_p) if min_p is None else min_p
    is_greedy, x = scale(logits, temperature)
    keep = keep_mask(x, top_k, top_p, min_p)
    ids = torch.arange(V, device=logits.device).expand(R, V)
    drawn = (x + gumbel_at(seeds, positions, ids)).masked_fill(~keep, float("-inf")).argmax(dim=-1)
    return torch.where(is_greedy, logits.argmax(dim=-1), drawn)


# ---- logits processors --------------------------------------------------------------------

PROMPT_BIT = 1 << 24  # token_counts: generated count in the low 24 bits, "in the prompt" in bit 24


@dataclass
class SlotState:
    """Per-sequence device state, by slot (the last slot is the padding rows' scratch):
    token_counts [S, V] int32, logit_bias ids / values [S, LOGIT_BIAS_CAPACITY], stop ids
    [S, MAX_STOP] (masked while min_tokens is not reached; unused entries repeat the first)."""
    token_counts: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    stop_ids: torch.Tensor


@dataclass
class RowParams:
    """The per-row views a sampled step reads (all [R])."""
    active: torch.Tensor  # int64: 1 where any processor applies
    slots: torch.Tensor  # int64
    eos_until: torch.Tensor  # int64: stop ids masked while the drawn position is below this
    repetition: torch.Tensor  # fp32
    presence: torch.Tensor  # fp32
    frequency: torch.Tensor  # fp32


def process(logits: torch.Tensor, rows: RowParams, state: SlotState, positions: torch.Tensor) -> torch.Tensor:
    """Processed logits [R, V]: rows without `active` are the logits unchanged."""
    slots = rows.slots
    bias_ids = state.bias_ids[slots]  # -1: unused entry (value 0)
    x = logits.scatter_add(1, bias_ids.clamp_min(0), state.bias_values[slots])
    counts = state.token_counts[slots]  # [R, V]
    generated = (counts & (PROMPT_BIT - 1)).to(torch.float32)
    rep = rows.repetition.unsqueeze(1)
    x = torch.where(counts != 0, torch.where(x > 0, x / rep, x * rep), x)
    x = x - rows.frequency.unsqueeze(1) * generated - rows.presence.unsqueeze(1) * (generated > 0).to(x.dtype)
    stop = state.stop_ids[slots]
    masked = (positions < rows.eos_until).unsqueeze(1)
    x = x.scatter(1, stop, torch.where(masked, float("-inf"), x.gather(1, stop)))
    return torch.where(rows.active.unsqueeze(1) != 0, x, logits)


def count_tokens(state: SlotState, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """token_counts[slot, token] += 1 for each row (in the graph, after the draw)."""
    V = state.token_counts.shape[1]
    flat = state.token_counts.view(-1)
    flat.index_add_(0, slots * V + tokens, torch.ones_like(tokens, dtype=flat.dtype))


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, want: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [R, 1 + k] fp32: the drawn token's log-probability then the top k, ids [R, k])
    of log_softmax(logits), the raw model logits. `want` [R]: the rows that asked (the
    reference computes every row)."""
    lp = torch.log_softmax(logits, dim=-1)
    top = lp.topk(k, dim=-1)
    return torch.cat([lp.gather(1, tokens.unsqueeze(1)), top.values], dim=1), top.indices


def scan_prompt(state: SlotState, slots: torch.Tensor, prompt_lens: torch.Tensor, ids: torch.Tensor,
                pos: torch.Tensor, last: torch.Tensor, q: int) -> None:
    """Prefill keys, in the graph: a row starting at position 0 clears its slot; each real fed
    token then sets the prompt bit (position < prompt length) or counts as generated (a
    sequence recomputed after preemption feeds its generated tokens again). slots,
    prompt_lens, last [B]; ids, pos [B * q]. Rows without a slot use the scratch slot."""
    counts = state.token_counts
    scratch, V = counts.shape[0] - 1, counts.shape[1]
    starts = pos.view(-1, q)[:, 0] == 0
    counts.index_fill_(0, torch.where(starts, slots, torch.full_like(slots, scratch)), 0)
    idx = torch.arange(ids.shape[0], device=ids.device)
    real = idx <= last.repeat_interleave(q)
    tok_slot = torch.where(real, slots.repeat_interleave(q), torch.full_like(idx, scratch))
    in_prompt = pos < prompt_lens.repeat_interleave(q)
    flat = counts.view(-1)
    to_scratch = scratch * V + ids
    bits = torch.where(in_prompt, tok_slot * V + ids, to_scratch)
    flat.index_put_((bits,), flat[bits] | PROMPT_BIT)
    flat.index_add_(0, torch.where(in_prompt, to_scratch, tok_slot * V + ids), (~in_prompt).to(flat.dtype))
