"""Speculative decoding on the GPU: tokens/s with and without speculation, at batch 1 and
32, on prompts where drafting helps (text to repeat or edit) and where it does not (random
token ids). Usage: python scripts/spec_bench.py OUT_DIR  (writes spec_bench.json, prints a table)."""

import json
import random
import sys
import time
from pathlib import Path

import yaml

from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.serving.engine import Engine

out_dir = Path(sys.argv[1])
SMOKE = len(sys.argv) > 2 and sys.argv[2] == "--cpu-smoke"  # the tiny default config, to test this script
raw = yaml.safe_load(Path("trtgraph/default.yaml" if SMOKE else "examples/llama-3.2-1b-synthetic.yaml").read_text())
raw["limits"]["max_batch_size"] = 32
raw["buckets"].update({"sampling": ["greedy"], "chunk_sizes": [16, 64] if SMOKE else [64, 256]})
raw["speculative"] = {"method": "ngram", "draft_len": 4, "ngram_min": 1, "ngram_max": 3}
raw["output"] = "/tmp/spec-artifacts"
config = Config.from_dict(raw, source="spec_bench")
t0 = time.perf_counter()
capture(config, Path(raw["output"]))
print(f"captured in {time.perf_counter() - t0:.1f} s", flush=True)

rng = random.Random(0)
passages = ["The quick brown fox jumps over the lazy dog near the river bank at dawn. ",
            "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
            "Item 1: apples. Item 2: pears. Item 3: plums. Item 4: figs. ",
            "To be, or not to be, that is the question: whether 'tis nobler in the mind. "]


def repeat_prompt(i):
    p = passages[i % len(passages)]
    return f"Repeat the text below exactly, twice.\n{p * 2}\nRepeat:\n{p}"


sets = {
    "repeat/edit text": lambda i: {"id": f"t{i}", "prompt": repeat_prompt(i), "max_tokens": 16 if SMOKE else 128},
    "random tokens": lambda i: {"id": f"r{i}", "prompt_token_ids": [rng.randrange(256 if SMOKE else 32000) for _ in range(128)],
                                "max_tokens": 16 if SMOKE else 128},
}
engines = {"speculative": Engine(raw["output"]), "plain": Engine(raw["output"], speculative=False)}
rows = []
for set_name, make in sets.items():
    for batch in (1, 32):
        prompts = [make(i) for i in range(32 if batch == 32 else 4)]
        for mode, engine in engines.items():
            list(engine.generate(prompts[:1]))  # warm the host path
            start, tokens, stats = time.perf_counter(), 0, []
            groups = [prompts] if batch == 32 else [[p] for p in prompts]
            for group in groups:
                tokens += sum(len(r.token_ids) for r in engine.generate(group))
                stats.append(engine.stats.to_json())
            seconds = time.perf_counter() - start
            sp = [s.get("speculative") for s in stats if s.get("speculative")]
            acc = sum(s["acceptance_rate"] for s in sp) / len(sp) if sp else None
            per = sum(s["mean_tokens_per_row_step"] for s in sp) / len(sp) if sp else None
            rows.append({"prompts": set_name, "batch": batch, "mode": mode, "tokens": tokens,
                         "seconds": seconds, "tokens_per_second": tokens / seconds, "acceptance_rate": acc,
                         "tokens_per_row_step": per})
            print(rows[-1], flush=True)
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "spec_bench.json").write_text(json.dumps(rows, indent=2))
print("\n| prompts | batch | speculative tok/s | plain tok/s | speed-up | draft acceptance | tokens per verify row |")
print("|---|---:|---:|---:|---:|---:|---:|")
for i in range(0, len(rows), 2):
    s, p = rows[i], rows[i + 1]
    acc = f"{100 * s['acceptance_rate']:.1f}%" if s["acceptance_rate"] is not None else "no drafts"
    per = f"{s['tokens_per_row_step']:.2f}" if s["tokens_per_row_step"] is not None else "-"
    print(f"| {s['prompts']} | {s['batch']} | {s['tokens_per_second']:.1f} | {p['tokens_per_second']:.1f} | "
          f"{s['tokens_per_second'] / p['tokens_per_second']:.2f}x | {acc} | {per} |")
