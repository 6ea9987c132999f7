"""The paged KV cache and its host-side block allocator.

Per layer one tensor [2, num_blocks, block_size, n_kv_heads, head_dim] (k then v). Block 0
is the null block: padding rows write there, no sequence owns it, and unused block-table
entries point at it. The cache is zero-filled once so nothing read through a mask is NaN.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from ...models.config import ModelConfig

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
    """One tensor per layer, all views of one allocation [layers, 2, ...] (so a copy of some
    blocks of every layer is one op: compiler/verify.py's KeptBlocks)."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return list(torch.zeros(shape, dtype=dtype, device=device).unbind(0))


class BlockAllocator:
    """Reference-counted KV blocks 1..num_blocks-1. Lowest ids first, so runs are reproducible.

    A block is held by every sequence whose block table lists it (n completions of one prompt
    share its full blocks); it returns to the free list when the last holder frees it."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.peak_used = 0  # the most blocks held at once
        self.reset()

    def reset(self) -> None:
        """Every block free, none held (Scheduler.requeue_all, once no sequence holds one); the
        peak kept."""
        self._free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))  # pop() gives the lowest id
        self._refs = [0] * self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        self.peak_used = max(self.peak_used, self.num_blocks - 1 - len(self._free))
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """One more holder of each (already held) block; returns them for the new block table."""
        for b in blocks:
            self._check(b)
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self._refs[b] += 1
        return list(blocks)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def free(self, blocks: list[int]) -> None:
        """Drop one hold on each block; a block nobody holds any more is free again."""
        refs = self._refs
        if blocks and (min(blocks) <= NULL_BLOCK or max(blocks) >= self.num_blocks or len(set(blocks)) < len(blocks)
                       or 0 in map(refs.__getitem__, blocks)):  # (the checks below, for the common case in C)
            for b, times in Counter(blocks).items():
                self._check(b)
                if refs[b] < times:
                    raise ValueError(f"block {b} was freed twice")
        released = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                released.append(b)
        self._free.extend(reversed(released))

    def _check(self, block: int) -> None:
        if not NULL_BLOCK < block < self.num_blocks:
            raise ValueError(f"block {block} is not an allocatable block")
