"""The LM head of a decode step of 33-64 rows as a TMA-fed GEMM (`linear`, `linear_argmax`).

At those rows the step hoists every norm (models/llama.py `forward_normed`): the LM head takes the
final norm's output as it is, so it is a plain skinny GEMM, fp32 logits [T, V] = x [T, K] @ W[V, K]^T,
plus the greedy argmax in the epilogue of a greedy step. The fused GEMV (kernels/decode_kernel.py)
loads its weight tiles with pointer arithmetic, which Triton pipelines as cp.async (an address per
16 bytes); here the weight and x tiles come through host-built tensor descriptors
(`triton.tools.tensor_descriptor.TensorDescriptor`, `desc.load([n0, k0])`), which Triton pipelines
on sm_90 as TMA bulk copies with mbarriers, `num_stages` deep. On the H200 (docs/performance.md,
tenth session; `scripts/tma_probe.py --head`, alone, 40-64 rows): 150.6-153.4 us with the argmax
against the fused GEMV's 155.3-159.7, fp32 logits 135.4-139.4 against 140.9-145.6 (90-92% of the
copy bandwidth); the replayed bs-64 step 6 us faster (`scripts/decode_ablation.py notma`). With
64-wide K steps (eleventh session, `scripts/partials_probe.py --only head`) two programs share an SM
and one's argmax epilogue overlaps the other's weight stream: 147.4 / 144.0 us at 64 / 40 rows with
the argmax against 154.1 / 151.0 for one program per SM (decode_tuned.TMA_HEAD). On the
layer shapes (qkv, o, gate_up, down) the same kernel lost to today's ops (`scripts/tma_probe.py`),
so it serves the LM head only.

Swap-AB as the fused kernel: a program multiplies a weight tile [BLOCK_N, BLOCK_K] by the step's
rows (one tile of BLOCK_T = 64, zero-filled past T by the descriptor) transposed, acc [BLOCK_N, 64];
grid (1, V / BLOCK_N), so decode_kernel._argmax_epilogue's m-tile / N-tile protocol applies as is.

Batch invariance: the config is a function of the weight shape (decode_tuned.TMA_HEAD), every step
of 33-64 rows runs one 64-row tile, and the MMA reduces each column over K in the same order, so a
row's logits do not depend on the rows beside it or on T within the band (tests/test_tma_head.py
checks steps of 33, 40, 57 and 63 rows against the 64-row step, bitwise, on the GPU). Steps of
other row counts keep the fused GEMV, which rounds otherwise: with `deterministic` the path is not
installed (`choose_tma_head`), as the split down projection is not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import decode_tuned
from .decode_kernel import _argmax_epilogue
from .triton_ops import argmax_best, arrival_counters

TMA_MIN_ROWS, TMA_MAX_ROWS, BLOCK_T = 33, 64, 64
_ON: dict[tuple[int, int], tuple[int, int, int, int]] = {}  # (V, K) -> config, installed by choose_tma_head


@triton.jit
def _tma_head_kernel(x_desc, w_desc, out_ptr, best_ptr, tok_ptr, cnt_ptr, M, N, K, out_stride,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr,
                     ARGMAX: tl.constexpr, PRECISION: tl.constexpr, STORE: tl.constexpr = True):
    """One [BLOCK_N columns, BLOCK_T rows] tile of x @ W^T over the whole K; fp32 out (not with
    STORE off: a greedy step's head); ARGMAX: the rows' running maxima folded in
    (decode_kernel._argmax_epilogue: the last tile writes the tokens)."""
    n0 = tl.program_id(1) * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0])
        xt = x_desc.load([0, k0])
        acc = tl.dot(w, tl.trans(xt), acc, input_precision=PRECISION)
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < M
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if STORE:
        tl.store(out_ptr + rows[None, :] * out_stride + cols[:, None], acc, mask=col_ok[:, None] & row_ok[None, :])
    if ARGMAX:
        _argmax_epilogue(acc, rows, row_ok, cols, col_ok, best_ptr, tok_ptr, cnt_ptr)


def _launch(x: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor | None,
            config: tuple[int, int, int, int] | None = None, store: bool = True) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, K = x.shape
    V = weight.shape[0]
    bn, bk, stages, warps = config or _ON[(V, K)]
    assert 0 < T <= BLOCK_T and V < 1 << 24, (T, V)
    out = torch.empty((T, V) if store else (1, 1), dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(V, bn)
    if tokens is not None:  # the argmax's running maxima and counters, as decode_linear._launch keeps them
        best, cnt = argmax_best(T, x.device), arrival_counters(tiles + 1, x.device)[tiles:]
    else:
        best = cnt = tokens = out
    _tma_head_kernel[(1, tiles)](
        TensorDescriptor.from_tensor(x, [BLOCK_T, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        out, best, tokens, cnt, T, V, K, out.stride(0), BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=BLOCK_T, STAGES=stages,
        ARGMAX=tokens is not out, STORE=store, PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, config=None) -> torch.Tensor:
    """fp32 x @ weight.T for x [T <= 64, K] (contiguous rows, 16-byte aligned), weight [V, K]."""
    return _launch(x, weight, None, config)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, config=None,
                  store: bool = True) -> torch.Tensor:
    """linear's fp32 logits, and each row's first maximal column written into tokens (int64 [T]);
    store=False: the tokens only, no logits written (None returned)."""
    out = _launch(x, weight, tokens, config, store)
    return out if store else None


def _aligned(t: torch.Tensor) -> bool:
    """A tensor descriptor's terms: unit last stride, 16-byte aligned base and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def runs_tma(x: torch.Tensor, weight: torch.Tensor, norm_weight, bias, out_dtype) -> bool:
    """Whether the LM head call runs here: an installed weight shape, 33-64 rows, no norm or bias
    left to apply (the step hoisted the final norm), fp32 logits, descriptor-ready tensors."""
    return (tuple(weight.shape) in _ON and TMA_MIN_ROWS <= x.shape[0] <= TMA_MAX_ROWS and norm_weight is None
            and bias is None and out_dtype == torch.float32 and x.dtype == weight.dtype
            and _aligned(x) and _aligned(weight))


def choose_tma_head(head_shape: tuple[int, int] | None, row_counts: list[int], device: torch.device,
                    deterministic: bool, tensor_parallel: bool, dtype: torch.dtype) -> dict[str, str]:
    """Install the TMA LM head for the head weight [V, K] where decode_tuned.TMA_HEAD measured it
    faster: on a CUDA device with TMA (compute capability 9.0+), one GPU, 16-bit weights, not with
    `deterministic`, and the plan running logit rows in 33-64. Returns `installed_tma_head()`."""
    _ON.clear()
    cfg = decode_tuned.TMA_HEAD.get(tuple(head_shape or ()))
    if (cfg and device.type == "cuda" and not tensor_parallel and not deterministic and dtype.itemsize == 2
            and any(TMA_MIN_ROWS <= m <= TMA_MAX_ROWS for m in row_counts)
            and torch.cuda.get_device_capability(device) >= (9, 0)):
        _ON[tuple(head_shape)] = tuple(cfg)
    return installed_tma_head()


def installed_tma_head() -> dict[str, str]:
    """The manifest's record: {"norm_linear_tma:VxK": "tma:33-64"} per installed shape."""
    return {f"norm_linear_tma:{v}x{k}": f"tma:{TMA_MIN_ROWS}-{TMA_MAX_ROWS}" for v, k in sorted(_ON)}
