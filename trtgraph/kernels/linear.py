"""Batch-invariant linear layers: y = x @ W.T (+ bias), each row reduced in an order that does
not depend on how many rows share the step.

Two backends per weight shape (N, K):
- `triton`: one tiled Triton kernel whose launch configuration (BLOCK_M, BLOCK_N, BLOCK_K,
  warps, stages) is a function of (N, K) and the device only, never of the row count M. So
  every M runs the same compiled kernel, each output element is reduced over K in the same
  BLOCK_K order by the same instructions, and no split-K. Invariant by construction.
- `cublas`: torch's GEMM. cuBLAS picks its kernel (and split-K) per M, so a row's result may
  depend on M. It is used for a shape only where `choose_backends` has checked, on this
  device and library, that one row's output is bitwise equal for every row count the bucket
  plan can run (or where the config says `deterministic: false`).

The choice is a deterministic function of the plan, the device and the library (a bitwise
probe, no timing), so the compiler and the runtime arrive at the same table; the compiler
records it in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TRITON, CUBLAS = "triton", "cublas"


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (N, K) -> (BLOCK_N, BLOCK_K, warps, stages) overrides of the default below, one per shape and
# the same for every M; scripts/tune_linear.py fills it while measuring. Empty: the default
# (16, 128, 4, 5) was the best config of the o shape (2048 x 2048) on the H200 in an earlier
# BLOCK_M 64 form of the kernel (docs/performance.md); the BLOCK_M 16 form is not tuned yet.
_TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {}
_BACKENDS: dict[tuple[int, int], str] = {}  # (N, K) -> backend; shapes not listed use Triton


def linear_config(n: int, k: int, device: torch.device) -> LinearConfig:
    """The launch configuration for a weight [n, k]: a pure function of the shape and the
    device, so every batch size reduces each row in the same order."""
    if device.type != "cuda":
        return LinearConfig(16, 16, 32 if k >= 32 else 16, 1, 1)  # small: fast under the interpreter
    bn, bk, warps, stages = _TUNED.get((n, k), (16, 128, 4, 5))
    return LinearConfig(16, bn, bk, warps, stages)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)  # row blocks vary fastest: they share the weight tile in L2
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * w_stride + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dst = y_ptr + rows[:, None] * y_stride + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RES:  # y holds the residual: y + x @ W.T, added in fp32 and rounded once
        acc += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=mask)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) with the batch-invariant Triton kernel; with
    `residual` [M, N] (contiguous rows), residual + that, written into residual's storage."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    M, (N, K) = x2.shape[0], weight.shape
    cfg = linear_config(N, K, x.device)
    y = residual if residual is not None else torch.empty((M, N), dtype=weight.dtype, device=x.device)
    if M > 0:
        _linear_kernel[(triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))](
            x2, weight, bias if bias is not None else weight, y, M, N, K, x2.stride(0), weight.stride(0),
            y.stride(0), HAS_BIAS=bias is not None, HAS_RES=residual is not None, PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the backend chosen for this weight's shape."""
    if _BACKENDS.get(tuple(weight.shape)) == CUBLAS:
        return torch.nn.functional.linear(x, weight, bias)
    return triton_linear(x, weight, bias)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T in one kernel, written into residual's storage (the o and down
    projections past the fused GEMVs' rows): cuBLAS's beta = 1 epilogue (`addmm_`, in place)
    or the Triton kernel's residual epilogue, by the shape's backend. The sum is taken in fp32
    and rounded once (the composition of the references rounds the product first)."""
    if residual.stride(-1) != 1 or residual.dim() != 2:
        return residual + linear(x, weight)
    if _BACKENDS.get(tuple(weight.shape)) == CUBLAS:
        return residual.addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return triton_linear(x, weight, residual=residual)


def cublas_is_invariant(n: int, k: int, row_counts: list[int], dtype: torch.dtype, device: torch.device,
                        residual: bool = False) -> bool:
    """Is torch's GEMM row-for-row bitwise equal for every row count in `row_counts`, on a
    weight [n, k]? (With `residual`, also the in-place `addmm_` that linear_residual runs.)
    Random inputs with a fixed seed; the first rows of the largest product are compared with
    each smaller product."""
    g = torch.Generator(device="cpu").manual_seed(n * 31 + k)
    most = max(row_counts)
    x = torch.randn((most, k), generator=g).to(device, dtype)
    w = (torch.randn((n, k), generator=g) / k ** 0.5).to(device, dtype)
    r = torch.randn((most, n), generator=g).to(device, dtype)
    counts = sorted(set(row_counts))
    full = torch.nn.functional.linear(x, w)
    same = all(torch.equal(torch.nn.functional.linear(x[:m], w), full[:m]) for m in counts)
    if same and residual:
        full = r.clone().addmm_(x, w.t())
        same = all(torch.equal(r[:m].clone().addmm_(x[:m], w.t()), full[:m]) for m in counts)
    del x, w, r, full
    torch.cuda.empty_cache()  # give the probe's memory back before the KV cache is sized
    return same


def choose_backends(row_counts: dict[tuple[int, int], list[int]], dtype: torch.dtype, device: torch.device,
                    deterministic: bool, residual_shapes: frozenset[tuple[int, int]] = frozenset()) -> dict[str, str]:
    """Pick and install each weight shape's backend: cuBLAS where it is batch-invariant over
    the row counts that shape meets in the plan (cuBLAS was as fast or faster than the Triton
    kernels on every Llama-3.2-1B shape at M <= 64, docs/performance.md) or everywhere when
    `deterministic` is off; Triton elsewhere. `residual_shapes`: the shapes linear_residual
    also runs (o, down), probed for its `addmm_` too. Returns {"NxK": backend} for the manifest."""
    _BACKENDS.clear()
    for (n, k), counts in sorted(row_counts.items()):
        ok = device.type == "cuda" and (not deterministic or cublas_is_invariant(
            n, k, counts, dtype, device, residual=(n, k) in residual_shapes))
        _BACKENDS[(n, k)] = CUBLAS if ok else TRITON
    return installed_backends()


def installed_backends() -> dict[str, str]:
    """{"NxK": backend} of the shapes choose_backends last decided (empty: Triton everywhere)."""
    return {f"{n}x{k}": b for (n, k), b in sorted(_BACKENDS.items())}
