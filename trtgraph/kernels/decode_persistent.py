"""The persistent layer tail: a decoder layer's o projection (+ residual), RMSNorm + gate_up +
SiLU-and-mul, and down projection (+ residual) as ONE kernel launch, for steps of
TAIL_MIN_ROWS..TAIL_MAX_ROWS rows (33-64: where the three separate kernels lose most to their
boundaries; docs/performance.md, fifth and sixth sessions).

Structure. A grid of at most one program per SM (all co-resident: `_programs`); the three phases
in a fixed order, each phase's work items (output tile x split-K split, the tensor-core kernel's
programs: decode_kernel._tile, the same configs as the fused ops, decode_linear.decode_config)
dealt round-robin to the programs; between phases a grid-wide arrival counter (`_grid_sync`).
Before a program waits there, it may put its next item's first weight bytes on their way to L2
(`_PREFETCH_BYTES`; the weights do not depend on the previous phase), meant to overlap the
boundary's ramp with the previous phase's tail: on the H200 it made the tail slower (off).

Off (decode_tuned.TAIL): on the H200 the tail was 3-5 us per layer slower than the separate
kernels, and the replayed step 42-62 us slower at bs 40-64 (docs/performance.md, seventh session).
The split-K arrival counters (decode_kernel._finish) and the phase counters put themselves back
to 0 in every launch (the last program to leave resets the phase counters), so CUDA-graph
replays need no reset.

Hazards designed out:
- a grid larger than what is co-resident would deadlock at the first arrival: the grid is at
  most the SM count (each program fits an SM alone: the launch fails otherwise, it never hangs),
  and the kernel is never launched with programmatic dependent launch and never triggers its
  dependents early (`gdc_launch_dependents`), so no other kernel's program can hold an SM that one
  of its programs still needs;
- under TRITON_INTERPRET=1 programs run one after another: there the grid is one program (which
  works through every item of a phase itself and passes each arrival at once).

Rounding: each phase is the fused kernel's arithmetic for its shape (same BLOCK_K, split and
split-order sum), so a row's result does not depend on the other rows. `choose_fused` installs the
tail only with `deterministic: false` (decode_linear; the separate fused ops serve 1-32 rows).

`with_tail(ops)` adds the dispatching `layer_tail` op to a FusedOps: this kernel where installed and
the step has TAIL_MIN_ROWS..TAIL_MAX_ROWS rows, else the composition of the ops' own o / MLP ops
(kernels/composed.py's `tail_op`, also the torch reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import decode_linear as dl
from . import decode_occupancy as occ
from . import decode_tuned
from .composed import FusedOps, tail_op
from .decode_kernel import _prefetch_l2, _tile
from .triton_ops import arrival_counters

TAIL_MIN_ROWS, TAIL_MAX_ROWS = 33, 64
# ((o N, K), (gate_up N, K), (down N, K)) whose layer tail runs this kernel; installed by
# decode_linear.choose_fused (empty unless installed: the op then runs the composition)
_TAIL_ON: set[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]] = set()
# Bytes per weight row of a program's next item put on their way to L2 before it waits at a phase
# boundary (a multiple of 16). 0: on the H200, 1 KB per row (gate_up: 16 MB of the 50 MB L2) made
# the tail 5.7-5.8 us per layer slower at 33-64 rows (scripts/tail_bench.py; docs/performance.md).
_PREFETCH_BYTES = 0
_NUM_WARPS: int | None = None  # None: the most of the three configs' (8); scripts/decode_ablation.py's `tail-w4`: 4


@triton.jit
def _grid_sync(bar_ptr, target):
    """Arrive at the grid-wide counter and wait until `target` programs have: every write of the
    arrived programs before their arrival is visible after it (release, then acquire)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release")
    # a scalar atomic is one thread's (its value broadcast to the program): one poller per
    # program, not every thread (call 2's volatile loads from every thread hammered one L2 line)
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _phase(x_ptr, nw_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, pid, nprog, M, N, K, k_per_split, x_stride, out_stride,
           eps, pair_offset, MODE: tl.constexpr, HAS_NORM: tl.constexpr, PRECISION: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, NACC: tl.constexpr,
           BLOCK_T: tl.constexpr, EVEN: tl.constexpr, STACK: tl.constexpr):
    """This program's items of one op (residual ops add into out in place): item = tile * SPLIT_K + split."""
    for item in range(pid, tl.cdiv(N, BLOCK_N) * SPLIT_K, nprog):
        _tile(x_ptr, nw_ptr, out_ptr, w_ptr, w_ptr, out_ptr, out_ptr, out_ptr, out_ptr, out_ptr, out_ptr, ws_ptr,
              cnt_ptr, 0, item // SPLIT_K, item % SPLIT_K, M, N, K, k_per_split, x_stride, K, out_stride, out_stride,
              eps, pair_offset, 0, 0, 0, 0, 0, MODE, HAS_NORM, False, 1, PRECISION, BLOCK_N, BLOCK_K, SPLIT_K, NACC,
              BLOCK_T, EVEN, STACK, False, 0, False)


@triton.jit
def _prefetch_item(w_ptr, pid, N, K, k_per_split, pair_offset, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT_K: tl.constexpr, NBYTES: tl.constexpr):
    """The first NBYTES of each weight row of this program's first item of an op, to L2."""
    if NBYTES > 0:
        if pid < tl.cdiv(N, BLOCK_N) * SPLIT_K:
            cols = (pid // SPLIT_K) * BLOCK_N + tl.arange(0, BLOCK_N)
            ptrs = w_ptr + cols.to(tl.int64) * K + (pid % SPLIT_K) * k_per_split
            _prefetch_l2(ptrs, NBYTES)
            if MODE == 2:
                _prefetch_l2(ptrs + pair_offset * K, NBYTES)


@triton.jit
def _tail_kernel(a_ptr, wo_ptr, h_ptr, nw_ptr, wgu_ptr, act_ptr, wd_ptr, ws_ptr, cnt_ptr, bar_ptr,
                 M, H, INTER, KO, a_stride, h_stride, eps, kps_o, kps_g, kps_d,
                 PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                 BN_O: tl.constexpr, BK_O: tl.constexpr, SK_O: tl.constexpr, EVEN_O: tl.constexpr,
                 BN_G: tl.constexpr, BK_G: tl.constexpr, SK_G: tl.constexpr, EVEN_G: tl.constexpr,
                 STACK_G: tl.constexpr, PF_G: tl.constexpr,
                 BN_D: tl.constexpr, BK_D: tl.constexpr, SK_D: tl.constexpr, EVEN_D: tl.constexpr,
                 PF_D: tl.constexpr):
    """h [M, H] in place: h += a @ Wo^T; act = silu(g) * u of rmsnorm(h) @ Wgu^T; h += act @ Wd^T."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _phase(a_ptr, nw_ptr, wo_ptr, h_ptr, ws_ptr, cnt_ptr, pid, nprog, M, H, KO, kps_o, a_stride, h_stride, eps, 0,
           1, False, PRECISION, BN_O, BK_O, SK_O, 1, BLOCK_T, EVEN_O, False)
    _prefetch_item(wgu_ptr, pid, INTER, H, kps_g, INTER, 2, BN_G, SK_G, PF_G)
    _grid_sync(bar_ptr, nprog)
    _phase(h_ptr, nw_ptr, wgu_ptr, act_ptr, ws_ptr, cnt_ptr, pid, nprog, M, INTER, H, kps_g, h_stride, INTER, eps,
           INTER, 2, True, PRECISION, BN_G, BK_G, SK_G, 2, BLOCK_T, EVEN_G, STACK_G)
    _prefetch_item(wd_ptr, pid, H, INTER, kps_d, 0, 1, BN_D, SK_D, PF_D)
    _grid_sync(bar_ptr + 1, nprog)
    _phase(act_ptr, nw_ptr, wd_ptr, h_ptr, ws_ptr, cnt_ptr, pid, nprog, M, H, INTER, kps_d, INTER, h_stride, eps, 0,
           1, False, PRECISION, BN_D, BK_D, SK_D, 1, BLOCK_T, EVEN_D, False)
    # every program has passed both arrivals once it counts here: the last one resets them
    left = tl.atomic_add(bar_ptr + 2, 1, sem="acq_rel")
    if left == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)
        tl.atomic_xchg(bar_ptr + 2, 0)


def _split(cfg: dl.DecodeConfig, n: int, k: int) -> tuple[int, int, int, bool]:
    """(splits, k per split, items, EVEN) of a config on a weight [n cols, k], as decode_linear._launch splits."""
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    return split, k_per_split, triton.cdiv(n, cfg.block_n) * split, k % k_per_split == 0 and n % cfg.block_n == 0


def _programs(items: int, device: torch.device) -> int:
    """The grid: at most one program per SM, so every program is resident at once (one program
    on the CPU interpreter, which runs programs one after another)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(items, occ.sm_resources(index)[0]))


def layer_tail(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight):
    """residual + mlp(norm(residual + attn @ o_weight.T)) on top of that sum, written into
    residual's storage (the composition's `tail_op`, in one launch; steps of <= 64 rows)."""
    T, H = residual.shape
    inter = gate_up_weight.shape[0] // 2
    assert 0 < T <= TAIL_MAX_ROWS and residual.is_contiguous() and attn.stride(-1) == 1
    assert o_weight.is_contiguous() and gate_up_weight.is_contiguous() and down_weight.is_contiguous()
    dev, el = residual.device, o_weight.element_size()
    co, cg, cd = (dl.decode_config(*w.shape, dev) for w in (o_weight, gate_up_weight, down_weight))
    so, kpo, io, even_o = _split(co, H, o_weight.shape[1])
    sg, kpg, ig, even_g = _split(cg, inter, H)
    sd, kpd, i_d, even_d = _split(cd, H, inter)
    bt = dl.row_tile(T)
    slot = (co.block_n + 1) * bt, (cd.block_n + 1) * bt, (2 * cg.block_n + 1) * bt
    ws = torch.empty(max(io * slot[0], i_d * slot[1], ig * slot[2] if sg > 1 else 1), dtype=torch.float32, device=dev)
    tiles = max(io // so, i_d // sd, ig // sg)
    cnt = arrival_counters(tiles + 3, dev)
    act = torch.empty((T, inter), dtype=gate_up_weight.dtype, device=dev)
    cuda = dev.type == "cuda"
    grid = (_programs(max(io, ig, i_d), dev),)
    stages = min(occ.fit_stages(c, n, el, dev, bt) for c, n in ((co, 1), (cg, 2), (cd, 1)))
    _tail_kernel[grid](
        attn, o_weight, residual, norm_weight, gate_up_weight, act, down_weight, ws, cnt, cnt[tiles:],
        T, H, inter, o_weight.shape[1], attn.stride(0), residual.stride(0), float(eps), kpo, kpg, kpd,
        PRECISION="ieee" if o_weight.dtype == torch.float32 else "tf32", BLOCK_T=bt,
        BN_O=co.block_n, BK_O=co.block_k, SK_O=so, EVEN_O=even_o,
        BN_G=cg.block_n, BK_G=cg.block_k, SK_G=sg, EVEN_G=even_g, STACK_G=cg.stack,
        PF_G=min(kpg * el, _PREFETCH_BYTES) if cuda and even_g else 0,
        BN_D=cd.block_n, BK_D=cd.block_k, SK_D=sd, EVEN_D=even_d,
        PF_D=min(kpd * el, _PREFETCH_BYTES) if cuda and even_d else 0,
        num_warps=_NUM_WARPS or max(co.num_warps, cg.num_warps, cd.num_warps), num_stages=stages)
    return residual


def runs_tail(o_weight, gate_up_weight, down_weight, rows: int) -> bool:
    """Whether a step of `rows` rows runs the persistent tail for these weights (shape-only)."""
    return (TAIL_MIN_ROWS <= rows <= TAIL_MAX_ROWS
            and (tuple(o_weight.shape), tuple(gate_up_weight.shape), tuple(down_weight.shape)) in _TAIL_ON)


def with_tail(ops: FusedOps) -> FusedOps:
    """ops with `layer_tail` dispatching: the persistent kernel where installed (runs_tail), the
    composition of ops' own o / gate_up / down ops otherwise."""
    composed = tail_op(ops)

    def tail(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight):
        fn = layer_tail if runs_tail(o_weight, gate_up_weight, down_weight, residual.shape[0]) else composed
        return fn(attn, o_weight, residual, norm_weight, eps, gate_up_weight, down_weight)

    return ops._replace(layer_tail=tail)


def choose_tail(choice: dict, device: torch.device, deterministic: bool, tensor_parallel: bool,
                dtype: torch.dtype) -> None:
    """Install the persistent tail (decode_tuned.TAIL) for every layer whose o, gate_up and down
    shapes the fused choice runs (o: a fused linear_residual [H, Ko] other than down's [H, I]):
    on CUDA, one GPU, 16-bit weights, and not with `deterministic` (one rounding per shape for
    every T: the tail serves 33-64 rows only)."""
    _TAIL_ON.clear()
    if not decode_tuned.TAIL or deterministic or tensor_parallel or device.type != "cuda" or dtype.itemsize != 2:
        return
    fused = {(op, n, k) for (op, n, k), c in choice.items() if c == dl.FUSED}
    for op, n, k in sorted(fused):
        down = ("linear_residual", k, n // 2)
        if op != "norm_gate_up_silu" or down not in fused:
            continue
        for o in sorted(s for s in fused if s[0] == "linear_residual" and s[1] == k and s != down):
            _TAIL_ON.add((o[1:], (n, k), down[1:]))


def tail_shapes() -> set[tuple[str, int, int]]:
    """The (op, N, K) of every installed tail's three ops (for the manifest's record)."""
    return {s for o, gu, down in _TAIL_ON
            for s in (("linear_residual", *o), ("norm_gate_up_silu", *gu), ("linear_residual", *down))}
