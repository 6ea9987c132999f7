"""The bs-64 decode step's kernels one at a time, for Nsight Compute's hardware counters: each
Llama-3.2-1B layer op (bf16) at 64 rows as the step runs it (cuBLAS qkv, o + residual and down +
residual; the fused norm + gate_up + SiLU; the fused LM head; decode attention at 128 cached
tokens with RoPE + KV write inside), and the fused gate_up at 8 rows for comparison, each once
after a warm-up pass, between cudaProfilerStart / Stop, on fresh weight copies (cold L2).
Usage: ncu --clock-control none --profile-from-start off --section SpeedOfLight
       --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy
       python scripts/ncu_ops.py
"""

import torch
import torch.nn.functional as F

from trtgraph.kernels import attention as at
from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels import triton_ops as t

DEV, DT, H, INTER, VOCAB = torch.device("cuda"), torch.bfloat16, 2048, 8192, 128256


def ops(rows: int):
    """name -> fn() running one op at `rows` rows on weights of its own (two copies, alternated)."""
    def w(n, k):
        return [torch.randn((n, k), device=DEV, dtype=DT) / k ** 0.5 for _ in range(2)]
    x, act = torch.randn((rows, H), device=DEV, dtype=DT), torch.randn((rows, INTER), device=DEV, dtype=DT)
    res, nw = torch.zeros((rows, H), device=DEV, dtype=DT), torch.ones(H, device=DEV, dtype=DT)
    wq, wo, wg, wd, wl = w(3072, H), w(H, H), w(2 * INTER, H), w(H, INTER), w(VOCAB, H)[:1]
    # attention: 64 sequences of 129 tokens (128 cached + this step's), pages of 16
    pages = -(-129 // 16)
    cache = torch.randn((2, rows * pages + 1, 16, 8, 64), device=DEV, dtype=DT)
    tables = torch.arange(rows * pages, device=DEV, dtype=torch.int64).view(rows, pages) + 1
    pos = torch.full((rows,), 128, device=DEV, dtype=torch.int64)
    slots = tables[:, 8] * 16
    cos_sin = torch.randn((256, 64), device=DEV)
    q, k, v = (torch.randn((rows, n, 64), device=DEV, dtype=DT) for n in (32, 8, 8))
    i = [0]

    def nxt(ws):
        i[0] += 1
        return ws[i[0] % len(ws)]
    return {
        "qkv cuBLAS": lambda: F.linear(t.rms_norm(x, nw, 1e-5), nxt(wq)),
        "attention (RoPE inside)": lambda: at.rope_paged_attention(q, k, v, cos_sin, pos, cache, slots, tables, 1,
                                                                   0.125),
        "o cuBLAS addmm_": lambda: res.addmm_(x, nxt(wo).t()),
        "gate_up fused": lambda: dl.norm_gate_up_silu(x, nw, 1e-5, nxt(wg)),
        "down cuBLAS addmm_": lambda: res.addmm_(act, nxt(wd).t()),
        "lm_head fused": lambda: dl.norm_linear(x, nw, 1e-5, wl[0], None, torch.float32),
    }


def main():
    for rows in (64, 8):
        table = ops(rows)
        names = list(table) if rows == 64 else ["gate_up fused"]
        for name in names:  # warm-up: compiles, cuBLAS handles
            table[name]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for name in names:
            torch.cuda.nvtx.range_push(f"{name} @ {rows}")
            table[name]()
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"rows {rows}: profiled {names}", flush=True)


if __name__ == "__main__":
    main()
