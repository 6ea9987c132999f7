"""One decoder for the Llama family: Llama (incl. llama3 rope scaling), Mistral, Qwen2
(qkv bias), Qwen3 (q/k RMSNorm). Plain PyTorch, flat packed tokens, paged KV cache.

forward(input_ids [T], positions [T], meta) -> the residual stream [T, H]
compute_logits(hidden [R, H]) -> logits [R, V] in fp32 (the final norm, then the LM head)
greedy_tokens(hidden [R, H], normed, tokens) -> None: a greedy step's head, the tokens only

Each layer is four fused ops of the KernelSet (kernels/composed.py) around attention: norm +
qkv + RoPE + KV write, o + residual, norm + gate_up + SiLU-mul, down + residual (the last three
as one op on one GPU, `layer_tail`); decode steps
whose qkv is not one fused kernel (KernelSet.rope_in_attention) run norm + qkv, then RoPE + KV
write + attention in one op, and there (on one GPU) each layer's tail also takes the next layer's
norm (`layer_tail_norm`), so the next qkv reads its input normed: no norm of its own.

`meta` is an AttentionMetadata (runtime/step/metadata.py): q_len (a constant of the graph
key), slot_mapping [T], block_tables [B, MB] and the per-layer KV caches. Every shape
here is fixed by T and B, so the forward can be recorded into a CUDA graph.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels import KernelSet
from ..kernels.composed import QKVHeads
from .config import ModelConfig
from .parallel import TPGroup, local_config


def rope_cos_sin(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of the D/2 frequencies, then sin."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, cfg.rope_scaling_dict)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between (same formula as the reference implementation)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.cfg = cfg  # this rank's shapes (heads, KV heads)
        self.tp = tp
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5

    def heads(self) -> QKVHeads:
        cfg = self.cfg
        if not cfg.qk_norm:
            return QKVHeads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return QKVHeads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.q_norm.weight, self.k_norm.weight,
                        self.q_norm.eps)

    def forward(self, residual, norm: RMSNorm, positions, cos_sin, kv_cache, meta, ops: KernelSet):
        """residual [T, H] -> residual + attention(norm(residual)) (the o projection's sum)."""
        out = self.attend(residual, norm, positions, cos_sin, kv_cache, meta, ops)
        return _add_projection(ops, self.tp, out, self.o_proj.weight, residual)

    def attend(self, residual, norm: RMSNorm, positions, cos_sin, kv_cache, meta, ops: KernelSet, normed=None):
        """residual [T, H] -> attention(norm(residual)) [T, q_size], before the o projection;
        `normed`: norm(residual) already made (steps where rope_in_attention holds)."""
        T, heads, w = residual.shape[0], self.heads(), self.qkv_proj.weight
        slots = meta.slot_mapping[:T]
        if ops.rope_in_attention(w, T, meta.q_len, heads):  # RoPE + KV write inside the attention kernel
            q, k, v = (ops.norm_qkv(residual, norm.weight, norm.eps, w, self.qkv_proj.bias, heads) if normed is None
                       else ops.norm_qkv(normed, None, norm.eps, w, self.qkv_proj.bias, heads))
            out = ops.rope_paged_attention(q, k, v, cos_sin, positions, kv_cache, slots, meta.block_tables, meta.q_len,
                                           self.scale)
        else:
            assert normed is None, "a step whose qkv takes the norm in its kernel gets no normed input"
            q = ops.norm_qkv_rope(residual, norm.weight, norm.eps, w, self.qkv_proj.bias, heads, cos_sin, positions,
                                  kv_cache, slots)
            out = ops.paged_attention(q, kv_cache, meta.block_tables, positions, meta.q_len, self.scale)
        return out.reshape(T, self.cfg.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, residual, norm: RMSNorm, ops: KernelSet):
        """residual [T, H] -> residual + mlp(norm(residual))."""
        act = ops.norm_gate_up_silu(residual, norm.weight, norm.eps, self.gate_up_proj.weight)
        return _add_projection(ops, self.tp, act, self.down_proj.weight, residual)


def _add_projection(ops: KernelSet, tp: TPGroup, x, weight, residual):
    """residual + x @ weight.T for a row-parallel projection (o, down): fused on one GPU; with
    tensor parallelism the partial products are summed over ranks before the residual add."""
    if not tp.active:
        return ops.linear_residual(x, weight, residual)
    return residual + tp.all_reduce(ops.linear(x, weight))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, residual, normed, next_norm: RMSNorm | None, positions, cos_sin, kv_cache, meta,
                ops: KernelSet):
        """(The residual stream, its norm for this layer's qkv or None) in, (the residual stream,
        next_norm of it or None) out: each norm lives in its consumer, or, given `next_norm`, in
        the tail before it. On one GPU everything after attention is the kernel set's `layer_tail`
        (o + residual, then the MLP: one op, so a set may run it as one kernel), or
        `layer_tail_norm` with the next norm."""
        attn, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        if attn.tp.active:
            residual = attn(residual, self.input_layernorm, positions, cos_sin, kv_cache, meta, ops)
            return mlp(residual, norm, ops), None
        out = attn.attend(residual, self.input_layernorm, positions, cos_sin, kv_cache, meta, ops, normed)
        tail = (attn.o_proj.weight, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        if next_norm is None:
            return ops.layer_tail(out, *tail), None
        return ops.layer_tail_norm(out, *tail, next_norm.weight, next_norm.eps)


class CausalLM(nn.Module):
    """The decoder plus its LM head. Parameter names follow the fused layout the loader fills."""

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: KernelSet, tp: TPGroup = TPGroup()):
        super().__init__()
        self.cfg = cfg  # the whole model's config
        self.tp = tp
        self.local = local = local_config(cfg, tp)  # this rank's shapes
        self.ops = ops
        # vocabulary-parallel. `_weight` skips nn.Embedding's normal_() init: on the meta device
        # that imports torch._dynamo (seconds of start-up) for values the loader overwrites.
        self.embed_tokens = nn.Embedding(local.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(local.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(local, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, local.vocab_size, bias=False)
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.zeros(max_positions, cfg.head_dim), persistent=False)

    def init_rope(self) -> None:
        """Fill the rope table (after the module has reached its device)."""
        self.cos_sin.copy_(rope_cos_sin(self.cfg, self.max_positions))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.active:
            return self.embed_tokens(input_ids)  # [T, H]
        n = self.local.vocab_size  # this rank's rows: ids [rank * n, (rank + 1) * n)
        local = input_ids - self.tp.rank * n
        mine = (local >= 0) & (local < n)
        h = self.embed_tokens(local.clamp(0, n - 1)) * mine.unsqueeze(1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The residual stream after the last layer [T, H]; the final norm is the LM head's
        (compute_logits), so rows can be picked before it."""
        return self.forward_normed(input_ids, positions, meta)[0]

    def forward_normed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(The residual stream after the last layer [T, H], its final norm or None). Decode steps
        whose qkv is not one fused kernel (rope_in_attention, on one GPU) hoist every norm: the
        embedding lookup takes the first layer's, each layer's tail the next one's and the last
        tail the final norm, which compute_logits then takes as it is."""
        layers, first = self.layers, self.layers[0]
        if not self.tp.active and self.ops.rope_in_attention(first.self_attn.qkv_proj.weight, input_ids.shape[0],
                                                             meta.q_len, first.self_attn.heads()):
            n0 = first.input_layernorm
            h, normed = self.ops.embed_norm(input_ids, self.embed_tokens.weight, n0.weight, n0.eps)
            after = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        else:
            h, normed, after = self.embed(input_ids), None, [None] * len(layers)  # [T, H]
        for layer, kv_cache, nxt in zip(layers, meta.kv_caches, after):
            h, normed = layer(h, normed, nxt, positions, self.cos_sin, kv_cache, meta, self.ops)
        return h, normed

    def linear_row_counts(self, step_tokens: list[int], logit_rows: list[int]) -> dict[tuple[int, int], list[int]]:
        """Each linear weight shape [N, K] -> the row counts it multiplies in the given steps."""
        first = self.layers[0]
        counts: dict[tuple[int, int], list[int]] = {}
        for w in (first.self_attn.qkv_proj.weight, first.self_attn.o_proj.weight, first.mlp.gate_up_proj.weight,
                  first.mlp.down_proj.weight):
            counts.setdefault(tuple(w.shape), []).extend(step_tokens)
        counts.setdefault(tuple(self.lm_head_weight.shape), []).extend(logit_rows)
        return counts

    def compute_logits(self, hidden: torch.Tensor, normed: torch.Tensor | None = None,
                       tokens: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: the residual stream's rows [R, H] (forward's output) -> fp32 logits [R, V];
        `normed`: their final norm, where forward_normed made it (the LM head takes it as is);
        `tokens` (int64 [R]): the greedy tokens written there too (on one GPU by the LM head's
        own kernel where the set fuses it: KernelSet.norm_linear_argmax)."""
        n = self.norm
        x, weight = (hidden, n.weight) if normed is None else (normed, None)
        if tokens is not None and not self.tp.active:
            return self.ops.norm_linear_argmax(x, weight, n.eps, self.lm_head_weight, tokens)
        logits = self.ops.norm_linear(x, weight, n.eps, self.lm_head_weight,
                                      out_dtype=torch.float32)  # [R, ceil(V / world)]
        logits = self.tp.all_gather_last(logits)  # [R, padded V], gathered before sampling
        if logits.shape[-1] != self.cfg.vocab_size:  # vocabulary padding: cut off, never sampled
            logits = logits[:, :self.cfg.vocab_size].contiguous()
        if tokens is not None:
            self.ops.argmax(logits, out=tokens)
        return logits

    def greedy_tokens(self, hidden: torch.Tensor, normed: torch.Tensor | None, tokens: torch.Tensor) -> None:
        """compute_logits' greedy tokens written into `tokens` (int64 [R]) and no logits: on one GPU
        the set's head writes none (KernelSet.norm_linear_argmax, store=False: at 64 rows of the
        1B 33 MB of fp32 writes fewer); with tensor parallelism the gathered logits are dropped."""
        if self.tp.active:
            self.compute_logits(hidden, normed, tokens)
            return
        n = self.norm
        x, weight = (hidden, n.weight) if normed is None else (normed, None)
        self.ops.norm_linear_argmax(x, weight, n.eps, self.lm_head_weight, tokens, store=False)
