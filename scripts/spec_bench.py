"""Adaptive speculation on the GPU: tokens/s of the speculative engine (n-gram drafts, K=4,
the policy in runtime/serving/speculation.py deciding per step) against `--no-speculative`,
on the shipped model trained on the standard library's source (trtgraph/assets/stdlib-llama;
random weights would make acceptance meaningless), for random token ids, code-like prompts
(standard-library source) and repetitive prompts, at batch 1, 8 and 64. Outputs are checked
equal token for token. Usage: python scripts/spec_bench.py OUT_DIR [--cpu-smoke]
(writes spec_bench.json, prints a table; --cpu-smoke: a small plan and few tokens, to test
this script on the CPU)."""

import inspect
import json
import json.decoder
import json.encoder
import random
import sys
import time
from pathlib import Path

import yaml

from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.serving.engine import Engine

out_dir = Path(sys.argv[1])
SMOKE = len(sys.argv) > 2 and sys.argv[2] == "--cpu-smoke"
BATCHES = (1, 8) if SMOKE else (1, 8, 64)
MAX_TOKENS = 8 if SMOKE else 128
raw = yaml.safe_load(Path("examples/stdlib-llama.yaml").read_text())
raw["model"]["path"] = str(Path("trtgraph/assets/stdlib-llama").resolve())
raw["device"] = "cpu" if SMOKE else "cuda"
raw["limits"] = {"max_batch_size": max(BATCHES), "max_num_tokens": 512}
raw["buckets"] = {"batch_sizes": "auto", "context_batch_sizes": [1, 2], "chunk_sizes": [64, 256],
                  "sampling": ["greedy"]}
raw["speculative"] = {"method": "ngram", "draft_len": 4, "ngram_min": 1, "ngram_max": 3}
raw["output"] = str(out_dir / "artifacts")
config = Config.from_dict(raw, source="spec_bench")
t0 = time.perf_counter()
capture(config, Path(raw["output"]))
print(f"captured in {time.perf_counter() - t0:.1f} s", flush=True)
vocab = json.loads(Path(raw["model"]["path"], "config.json").read_text())["vocab_size"]

rng = random.Random(0)
sources = [inspect.getsource(m) for m in (json.decoder, json.encoder, random, inspect)]
code_lines = [ln for src in sources for ln in src.splitlines(keepends=True)]
shipped = [json.loads(ln)["prompt"] for ln in Path("examples/stdlib-prompts.jsonl").read_text().splitlines()
           if "prompt" in json.loads(ln)]


def code_prompt(i):
    """A stretch of standard-library source (20 lines), or one of the shipped prompts."""
    if i % 4 == 3:
        return shipped[i % len(shipped)]
    start = rng.randrange(len(code_lines) - 20)
    return "".join(code_lines[start:start + 20])[:1000]


def repetitive_prompt(i):
    line = ["    self.items.append(item)\n", "for i in range(10):\n    total += i\n",
            "x = x + 1\n", "return None\n"][i % 4]
    return f"# repeated\n{line * 8}"


sets = {
    "random": lambda i: {"prompt_token_ids": [rng.randrange(vocab) for _ in range(64)]},
    "code-like": lambda i: {"prompt": code_prompt(i)},
    "repetitive": lambda i: {"prompt": repetitive_prompt(i)},
}
engines = {"speculative": Engine(raw["output"]), "plain": Engine(raw["output"], speculative=False)}
rows = []
for set_name, make in sets.items():
    for batch in BATCHES:
        prompts = [{"id": f"{set_name}-{i}", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **make(i)}
                   for i in range(max(batch, 4))]
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        outputs = {}
        for mode, engine in engines.items():
            list(engine.generate(prompts[:1]))  # warm the host path
            start, tokens, sp, ids = time.perf_counter(), 0, [], []
            for group in groups:
                results = list(engine.generate(group))
                tokens += sum(len(r.token_ids) for r in results)
                ids += [r.token_ids for r in sorted(results, key=lambda r: r.id)]
                sp.append(engine.stats.to_json().get("speculative"))
            seconds = time.perf_counter() - start
            outputs[mode] = ids
            row = {"prompts": set_name, "batch": batch, "mode": mode, "tokens": tokens, "seconds": seconds,
                   "tokens_per_second": tokens / seconds}
            if mode == "speculative":
                row.update({f: sum(s[f] for s in sp) for f in ("verify_steps", "plain_decode_steps", "drafted_rows")})
                fed = [s for s in sp if s["verify_steps"]]
                row["acceptance_rate"] = sum(s["acceptance_rate"] for s in fed) / len(fed) if fed else None
            rows.append(row)
            print(row, flush=True)
        assert outputs["speculative"] == outputs["plain"], f"{set_name} batch {batch}: outputs differ"
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "spec_bench.json").write_text(json.dumps(rows, indent=2))
print("\n| prompts | batch | speculative tok/s | plain tok/s | speculative / plain | verify steps | plain decode steps "
      "| draft acceptance |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for i in range(0, len(rows), 2):
    s, p = rows[i], rows[i + 1]
    acc = f"{100 * s['acceptance_rate']:.1f}%" if s["acceptance_rate"] is not None else "no drafts"
    print(f"| {s['prompts']} | {s['batch']} | {s['tokens_per_second']:.1f} | {p['tokens_per_second']:.1f} | "
          f"{s['tokens_per_second'] / p['tokens_per_second']:.3f} | {s['verify_steps']} | {s['plain_decode_steps']} "
          f"| {acc} |")
