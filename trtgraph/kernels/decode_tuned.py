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

qkv (norm_qkv_rope 3072 x 2048) and down (linear_residual 2048 x 8192) are WIDE by the replayed
step, not by the op alone (fifth session, branch h/k5): alone each is ~1 us slower than its
composition at 40 and 64 rows, but fusing both removes RMSNorm, RoPE and cuBLAS's split-K reduce
(bs 64: 133 -> 85 kernels per step) and the step did not get slower (docs/performance.md).
o stays composed past 32 rows (fused, the bs 40-64 step was ~30 us slower).
The LM head is PRENORM (x normed by one row pass, not again in each of its 1002 programs).
"""

TUNED = {
    (2048, 2048): (64, 128, 4, 4, 4, False),
    (2048, 8192): (64, 256, 4, 4, 3, False),
    (3072, 2048): (64, 128, 4, 8, 3, True),
    (16384, 2048): (64, 128, 1, 8, 3, True),
    (128256, 2048): (128, 128, 1, 8, 3, False, True),
}
SLOWER = {
}
WIDE = {
    ('linear_residual', 2048, 8192),
    ('norm_gate_up_silu', 16384, 2048),
    ('norm_linear', 128256, 2048),
    ('norm_qkv_rope', 3072, 2048),
}
