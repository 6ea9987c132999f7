"""The eager oracle: one sequence at a time, chunked prefill then decode on the paged
cache, no buffers, no padding, no graphs. Replay and the scheduler are held against it.
"""

from __future__ import annotations

import torch

from trtgraph.models import DTYPES, LoadedModel
from trtgraph.runtime.step.kv_cache import allocate_kv_caches, blocks_for_tokens
from trtgraph.runtime.step.metadata import AttentionMetadata
from trtgraph.kernels import sampler_reference as sampler


class EagerSequence:
    """A single sequence on its own paged KV cache (blocks 1..n; block 0 stays null)."""

    def __init__(self, loaded: LoadedModel, max_len: int, block_size: int = 16, dtype: str | None = None):
        model = loaded.model
        self.model, self.block_size = model, block_size
        self.device = model.cos_sin.device
        dtype = DTYPES[dtype] if dtype else model.embed_tokens.weight.dtype
        nblocks = blocks_for_tokens(max_len, block_size)
        self.kv = allocate_kv_caches(loaded.model.local, nblocks + 1, block_size, dtype, self.device)
        # Blocks in a scrambled order, so block-table indexing is exercised for real.
        perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(nblocks)) + 1
        self.table = perm.to(torch.int64).view(1, -1).to(self.device)
        self.length = 0
        self.max_len = max_len

    @torch.inference_mode()
    def forward(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run `token_ids` as one chunk after the cached prefix; logits [n, V] (or [V] of the last)."""
        n = len(token_ids)
        if self.length + n > self.max_len:
            raise ValueError(f"sequence would exceed max_len={self.max_len}")
        pos = torch.arange(self.length, self.length + n, device=self.device)
        slots = self.table[0, pos // self.block_size] * self.block_size + pos % self.block_size
        meta = AttentionMetadata(q_len=n, batch_size=1, slot_mapping=slots, block_tables=self.table,
                                 kv_caches=self.kv)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, meta)
        self.length += n
        return self.model.compute_logits(hidden if all_logits else hidden[-1:])

    def prefill(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """All prompt logits [n, V], computed in chunks of `chunk_size` (whole prompt if None)."""
        chunk_size = chunk_size or len(token_ids)
        parts = [self.forward(token_ids[i:i + chunk_size], all_logits=True)
                 for i in range(0, len(token_ids), chunk_size)]
        return torch.cat(parts)


def generate(loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int, chunk_size: int | None = None,
             block_size: int = 16, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Tokens generated after `prompt_ids`, with the in-graph sampler's exact semantics."""
    if max_new_tokens <= 0:
        return []
    seq = EagerSequence(loaded, len(prompt_ids) + max_new_tokens, block_size)
    logits = seq.prefill(prompt_ids, chunk_size)[-1:]
    out: list[int] = []
    while True:
        token = _draw(logits, seq.length, temperature, top_k, top_p, seed)
        out.append(token)
        if token in stop_token_ids or len(out) == max_new_tokens:
            return out
        logits = seq.forward([token])


def _draw(logits: torch.Tensor, position: int, temperature, top_k, top_p, seed) -> int:
    if temperature <= 0:
        return int(sampler.greedy(logits)[0])
    dev = logits.device

    def one(x, dtype):
        return torch.tensor([x], dtype=dtype, device=dev)

    tok = sampler.sample(logits, one(temperature, torch.float32), one(top_k, torch.int64),
                         one(top_p, torch.float32), one(seed, torch.int64), one(position, torch.int64))
    return int(tok[0])
