"""Does a manifest fit this machine? Versions, device, model weights and memory, checked
before any heavy work. Each difference names the field and both values."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...artifacts import Manifest, compare_environment, compare_model, environment
from ...models.loader import model_fingerprint
from .executor import backend_for, resolve_device


@dataclass
class Difference:
    field: str
    manifest: object
    here: object

    def __str__(self) -> str:
        return f"{self.field}: manifest has {self.manifest!r}, this machine has {self.here!r}"


def check_manifest(manifest: Manifest, device: torch.device | None = None, weights: bool = True) -> list[Difference]:
    """Every way this machine, its libraries and the model's weights differ from the manifest."""
    config = manifest.app_config()
    device = device or resolve_device(config.device)
    diffs = [Difference(*d) for d in compare_environment(manifest, environment(device, backend_for(device)))]
    ckpt = config.model.path
    if weights and ckpt is not None and not os.path.isdir(ckpt):  # moved or deleted: a difference, not an error
        diffs.append(Difference("config.model.path (the checkpoint)", ckpt, "absent"))
    elif weights:
        fp = model_fingerprint(config.model, config.dtype, config.limits.max_seq_len, rehash=True)
        diffs += [Difference(*d) for d in compare_model(manifest, fp)]
    need, have = memory_need(manifest), memory_available(device)
    if have is not None and need > have:
        diffs.append(Difference("memory_bytes", need, have))
    return diffs


def memory_need(manifest: Manifest) -> int:
    """Weights + KV cache + graph pool, in bytes."""
    elt = {"float32": 4, "float16": 2, "bfloat16": 2}[manifest.model.get("dtype", "float32")]
    return (int(manifest.model.get("parameter_count", 0)) * elt + int(manifest.kv_cache.get("bytes", 0))
            + int(manifest.totals.get("pool_bytes", 0)))


def memory_available(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
