"""Which keys a start must warm up, and the check that no graph is recorded around a first load.

A graph bakes in what its step touched when it was recorded, so every Triton kernel a key
launches must be loaded, and every buffer a kernel makes lazily (split-K workspaces, arrival
counters) must have its final size, before the first capture. At capture every key runs
eagerly once, in the warm order; the keys whose run loaded a Triton kernel that no earlier
key had loaded, or kept device memory allocated, are recorded in `totals.warmup_keys` (the
first key always). A start warms those keys alone, in that order: by then every kernel any
key launches is loaded and every lazy buffer is made, so the others' eager runs would
change nothing. `FirstLoads` then watches the re-record: a kernel loaded while a graph is
recorded refuses the start (recapture).
"""

from __future__ import annotations

import sys

import torch


def loaded_kernels() -> int | None:
    """How many Triton kernel specialisations this process has compiled or loaded, over every
    `@triton.jit` function of trtgraph.kernels. None where Triton keeps them elsewhere than
    this code looks (another Triton version): then every key is warmed."""
    if "triton" not in sys.modules:
        return 0  # no Triton kernel can have been launched
    count = 0
    for fn in _jit_functions():
        caches = getattr(fn, "device_caches", None)
        if not isinstance(caches, dict):
            return None
        for entry in caches.values():
            if not isinstance(entry, tuple) or not entry or not isinstance(entry[0], dict):
                return None
            count += len(entry[0])
    return count


_JIT = (-1, [])  # (len(sys.modules) when scanned, the JIT functions found)


def _jit_functions() -> list:
    """The `@triton.jit` functions of the loaded trtgraph.kernels modules; scanned again only
    when a module was imported or removed since (the re-record asks before and after every
    graph: a walk over sys.modules each time was most of its cost)."""
    global _JIT
    if _JIT[0] == len(sys.modules):
        return _JIT[1]
    from triton.runtime.jit import JITFunction

    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("trtgraph.kernels") and module is not None:
            found += [fn for fn in vars(module).values() if isinstance(fn, JITFunction)]
    _JIT = (len(sys.modules), found)
    return _JIT[1]


def allocated_bytes(device: torch.device) -> int:
    """Device memory held by live tensors (after the device's queued work), 0 off CUDA."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


class FirstLoads:
    """Counts Triton kernels loaded between `before()` and `after(what)`; raises through
    `refuse(what)` when one was: `what` was recorded around a first load."""

    def __init__(self, refuse):
        self._refuse = refuse
        self._count = None

    def before(self) -> None:
        self._count = loaded_kernels()

    def after(self, what: str) -> None:
        now = loaded_kernels()
        if self._count is not None and now is not None and now > self._count:
            self._refuse(what, now - self._count)
        self._count = now
