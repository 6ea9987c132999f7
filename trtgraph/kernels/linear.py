"""Batch-invariant linear layers: y = x @ W.T (+ bias), each row reduced in an order that does
not depend on how many rows share the step.

Two backends per weight shape (N, K):
- `triton`: one tiled Triton kernel whose launch configuration (BLOCK_M, BLOCK_N, BLOCK_K,
  warps, stages) is a function of (N, K) and the device only, never of the row count M. So
  every M runs the same compiled kernel, each output element is reduced over K in the same
  BLOCK_K order by the same instructions, and no split-K. Invariant by construction.
- `cublas`: torch's GEMM. cuBLAS picks its kernel (and split-K) per M, so a row's result may
  depend on M. It is allowed for a shape only where `choose_backends` has checked, on this
  device and library, that one row's output is bitwise equal for every row count the bucket
  plan can run (or where the config says `deterministic: false`).

Without `deterministic`, where cuBLAS is allowed, capture times it at each of the plan's row counts
(GPU time of replayed graphs: the host's launch cost, which the replayed step does not pay, would
hide the kernels' difference); where it takes over SLOW_FACTOR times its own time at a larger row
count (its heuristic misfired: cuBLAS's fp32 heuristic picks 32x128 tiles at 8-16 rows that take
5x its own at 24 and the Triton kernel's, docs/performance.md, sixteenth session), the Triton
kernel is timed there too and runs at the row counts where it takes at most TRITON_MARGIN of
cuBLAS's time. Timing is not reproducible, so the manifest records the table
(`totals.linear_backends`, the times in `totals.linear_times_us`) and the runtime installs that
record (`recorded=`) instead of choosing again. With `deterministic` nothing is timed: the choice
stays a pure function of the plan, the device and the library, so a recapture rounds every row
as the capture before did (the runtime still probes a recorded cuBLAS shape for invariance on its
own device and library).
"""

from __future__ import annotations

from collections.abc import Callable
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
# (N, K) -> row counts at which a cuBLAS shape runs the Triton kernel instead (`deterministic: false`
# only: a row's rounding then depends on its step's row count, as cuBLAS's own per-M kernels make it)
_TRITON_ROWS: dict[tuple[int, int], frozenset[int]] = {}
_ROW_TIMES: dict[tuple[int, int], dict[str, dict[int, float]]] = {}  # backend -> row count -> us, where timed
# Triton replaces an allowed cuBLAS only where it takes at most this fraction of cuBLAS's time: a
# margin over the timing's noise, and cuBLAS's choice enables the split down projection at 17-64
# rows (split_residual.choose_split) that a per-op time does not see.
TRITON_MARGIN = 0.8
# cuBLAS at m rows taking more than this times its own time at a larger row count of the plan: its
# heuristic picked a poor kernel at m (a GEMM of fewer rows does no more work), so the Triton kernel
# is timed there. Elsewhere it is not timed at all: its compiles and its slow large-M calls would cost
# a capture seconds for nothing.
SLOW_FACTOR = 1.25
TIMING_REPEATS = 10  # calls per timed graph at most (the timer takes the best of its replays) ...
TIMING_BUDGET_US = 500  # ... fewer where one call takes longer than this share: a large prefill GEMM once


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


def runs_cublas(shape: tuple[int, int], rows: int) -> bool:
    """Does the GEMM of a weight of this shape run cuBLAS at this row count (the installed choice)?"""
    return _BACKENDS.get(shape) == CUBLAS and rows not in _TRITON_ROWS.get(shape, ())


def _cublas(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return runs_cublas(tuple(weight.shape), x.numel() // x.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the backend chosen for this weight's shape (and row count)."""
    if _cublas(weight, x):
        return torch.nn.functional.linear(x, weight, bias)
    return triton_linear(x, weight, bias)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T in one kernel, written into residual's storage (the o and down
    projections past the fused GEMVs' rows): cuBLAS's beta = 1 epilogue (`addmm_`, in place)
    or the Triton kernel's residual epilogue, by the shape's backend. The sum is taken in fp32
    and rounded once (the composition of the references rounds the product first)."""
    if residual.stride(-1) != 1 or residual.dim() != 2:
        return residual + linear(x, weight)
    if _cublas(weight, x):
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


def time_backend(backend: str, n: int, k: int, row_counts: list[int], dtype: torch.dtype, device: torch.device,
                 residual: bool, timer: Callable[[Callable[[], None]], float]) -> dict[int, float]:
    """Microseconds one call of the backend takes at each of `row_counts` rows (in linear_residual's form
    with `residual`): `timer(work)` is the GPU time of `work()` replayed as a graph (the runtime's
    cuda_graph.graph_time_us), `work` up to TIMING_REPEATS calls (TIMING_BUDGET_US over one eager call's
    time, after a first that compiles and lets cuBLAS pick), so the host's launch cost is not counted."""
    g = torch.Generator(device=device).manual_seed(n * 31 + k)  # drawn there: an LM head's on the CPU takes seconds
    most = max(row_counts)
    x = torch.randn((most, k), generator=g, device=device).to(dtype)
    w = (torch.randn((n, k), generator=g, device=device) / k ** 0.5).to(dtype)
    # the calls cycle through copies of the weight toward twice the L2 (one a call at most, so a weight under
    # a tenth of that stays in L2 as in a small model's step): a step reads a large weight from HBM
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    ws = [w] + [w.clone() for _ in range(min(TIMING_REPEATS, -(-2 * l2 // (w.numel() * w.element_size()))) - 1)]
    r = torch.zeros((most, n), device=device, dtype=dtype) if residual else None
    times = {}
    for m in row_counts:
        xm, rm = x[:m], (r[:m] if r is not None else None)
        if backend == CUBLAS:
            call = (lambda wi: rm.addmm_(xm, wi.t())) if rm is not None else (
                lambda wi: torch.nn.functional.linear(xm, wi))
        else:
            call = lambda wi: triton_linear(xm, wi, residual=rm)  # noqa: E731

        call(w)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(w)
        end.record()
        end.synchronize()
        reps = max(1, min(TIMING_REPEATS, int(TIMING_BUDGET_US // max(start.elapsed_time(end) * 1e3, 1.0))))

        def work():
            for i in range(reps):
                call(ws[i % len(ws)])

        times[m] = timer(work) / reps
    del x, w, ws, r
    torch.cuda.empty_cache()
    return times


def pick(times: dict[str, float]) -> str:
    """cuBLAS unless the Triton kernel takes at most TRITON_MARGIN of its time."""
    return TRITON if 0 < times[CUBLAS] and times[TRITON] <= TRITON_MARGIN * times[CUBLAS] else CUBLAS


def triton_rows(rows: dict[str, dict[int, float]]) -> frozenset[int]:
    """The row counts at which Triton (where timed) takes at most TRITON_MARGIN of cuBLAS's time."""
    return frozenset(m for m, us in rows[TRITON].items() if pick({CUBLAS: rows[CUBLAS][m], TRITON: us}) == TRITON)


def suspect_rows(cublas: dict[int, float]) -> list[int]:
    """The row counts where cuBLAS takes more than SLOW_FACTOR times its own time at a larger row count."""
    out, best = [], float("inf")
    for m in sorted(cublas, reverse=True):
        if cublas[m] > SLOW_FACTOR * best:
            out.append(m)
        best = min(best, cublas[m])
    return sorted(out)


def _parse(record: str | None) -> tuple[str | None, frozenset[int]]:
    """A manifest record "cublas", "triton" or "cublas+triton:M1,M2,..." -> (backend, Triton's row counts)."""
    if record is None or not record.startswith(CUBLAS + "+" + TRITON + ":"):
        return record, frozenset()
    return CUBLAS, frozenset(int(m) for m in record.split(":", 1)[1].split(","))


def cublas_allowed(n: int, k: int, row_counts: list[int], dtype: torch.dtype, device: torch.device,
                   deterministic: bool, residual: bool) -> bool:
    """May cuBLAS run this shape: on CUDA, and with `deterministic` only where it is batch-invariant."""
    return device.type == "cuda" and (not deterministic or cublas_is_invariant(
        n, k, row_counts, dtype, device, residual=residual))


def _timed(n: int, k: int, rows: list[int], dtype: torch.dtype, device: torch.device, residual: bool,
           timer) -> dict[str, dict[int, float]]:
    """cuBLAS timed at every row count, the Triton kernel where cuBLAS is suspect (suspect_rows)."""
    cub = time_backend(CUBLAS, n, k, rows, dtype, device, residual, timer)
    suspects = suspect_rows(cub)
    tri = time_backend(TRITON, n, k, suspects, dtype, device, residual, timer) if suspects else {}
    return {CUBLAS: cub, TRITON: tri}


def _load_triton(n: int, k: int, rows: list[int], dtype: torch.dtype, device: torch.device, residual: bool) -> None:
    """Run the Triton kernel on scratch tensors once per kind of row count among `rows`: a start that installs
    a record loads the kernel variants that capture's timing loaded, so its warm-up (`totals.warmup_keys`,
    found at capture after the timing) leaves none to load while recording."""
    kinds = {}  # Triton specializes an int argument (here M, the row count) as 1, a multiple of 16, or other
    for m in sorted(rows):
        kinds.setdefault(1 if m == 1 else 16 if m % 16 == 0 else 0, m)
    most = max(kinds.values())
    x = torch.zeros((most, k), device=device, dtype=dtype)
    w = torch.zeros((n, k), device=device, dtype=dtype)
    r = torch.zeros((most, n), device=device, dtype=dtype) if residual else None
    for m in kinds.values():
        triton_linear(x[:m], w, residual=r[:m] if r is not None else None)


def choose_backends(row_counts: dict[tuple[int, int], list[int]], dtype: torch.dtype, device: torch.device,
                    deterministic: bool, residual_shapes: frozenset[tuple[int, int]] = frozenset(), *,
                    timer: Callable[[Callable[[], None]], float] | None = None,
                    recorded: dict[str, str] | None = None) -> dict[str, str]:
    """Pick and install each weight shape's backend: Triton where cuBLAS is not allowed
    (cublas_allowed); where it is, without `deterministic` and with a `timer` (time_backend's),
    cuBLAS but the Triton kernel at the row counts where it is faster (_timed, triton_rows; all of
    them: "triton"); otherwise cuBLAS. `recorded` (a manifest's `linear_backends`): install that
    record instead, where this build allows it, and load the Triton kernels it runs (_load_triton);
    a shape it lacks or cannot have gets Triton, which the runtime's check against the record then
    refuses (Recapture). `residual_shapes`: the shapes linear_residual also runs (o, down), probed
    and timed in that form. A shape whose timing runs out of device memory keeps cuBLAS, untimed
    (the capture then meets the memory where it must). Returns {"NxK": record} for the manifest
    (the times: installed_times())."""
    _BACKENDS.clear()
    _TRITON_ROWS.clear()
    _ROW_TIMES.clear()
    for (n, k), counts in sorted(row_counts.items()):
        residual = (n, k) in residual_shapes
        wanted, rows = _parse(recorded.get(f"{n}x{k}")) if recorded is not None else (CUBLAS, frozenset())
        if wanted != CUBLAS or (rows and deterministic) or not cublas_allowed(
                n, k, counts, dtype, device, deterministic, residual):
            _BACKENDS[(n, k)] = TRITON
            if recorded is not None and wanted == TRITON and device.type == "cuda":
                _load_triton(n, k, sorted(set(counts)), dtype, device, residual)
            continue
        _BACKENDS[(n, k)] = CUBLAS
        if recorded is None and timer is not None and not deterministic:
            times = None
            try:
                times = _timed(n, k, sorted(set(counts)), dtype, device, residual, timer)
            except torch.cuda.OutOfMemoryError:  # no room to time it (the plan may still fit): untimed, cuBLAS
                pass
            if times is None:
                torch.cuda.empty_cache()  # after the except: its traceback held the timing's tensors
                continue
            _ROW_TIMES[(n, k)] = times
            rows = triton_rows(times)
            if rows == set(times[CUBLAS]):
                _BACKENDS[(n, k)] = TRITON
        if rows and _BACKENDS[(n, k)] == CUBLAS:
            _TRITON_ROWS[(n, k)] = rows
            if recorded is not None and device.type == "cuda":
                _load_triton(n, k, sorted(rows), dtype, device, residual)
    return installed_backends()


def installed_backends() -> dict[str, str]:
    """{"NxK": record} of the shapes choose_backends last decided (empty: Triton everywhere): "cublas",
    "triton", or "cublas+triton:M1,M2,..." (cuBLAS but at those row counts)."""
    return {f"{n}x{k}": b + (f"+{TRITON}:" + ",".join(map(str, sorted(_TRITON_ROWS[(n, k)])))
                             if (n, k) in _TRITON_ROWS else "")
            for (n, k), b in sorted(_BACKENDS.items())}


def installed_times() -> dict[str, dict[str, float]]:
    """{"NxK": {"cublas": us, "chosen": us}} of the shapes choose_backends timed: one call at each of the plan's
    row counts, summed, with cuBLAS alone and with the installed choice."""
    out = {}
    for (n, k), t in sorted(_ROW_TIMES.items()):
        cub, tri = t[CUBLAS], t[TRITON]
        on_triton = set(cub) if _BACKENDS[(n, k)] == TRITON else _TRITON_ROWS.get((n, k), ())
        out[f"{n}x{k}"] = {CUBLAS: round(sum(cub.values()), 1),
                           "chosen": round(sum(tri[m] if m in on_triton else us for m, us in cub.items()), 1)}
    return out
