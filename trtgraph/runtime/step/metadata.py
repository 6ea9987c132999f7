"""Attention metadata: one object per graph key, built once.

It carries views at offset 0 of the persistent buffers (slot mapping, block tables) plus
the constants of the key. The graph runner checks identity (`is`) at every replay: the
graph recorded the pointers of these very views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)  # identity, not value, is what matters
class AttentionMetadata:
    q_len: int  # query tokens per sequence, a constant of the key
    batch_size: int
    slot_mapping: torch.Tensor  # [T] int64 flat KV slots, padding -> null block
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int64, unused entries -> null block
    kv_caches: list  # per layer [2, num_blocks, block_size, Hkv, D]; a reference, not a copy

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.q_len
