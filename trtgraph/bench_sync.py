"""The bench's device helpers: wait for the device; free what a measurement left (Python's
garbage, then the CUDA caching allocator's unused blocks)."""

from __future__ import annotations

import gc

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
