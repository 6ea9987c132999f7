"""Tensor-parallel layout: which slice of each weight a rank holds, and the collectives.

Column-parallel: qkv (a rank's query heads and the KV heads they read; KV heads are
replicated when there are fewer than ranks) and gate/up (a slice of the intermediate size).
Row-parallel with an all-reduce: o and down. Vocabulary-parallel: the embedding (masked
lookup, all-reduce) and the LM head (logits all-gathered before sampling). A vocabulary the
rank count does not divide is padded, as vLLM pads it: every rank holds ceil(V / world) rows,
the last ones zero; the gathered logits are cut back to V, so a padded id is never sampled.
Norms are replicated. Collectives are torch.distributed's (NCCL on GPUs, gloo on CPUs); inside a
CUDA graph they are recorded like any kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import WeightLoadError
from .config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        return self.world > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world * n], rank order."""
        if not self.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def check_divisible(cfg: ModelConfig, world: int, source: str) -> None:
    problems = []
    if cfg.num_heads % world:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads} (nor does the size divide it)")
    if cfg.intermediate_size % world:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if problems:
        raise WeightLoadError(f"{source}: parallel.tensor_parallel_size={world} does not divide "
                              f"{', '.join(problems)}; choose a size that divides them.")


def kv_heads_of(cfg: ModelConfig, tp: TPGroup) -> range:
    """The KV heads a rank holds: its share, or (fewer KV heads than ranks) the one its query heads read."""
    if cfg.num_kv_heads >= tp.world:
        n = cfg.num_kv_heads // tp.world
        return range(tp.rank * n, (tp.rank + 1) * n)
    group = cfg.num_heads // cfg.num_kv_heads
    first_q = tp.rank * (cfg.num_heads // tp.world)
    return range(first_q // group, first_q // group + 1)


def local_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The shapes one rank computes with (heads, KV heads, intermediate size, vocabulary)."""
    if not tp.active:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.world, num_kv_heads=len(kv_heads_of(cfg, tp)),
                               intermediate_size=cfg.intermediate_size // tp.world,
                               vocab_size=-(-cfg.vocab_size // tp.world))  # padded: ceil


def part_slice(cfg: ModelConfig, tp: TPGroup, ours: str, part: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the full HF tensor number `part` fused into parameter `ours`
    that this rank holds; None: the whole tensor (replicated)."""
    if not tp.active:
        return None
    d, r, w = cfg.head_dim, tp.rank, tp.world
    if ours.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        if part == 0:  # query heads
            n = cfg.q_size // w
            return (0, r * n, (r + 1) * n)
        heads = kv_heads_of(cfg, tp)
        return (0, heads.start * d, heads.stop * d)
    if ours.endswith("mlp.gate_up_proj.weight"):
        n = cfg.intermediate_size // w
        return (0, r * n, (r + 1) * n)
    if ours.endswith("self_attn.o_proj.weight"):
        n = cfg.q_size // w
        return (1, r * n, (r + 1) * n)
    if ours.endswith("mlp.down_proj.weight"):
        n = cfg.intermediate_size // w
        return (1, r * n, (r + 1) * n)
    if ours in ("embed_tokens.weight", "lm_head.weight"):
        n = -(-cfg.vocab_size // w)  # the last rank's tail past the vocabulary is padding
        return (0, min(r * n, cfg.vocab_size), min((r + 1) * n, cfg.vocab_size))
    return None


def copy_padded(param: torch.Tensor, part: torch.Tensor) -> None:
    """Fill a rank's parameter with its part; rows past the part (vocabulary padding) are zero."""
    if part.shape == param.shape:
        param.copy_(part)
        return
    param.zero_()
    param[:part.shape[0]].copy_(part)


def take(t, sl: tuple[int, int, int] | None):
    """Slice a tensor (or a safetensors slice object) as part_slice says."""
    if sl is None:
        return t[:]
    dim, a, b = sl
    return t[a:b] if dim == 0 else t[:, a:b]
