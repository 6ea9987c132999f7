"""The fused decode GEMVs' launch configs and the shapes where the composition was faster,
measured on the H200 by `python scripts/tune_decode_linear.py OUT.json --write` (which rewrites
this file; docs/performance.md has the numbers).

TUNED: (N, K) -> (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, stack[, prenorm]), one per weight
shape for every row count. SLOWER: (op, N, K) whose fused kernel lost to the composition (summed over
T = 1, 8), so the composition runs there. WIDE: (op, N, K) whose fused kernel also beat
the composition at T = 40 and 64, so it runs for steps of up to 64 rows (32 elsewhere).

qkv (3072, 2048) and o (2048, 2048) keep the third session's configs, and o stays fused: the
fourth session's tuner picked qkv (64, 128, 8, 8, 3, stacked) and o (64, 256, 4, 4, 3) with o's
composition (cuBLAS addmm_) faster alone, but the replayed step with those picks was 20-80 us
slower at bs 1-32 (scripts/decode_ablation.py; docs/performance.md, branch h/k4). A --write
run rewrites the tables below: check the step with decode_ablation.py before committing it.

Fifth session (branch h/k5; docs/performance.md): qkv, o and down stay composed past 32 rows.
Fused up to 64 rows (WIDE), qkv and down take bs 64 from 134 to 86 kernels per step, but the
replayed step was 14-22 us slower at bs 40-64 (alone, at 40-64 rows: qkv 11.8 vs 11.0 us,
down 15.4-16.0 vs 14.8); with o as well, 33-37 us slower (measured with a since withdrawn
epilogue preload). The LM head is PRENORM (x normed once
by a row pass, not again in each of its 1002 programs): 150.8 vs 160.0 us alone at 64 rows,
the step 7.5 us faster at bs 40-64 and 2-3.5 us slower at bs 1-8 (the row pass's launch).

Eighth session (scripts/depth_probe.py, docs/performance.md): gate_up streams its weights in
64-wide K steps, 6 stages deep (was 128-wide, 3 deep: the same shared memory, more bytes in
flight; Nsight Compute had the 64-row gate_up at 59% of DRAM peak): alone 21.8 vs 23.2 us at 64
rows, 20.1 vs 21.2 at 8; the replayed step 25-33 us faster at bs 40-64, 6 at bs 32, equal at
bs 1-8 (scripts/decode_ablation.py `deep-gu`). The LM head's deeper variant (128, 64, 1, 8, 5)
gained 3-8 us more at bs 40-64 but lost 1-9 us at bs 1: not taken.
"""

TUNED = {
    (2048, 2048): (64, 128, 4, 4, 4, False),
    (2048, 8192): (64, 256, 4, 4, 3, False),
    (3072, 2048): (64, 128, 4, 8, 3, True),
    (16384, 2048): (64, 64, 1, 8, 6, True),
    (128256, 2048): (128, 128, 1, 8, 3, False, True),
}
SLOWER = {
}
WIDE = {
    ('norm_gate_up_silu', 16384, 2048),
    ('norm_linear', 128256, 2048),
}
# The light CUDA-core kernel (kernels/decode_light.py) for steps of one row, where the plan's
# determinism allows it (decode_linear.choose_fused): (N, K) -> (BLOCK_N, BLOCK_K, SPLIT_K, warps),
# the best at T = 1 with PDL of `python scripts/decode_boundary.py OUT.json --write` (sixth session,
# docs/performance.md); and the MODEs (0 plain, 1 residual, 2 SiLU, 3 RoPE) launched with
# programmatic dependent launch: o, down, gate_up and qkv (bs 1: 0.895-0.905 ms with it, 0.974-0.976
# without, 0.959-0.998 on the tensor-core kernel; scripts/decode_ablation.py).
LIGHT = {
    (3072, 2048): (2, 1024, 1, 2),
    (2048, 2048): (8, 1024, 1, 8),
    (16384, 2048): (16, 256, 1, 4),
    (2048, 8192): (4, 2048, 1, 8),
}
LIGHT_PDL = {1, 2, 3}
# The persistent layer tail (kernels/decode_persistent.py: o + residual, norm + gate_up + SiLU,
# down + residual in one launch) for steps of 33-64 rows, with deterministic off. Off: on the H200
# (seventh session, docs/performance.md) it was 3.3-4.8 us per layer slower than today's 33-64-row
# path alone (46.4-47.4 vs 42.3-43.1, scripts/tail_bench.py) and the replayed step 42-62 us slower
# at bs 40 and 64 (scripts/decode_ablation.py `tail`), for 70 kernels per step instead of 118.
TAIL = False

# The down projection at 17-64 rows as cuBLAS partial products over this many K slices, summed with
# the residual and the next layer's RMSNorm in one kernel (kernels/split_residual.py): (N, K) -> slices.
# On the H200 (scripts/splitk_probe.py, 16 layers in a graph, us per layer at 40 / 48 / 56 / 64 rows):
# 4 slices 15.2 / 15.4 / 15.4 / 15.6, 2 slices 15.7-16.0, 8 slices 16.1-16.5, against cuBLAS's own
# split-K GEMM + reduce + the RMSNorm kernel 16.7-16.8.
SPLIT_DOWN = {(2048, 8192): 4}

# The LM head at 33-64 rows as a TMA-fed GEMM (kernels/tma_head.py), where the norms are hoisted:
# (V, K) -> (BLOCK_N, BLOCK_K, stages, warps). On the H200 (scripts/tma_probe.py, tenth session,
# us alone at 64 / 40 rows): 140.2 / 136.4 against the fused GEMV's 150.1 / 145.5 (with its norm
# row pass) and cuBLAS's 145.2 / 137.0; 64-wide tiles were as fast at 64 rows (138.4) but 151.4
# at 40 (twice the x tiles streamed per weight byte). The replayed bs-64 step: -6 us (notma).
# Eleventh session (scripts/partials_probe.py --only head, two calls, us alone with the argmax at 64 /
# 40 rows): 64-wide K steps, 4 stages (96 KB of shared memory: two programs per SM, so one's
# argmax epilogue overlaps the other's weight stream) 147.4 / 144.0 against 128-wide, 4 stages (one
# program per SM) 154.1 / 151.0; fp32 logits alone the same (139.5 / 136.6 against 139.9 / 136.3).
TMA_HEAD = {(128256, 2048): (128, 64, 4, 4)}
