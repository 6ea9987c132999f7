"""Step time with and without batch invariance (`deterministic: true | false`) on a config's
model shapes, decode keys at batch 1, 8, 64 (greedy, 128 cached tokens) and one prefill key,
against the bandwidth floor; plus each GEMM shape's backend from the manifest.
Usage: python scripts/invariance_cost.py CONFIG.yaml WORKDIR"""

import json
import statistics
import sys
from pathlib import Path

import torch

from trtgraph.bench import BenchOptions, _timed, decode_times, measure_bandwidth
from trtgraph.buckets import GraphKey
from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.step.executor import StepRow


def prefill_ms(ex, key: GraphKey) -> float:
    q = key.chunk_size
    need = -(-q // ex.block_size)
    rows = [StepRow(token_ids=[(5 * i + j) % 1000 for j in range(q)], start_pos=0,
                    block_table=list(range(1 + i * need, 1 + (i + 1) * need))) for i in range(key.batch_size)]
    ex.prepare(key, rows)
    with torch.inference_mode():
        ex.execute(key)
        return statistics.median(_timed(ex.device, lambda: ex.execute(key), 5) for _ in range(3)) * 1e3


def main():
    base = Config.from_yaml(sys.argv[1]).to_dict()
    work = Path(sys.argv[2])
    bw = measure_bandwidth(torch.device("cuda"))
    table = {}
    for det in (True, False):
        d = json.loads(json.dumps(base))
        d["deterministic"] = det
        d["buckets"].update(batch_sizes=[1, 8, 64], context_batch_sizes=[8], chunk_sizes=[512], sampling=["greedy"])
        out = work / f"det_{det}"
        d["output"] = str(out)
        res = capture(Config.from_dict(d, source=f"deterministic={det}"), out)
        ex = res.executor
        rows = decode_times(ex, BenchOptions(context_len=128, repeats=50), print)
        pre = prefill_ms(ex, GraphKey(8, 0, 512, "greedy"))
        table[det] = (rows, pre, res.manifest.totals.get("linear_backends"))
        print(f"deterministic={det}: GEMM backends {table[det][2]}; prefill 8 x 512 tokens {pre:.3f} ms")
        del ex, res
        torch.cuda.empty_cache()
    print("\n| batch | deterministic ms | fastest ms | cost | floor ms | det / floor |")
    print("|---|---|---|---|---|---|")
    for a, b in zip(table[True][0], table[False][0]):
        floor = (a["weight_bytes"] + a["kv_bytes"]) / bw * 1e3
        print(f"| {a['batch_size']} | {a['replay_ms']:.3f} | {b['replay_ms']:.3f} | "
              f"{a['replay_ms'] / b['replay_ms'] - 1:+.1%} | {floor:.3f} | {a['replay_ms'] / floor:.2f}x |")
    pa, pb = table[True][1], table[False][1]
    print(f"| prefill 8x512 | {pa:.3f} | {pb:.3f} | {pa / pb - 1:+.1%} | | |")


if __name__ == "__main__":
    main()
