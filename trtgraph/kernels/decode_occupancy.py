"""The fused decode GEMVs' occupancy (kernels/decode_linear.py, decode_persistent.py): how deep a
config's weight pipeline may be on this device — staged weight and x tiles within the shared
memory one program may take, and where a grid has two waves or more, two programs per SM — and
the device facts it needs (SMs, shared memory per SM and per block). A config's depth never
changes what a row sums or in what order.
"""

from __future__ import annotations

import functools

import torch

ROW_TILES_MAX = 64  # the widest row tile (what the shared-memory fit assumes, whatever the step's rows)


def fit_stages(cfg, nacc: int, elem_bytes: int, device: torch.device, rows: int = ROW_TILES_MAX,
               programs: int = 0, two: bool = False) -> int:
    """The config's pipeline depth, cut until the staged weight and x tiles fit the device's
    shared memory (fp32 weights need twice bf16's; the table was tuned in bf16); and where the
    grid has at least two programs per SM (the LM head's 1002), cut (to no fewer than 2 stages)
    until two programs of `rows`-row tiles share an SM (`TWO_PER_SM`), so that one's epilogue
    and start overlap the other's weight stream (`two`: whatever the grid, for decode_linear's
    `_WIDE_PDL`). `cfg`: a decode_linear.DecodeConfig. The depth never changes what a row sums,
    or in what order: a function of the shape, dtype, device and row tile, never of the results."""
    if device.type != "cuda":
        return cfg.num_stages
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_stage = (nacc * cfg.block_n + ROW_TILES_MAX) * cfg.block_k * elem_bytes
    budget = int(0.85 * shared_memory_bytes(index))
    stages = cfg.num_stages
    while stages > 1 and stages * per_stage > budget:
        stages -= 1
    sms, per_sm = sm_resources(index) if (TWO_PER_SM and programs) or two else (1, 0)
    if two or (TWO_PER_SM and programs >= 2 * sms):
        per_stage = (nacc * cfg.block_n + rows) * cfg.block_k * elem_bytes
        while stages > 2 and stages * per_stage > per_sm // 2 - 3072:  # 1 KB per program reserved, 2 KB spare
            stages -= 1
    return stages


# Two programs per SM where the grid has two waves or more (see fit_stages; the ablation's
# `one-per-sm` variant turns it off). On the H200 it changes the LM head's depth at 32 and 64-row
# tiles only (3 -> 2 stages); 16-row tiles already fit two.
TWO_PER_SM = True


@functools.lru_cache(maxsize=None)
def sm_resources(index: int) -> tuple[int, int]:
    """(SMs, shared memory bytes per SM) of the device."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 0) or 228 * 1024


@functools.lru_cache(maxsize=None)
def shared_memory_bytes(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024
