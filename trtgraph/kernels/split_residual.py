"""The down projection of a decode step of 17-64 rows, its residual add and the next layer's
RMSNorm in two kernels (`linear_residual_norm`).

At 17-64 rows (the steps past the fused GEMVs' band, decode_linear.FUSED_MAX_ROWS) cuBLAS runs the
down projection (K = 4 N on Llama shapes) as a split-K GEMM plus its own reduce kernel, and the next
layer's RMSNorm, before its cuBLAS qkv, is a third kernel.
Here one strided-batched cuBLAS GEMM writes each K slice's fp32 partial product [S, T, N]
(`torch.bmm(..., out_dtype=float32)`: the slices are views of x and of the weight, nothing is
copied), and one Triton kernel (`_sum_add_norm_kernel`, a program per row) sums the partials in
slice order, adds the residual and rounds once (as `addmm_`'s epilogue does), stores the new
residual and the next layer's RMSNorm of it (triton_ops.rms_norm's arithmetic and warps, bit for
bit). On the H200 at Llama-3.2-1B's down shape: 15.2-15.6 us per layer against 16.7 for addmm_ + the
norm (`scripts/splitk_probe.py`; docs/performance.md, ninth session), 16 kernels fewer per step; the
sum kernel 3.2 -> 2.0 us a layer on 16 warps instead of 4 (fourteenth session).

Rounding and invariance: a row's partials are cuBLAS's products over its K slices; `choose_split`
installs a shape only where they are bitwise the same at every row count of its band the plan runs
(a probe, as linear.cublas_is_invariant: 17-64, else 33-64 where cuBLAS rounds the partials of
17-32 rows otherwise), and the sum's order is fixed, so a row's result does not depend on the rows
beside it. Steps of other row counts keep the composition (addmm_ + the norm),
which rounds otherwise: with `deterministic` (one rounding per shape for every step) the split is
not installed, as the fused GEMVs past their rows are not (decode_linear.choose_fused).
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from . import decode_tuned
from .composed import FusedOps, residual_norm_op, tail_norm_op
from .decode_linear import FUSED_MAX_ROWS
from .triton_ops import row_warps

SPLIT_MIN_ROWS, SPLIT_MAX_ROWS = FUSED_MAX_ROWS + 1, 64  # the steps past the fused GEMVs' band
# tried in turn: the widest band whose partials are invariant (33: the band before the fourteenth session)
_BAND_STARTS = (SPLIT_MIN_ROWS, 33)
NUM_WARPS: int | None = None  # the sum kernel's warps (None: triton_ops.row_warps; scripts/decode_ablation.py sets it)
_SPLITS: dict[tuple[int, int], tuple[int, int]] = {}  # (N, K) -> (K slices, the band's first row count)


@triton.jit
def _sum_add_norm_kernel(p_ptr, r_ptr, w_ptr, out_ptr, M, N, eps, S: tl.constexpr, BLOCK: tl.constexpr,
                         NORM: tl.constexpr = True):
    """One row: residual += the S partials' sum (slice order), and (NORM) its RMSNorm into out."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    part = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(S):  # slice order: fixed
        part += tl.load(p_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    h = (tl.load(r_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32) + part).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * N + cols, h, mask=mask)
    if NORM:  # (off: scripts/splitk_probe.py's o projection, which no norm follows)
        xf = h.to(tl.float32)  # triton_ops._rms_norm_kernel's arithmetic
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * inv).to(r_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T per K slice: fp32 [splits, T, N] (one strided-batched GEMM)."""
    (T, K), N = x.shape, weight.shape[0]
    kc = K // splits
    a = x.view(T, splits, kc).transpose(0, 1)  # [S, T, kc]
    b = weight.view(N, splits, kc).permute(1, 2, 0)  # [S, kc, N]
    if x.dtype == torch.float32:
        return torch.bmm(a, b)
    if x.device.type != "cuda":  # bmm's out_dtype is CUDA's (the tests off the GPU)
        return torch.bmm(a.float(), b.float())
    return torch.bmm(a, b, out_dtype=torch.float32)


def split_linear_residual_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float,
                               splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x @ weight.T written into residual's storage, its RMSNorm) in two kernels:
    x [T, K] and residual [T, N] contiguous rows, K a multiple of `splits` (the installed one)."""
    splits = splits or _SPLITS[tuple(weight.shape)][0]
    T, N = residual.shape
    parts = partials(x, weight, splits)
    out = torch.empty_like(residual)
    if T > 0:
        block = triton.next_power_of_2(N)
        _sum_add_norm_kernel[(T,)](parts, residual, norm_weight, out, T, N, eps, S=splits, BLOCK=block,
                                   num_warps=NUM_WARPS or row_warps(block))
    return residual, out


def runs_split(weight: torch.Tensor, rows: int) -> bool:
    """Whether linear_residual_norm runs the two kernels for this weight at `rows` rows."""
    installed = _SPLITS.get(tuple(weight.shape))
    return installed is not None and installed[1] <= rows <= SPLIT_MAX_ROWS


def with_split(ops: FusedOps, rms_norm: Callable) -> FusedOps:
    """ops with `linear_residual_norm` dispatching (the two kernels where runs_split, else ops' own
    linear_residual then rms_norm) and `layer_tail_norm` over it."""
    composed = residual_norm_op(ops.linear_residual, rms_norm)

    def linear_residual_norm(x, weight, residual, norm_weight, eps):
        if runs_split(weight, x.shape[0]) and x.is_contiguous() and residual.is_contiguous():
            return split_linear_residual_norm(x, weight, residual, norm_weight, eps)
        return composed(x, weight, residual, norm_weight, eps)

    ops = ops._replace(linear_residual_norm=linear_residual_norm)
    return ops._replace(layer_tail_norm=tail_norm_op(ops))


def split_is_invariant(n: int, k: int, splits: int, row_counts: list[int], dtype: torch.dtype,
                       device: torch.device) -> bool:
    """Are the partial products row-for-row bitwise equal at every row count in `row_counts`?
    The probe's values are drawn on the device: drawn on the host (17M normals for a 2048 x 8192
    weight: 0.47 s on the 2-core CPU machine), they were the likely bulk of the 0.19-0.26 s that
    every capture's and start's `kv_cache_and_buffers` phase took on the H200 in h/u10's call
    (0.011 s before this probe existed, h/u9)."""
    g = torch.Generator(device=device).manual_seed(n * 37 + k)
    most = max(row_counts)
    x = torch.randn((most, k), generator=g, device=device).to(dtype)
    w = (torch.randn((n, k), generator=g, device=device) / k ** 0.5).to(dtype)
    full = partials(x, w, splits)
    same = all(torch.equal(partials(x[:m].contiguous(), w, splits), full[:, :m]) for m in sorted(set(row_counts)))
    del x, w, full
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return same


def choose_split(down_shape: tuple[int, int], row_counts: list[int], cublas: Callable[[int], bool],
                 device: torch.device, deterministic: bool, tensor_parallel: bool, dtype: torch.dtype) -> dict[str, str]:
    """Install the split down projection for the down weight [N, K] where decode_tuned.SPLIT_DOWN
    measured it faster: on CUDA, one GPU, 16-bit weights, not with `deterministic`, the shape's GEMM
    on cuBLAS at every row count of the band (`cublas(m)`: linear.runs_cublas, as
    linear.choose_backends installed it), and the partials bitwise invariant over the plan's row
    counts in its band (17-64, else 33-64: `_BAND_STARTS`). Returns `installed_split()`."""
    _SPLITS.clear()
    splits = decode_tuned.SPLIT_DOWN.get(tuple(down_shape))
    if not (splits and device.type == "cuda" and not tensor_parallel and not deterministic
            and dtype.itemsize == 2 and down_shape[1] % splits == 0):
        return installed_split()
    tried: list[int] = []
    for lo in _BAND_STARTS:
        counts = [m for m in row_counts if lo <= m <= SPLIT_MAX_ROWS]
        if not all(map(cublas, counts)):
            continue  # the band's GEMM is not cuBLAS's everywhere: its partials' rounding is not the split's
        if counts and counts != tried:  # a narrower band with the same row counts proves nothing new
            tried = counts
            if split_is_invariant(*down_shape, splits, counts, dtype, device):
                _SPLITS[tuple(down_shape)] = (splits, lo)
                break
    return installed_split()


def installed_split() -> dict[str, str]:
    """The manifest's record: {"linear_residual_norm:NxK": "split4:17-64"} per installed shape (its band)."""
    return {f"linear_residual_norm:{n}x{k}": f"split{s}:{lo}-{SPLIT_MAX_ROWS}"
            for (n, k), (s, lo) in sorted(_SPLITS.items())}
