"""L2 prefetch of weights that later ops of the step will read, issued while the device's memory
bandwidth is idle: a small kernel whose programs each put a few chunks of the given tensors on
their way to L2 (`cp.async.bulk.prefetch.L2`, one instruction per chunk, no registers or shared
memory held), launched on a side stream so that it runs beside the op on the critical path
(attention, a latency-bound GEMM) rather than in front of it. A prefetch changes no value: the
ops that read the tensors later read the same bytes, from L2 instead of HBM where the lines are
still there.

CUDA only (the interpreter has no inline assembly): elsewhere `prefetch_l2` does nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16 << 10  # bytes per prefetch instruction (a multiple of 16)
PER_PROGRAM = 32  # chunks per program: one per lane of its one warp


@triton.jit
def _prefetch_kernel(a_ptr, a_bytes, a_chunks, b_ptr, b_bytes, b_chunks, CHUNK: tl.constexpr, PER: tl.constexpr):
    """Program p prefetches chunks p * PER .. p * PER + PER - 1 of A's chunks followed by B's;
    the last chunk of each region starts CHUNK bytes before its end (overlapping the one before),
    so no address leaves the tensor."""
    i = tl.program_id(0) * PER + tl.arange(0, PER)
    off_a = tl.minimum(i.to(tl.int64) * CHUNK, a_bytes - CHUNK)
    off_b = tl.minimum(tl.maximum(i - a_chunks, 0).to(tl.int64) * CHUNK, b_bytes - CHUNK)
    ptrs = tl.where(i < a_chunks, a_ptr + off_a, b_ptr + off_b)
    size = tl.full(ptrs.shape, CHUNK, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                              [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def _bytes(t: torch.Tensor | None, limit: int | None = None) -> tuple[torch.Tensor | None, int]:
    """(t's storage as bytes, how many of them to prefetch): none where t is absent, not
    contiguous, misaligned or smaller than one chunk."""
    if t is None or not t.is_contiguous() or t.data_ptr() % 16:
        return None, 0
    n = t.numel() * t.element_size()
    n = min(n, limit) if limit is not None else n
    n -= n % 16
    return (t.view(-1).view(torch.uint8), n) if n >= CHUNK else (None, 0)


def prefetch_l2(a: torch.Tensor, b: torch.Tensor | None = None, b_limit: int | None = None) -> None:
    """Put all of `a` and the first `b_limit` bytes of `b` (all of it by default) on their way to
    L2, on the current stream (the caller forks a side stream for it). CUDA only; nothing elsewhere."""
    if a.device.type != "cuda":
        return
    a_bytes, na = _bytes(a)
    b_bytes, nb = _bytes(b, b_limit)
    if a_bytes is None:
        a_bytes, na, b_bytes, nb = b_bytes, nb, None, 0
    if a_bytes is None:
        return
    ca, cb = triton.cdiv(na, CHUNK), triton.cdiv(nb, CHUNK)
    b_arg = b_bytes if b_bytes is not None else a_bytes
    _prefetch_kernel[(triton.cdiv(ca + cb, PER_PROGRAM),)](a_bytes, na, ca, b_arg, nb if nb else na, cb,
                                                           CHUNK=CHUNK, PER=PER_PROGRAM, num_warps=1)
