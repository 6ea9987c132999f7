"""The paged KV cache and its host-side block allocator.

Per layer one tensor [2, num_blocks, block_size, n_kv_heads, head_dim] (k then v). Block 0
is the null block: padding rows write there, no sequence owns it, and unused block-table
entries point at it. The cache is zero-filled once so nothing read through a mask is NaN.
"""

from __future__ import annotations

import math

import torch

from ..models.config import ModelConfig

NULL_BLOCK = 0


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elt = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elt


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def auto_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                    max_batch_size: int, max_seq_len: int, reserve_bytes: int = 4 << 30) -> int:
    """Enough blocks for every sequence at full length (+ the null block), capped by free
    device memory less a reserve for activations and the graph pool."""
    full = max_batch_size * blocks_for_tokens(max_seq_len, block_size) + 1
    if device.type != "cuda":
        return full
    free, _total = torch.cuda.mem_get_info(device)
    fits = int((free * 0.9 - reserve_bytes) // kv_bytes_per_block(cfg, block_size, dtype))
    minimum = blocks_for_tokens(max_seq_len, block_size) + 1
    return max(min(full, fits), minimum)


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks-1. Lowest ids first, so runs are reproducible."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() gives the lowest id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not NULL_BLOCK < b < self.num_blocks:
                raise ValueError(f"block {b} is not an allocatable block")
        self._free.extend(reversed(blocks))
        if len(self._free) > self.num_blocks - 1:
            raise ValueError("a block was freed twice")
