"""Adaptive speculation on the GPU: tokens/s of the speculative engine (n-gram drafts, K=4,
the policy in runtime/serving/speculation.py deciding per step) against `--no-speculative`,
on the shipped model trained on the standard library's source (trtgraph/assets/stdlib-llama;
random weights would make acceptance meaningless), for random token ids, code-like prompts
(standard-library source) and repetitive prompts, at batch 1, 8 and 64. Outputs are checked
equal token for token. Each cell (16 requests at batch 1, 32 at 8, 128 at 64, 128 tokens each)
runs 5 times, speculative and plain alternating; the table gives medians and the spread.
A fourth set, "copy", holds lines this model repeats when prompted with them ten times over
(its greedy output loops): the n-gram drafts of its outputs are mostly accepted, so it shows
whether speculation pays where acceptance is high. Each cell also gives what its workload
offers the drafter whatever the policy does (the drafter run over the plain outputs as if
every step drafted: tokens per verify step, accepted / fed drafts), and the policy's measured
wall ms per step of the batch's plain and verify keys (host work included) beside their
replay times.
Usage: python scripts/spec_bench.py OUT_DIR [--cpu-smoke] [--repeats N] [--sets a,b] [--batches 1,8,64]
[--artifacts DIR] [--policy NAME=VALUE,...] (writes spec_bench.json, prints a table; --cpu-smoke: a small plan and few tokens, to
test this script on the CPU; --repeats: paired runs per cell, 5 by default; --sets: which prompt sets,
all by default; --batches: which batch sizes, of 1, 4, 8 and 64; --artifacts: an earlier run's captured plan, used as it
is: no capture; --policy: constants of the speculation policy set for the run, e.g. PROBE_SHARE=0.004,HOPE_LIMIT=4;
PROBE_BUDGET=0: the probes that hope calls not bounded by the probe budget, as before session 17; PROBE_BURST=N: the full
probes the budget banks)."""

import inspect
import json
import json.decoder
import json.encoder
import random
import sys
import time
from pathlib import Path

import yaml

from trtgraph import startup
from trtgraph.buckets import GREEDY
from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.serving.engine import Engine

out_dir = Path(sys.argv[1])
SMOKE = "--cpu-smoke" in sys.argv[2:]
REPEATS_ARG = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv[2:] else None
BATCHES = (1, 8) if SMOKE else (1, 8, 64)
RUN_BATCHES = tuple(int(b) for b in sys.argv[sys.argv.index("--batches") + 1].split(",")) \
    if "--batches" in sys.argv[2:] else BATCHES
REUSE = sys.argv[sys.argv.index("--artifacts") + 1] if "--artifacts" in sys.argv[2:] else None
if "--policy" in sys.argv[2:]:  # NAME=VALUE,...: the speculation policy's constants, for A/B runs
    from trtgraph.runtime.serving.speculation import set_constant
    for item in sys.argv[sys.argv.index("--policy") + 1].split(","):
        name, _, value = item.partition("=")
        try:
            print(f"policy constant {name} = {set_constant(name, value)}", flush=True)
        except ValueError as e:
            sys.exit(f"--policy: {e}")
MAX_TOKENS = 4 if SMOKE else 128
raw = yaml.safe_load(Path("examples/stdlib-llama.yaml").read_text())
raw["model"]["path"] = str(Path("trtgraph/assets/stdlib-llama").resolve())
raw["device"] = "cpu" if SMOKE else "cuda"
raw["limits"] = {"max_batch_size": max(BATCHES), "max_num_tokens": 512}
raw["buckets"] = {"batch_sizes": "auto", "context_batch_sizes": [1, 2], "chunk_sizes": [64, 256],
                  "sampling": ["greedy"]}
raw["speculative"] = {"method": "ngram", "draft_len": 4, "ngram_min": 1, "ngram_max": 3}
raw["output"] = REUSE or str(out_dir / "artifacts")
config = Config.from_dict(raw, source="spec_bench")
t0 = time.perf_counter()
if REUSE is None:
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


# Lines whose greedy continuation this model repeats (it loops on them): the n-gram drafts of
# its 128-token greedy output after each line ten times over are 79-99% accepted (the eager
# model on the CPU), the repetitive set's lines 7-62%.
COPY_LINES = ["d['key'] = value\n", "value[key] = name\n", "name[key] = item\n", "data[key] = result\n",
              "args['key'] = key\n", "item['key'] = value\n"]
sets = {
    "random": lambda i: {"prompt_token_ids": [rng.randrange(vocab) for _ in range(64)]},
    "code-like": lambda i: {"prompt": code_prompt(i)},
    "repetitive": lambda i: {"prompt": repetitive_prompt(i)},
    "copy": lambda i: {"prompt": COPY_LINES[i % len(COPY_LINES)] * 10},
}
SETS = sys.argv[sys.argv.index("--sets") + 1].split(",") if "--sets" in sys.argv[2:] else list(sets)


def ngram_acceptance(prompt_ids, outputs, k=4):
    """What the workload offers the drafter, whatever the policy decides: the n-gram drafter
    run over each (prompt, plain output) as if every step drafted: (tokens per verify step,
    accepted / fed drafts)."""
    from trtgraph.runtime.serving.drafter import NgramDrafter, NgramIndex

    steps = accepted = tokens = 0
    for ids, out in zip(prompt_ids, outputs):
        d, index, full, p = NgramDrafter(k, 1, 3), NgramIndex(), list(ids) + list(out), len(ids)
        while p < len(full):
            drafts, a = d.propose(full[:p], index), 0
            while drafts is not None and a < k and p + a < len(full) and full[p + a] == drafts[a]:
                a += 1
            steps, accepted, p = steps + 1, accepted + a, p + a + 1
        tokens += len(out)
    return tokens / max(steps, 1), accepted / max(k * steps, 1)
engines = {"speculative": Engine(raw["output"]), "plain": Engine(raw["output"], speculative=False)}
startup.freeze_heap(engines["plain"].executor.device)  # as `trtgraph run` does
REPEATS = REPEATS_ARG or (2 if SMOKE else 5)  # each cell runs this often, speculative and plain alternating
PROMPTS = {1: 2, 8: 8} if SMOKE else {1: 16, 4: 32, 8: 32, 64: 128}  # requests per cell (groups of `batch`)
# (batch 4, --batches 4: verify steps of 20 tokens, past the fused GEMVs' 16 rows since the fourteenth session)


def timed(engine, groups):
    """One pass over the cell's groups: (tokens, seconds, token ids by request, per-group speculative
    stats, each with the policy's probes: the steps that made proposals)."""
    start, tokens, sp, ids = time.perf_counter(), 0, [], []
    pol = engine.scheduler.speculation
    for group in groups:
        probes, paced, probe_s, hope = (pol.probes, pol.paced_steps, pol.probe_seconds, pol.hope_probes) if pol else (0, 0, 0.0, 0)
        results = list(engine.generate(group))
        tokens += sum(len(r.token_ids) for r in results)
        ids += [r.token_ids for r in sorted(results, key=lambda r: r.id)]
        st = engine.stats.to_json()
        sp.append({**(st.get("speculative") or {}), "probes": (pol.probes if pol else 0) - probes,
                   "paced": (pol.paced_steps if pol else 0) - paced,
                   "probe_ms": 1e3 * ((pol.probe_seconds if pol else 0.0) - probe_s),
                   "hope_probes": (pol.hope_probes if pol else 0) - hope,
                   "steps": engine.stats.steps, "fast_path_steps": st.get("fast_path_steps", 0)})
    return tokens, time.perf_counter() - start, ids, sp


def median(xs):
    xs = sorted(xs)
    return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2


rows = []
for set_name in SETS:
    make = sets[set_name]
    for batch in RUN_BATCHES:
        prompts = [{"id": f"{set_name}-{i}", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **make(i)}
                   for i in range(PROMPTS[batch])]
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        for engine in engines.values():
            list(engine.generate(prompts[:batch]))  # warm the host path (and the policy's step times)
        runs = {mode: [] for mode in engines}
        for rep in range(REPEATS):
            for mode in (("speculative", "plain") if rep % 2 == 0 else ("plain", "speculative")):
                runs[mode].append(timed(engines[mode], groups))
        for run in runs["speculative"] + runs["plain"]:
            assert run[2] == runs["plain"][0][2], f"{set_name} batch {batch}: outputs differ"
        row = {"prompts": set_name, "batch": batch, "requests": len(prompts), "tokens": runs["plain"][0][0]}
        tk = engines["plain"].tokenizer
        in_order = [p for g in groups for p in sorted(g, key=lambda p: p["id"])]  # as `timed` lists the outputs
        prompt_ids = [p["prompt_token_ids"] if "prompt_token_ids" in p else tk.encode(p["prompt"]) for p in in_order]
        row["ngram_tokens_per_step"], row["ngram_acceptance"] = ngram_acceptance(prompt_ids, runs["plain"][0][2])
        for mode, rs in runs.items():
            tps = [t / s for t, s, _, _ in rs]
            row[mode] = {"tokens_per_second": median(tps), "min": min(tps), "max": max(tps)}
        ratios = [(ts / ss) / (tp / sp_) for (ts, ss, _, _), (tp, sp_, _, _) in zip(runs["speculative"], runs["plain"])]
        row.update(ratio_median=median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        sp = runs["speculative"][-1][3]
        row.update({f: sum(s[f] for s in sp) for f in ("verify_steps", "plain_decode_steps", "drafted_rows", "probes",
                                                        "paced")})
        # The last runs' host time in probes that did not draft (its share of the speculative run's
        # seconds), and the steps / fast-path steps of each engine (a plain step of the speculative
        # engine should take the fast path as the plain engine's does).
        row["probe_ms"] = round(sum(s["probe_ms"] for s in sp), 3)
        row["hope_probes"] = sum(s["hope_probes"] for s in sp)  # of the probes: those the last one's hope called
        row["probe_share"] = round(row["probe_ms"] / (1e3 * runs["speculative"][-1][1]), 5)
        row["steps_speculative_plain"] = [sum(s["steps"] for s in r[3]) for r in (runs["speculative"][-1], runs["plain"][-1])]
        row["fast_path_steps_speculative_plain"] = [sum(s["fast_path_steps"] for s in r[3])
                                                    for r in (runs["speculative"][-1], runs["plain"][-1])]
        fed = [s for s in sp if s["verify_steps"]]
        row["acceptance_rate"] = sum(s["acceptance_rate"] for s in fed) / len(fed) if fed else None
        pol = engines["speculative"].scheduler.speculation
        keys = pol._keys.get((batch, GREEDY)) or (None, None)  # (plain, verify) keys of this batch size, when it formed steps
        row["wall_ms_plain_verify"] = [round(pol.wall_ms[k], 4) if k in pol.wall_ms else None for k in keys]
        row["replay_ms_plain_verify"] = [pol.replay_ms.get(k) for k in keys]
        rows.append(row)
        print(row, flush=True)
pol = engines["speculative"].scheduler.speculation
policy = {"probes": pol.probes, "drafted_steps": pol.drafted_steps, "plain_steps_with_a_match": pol.plain_steps,
          "episodes_won_lost": getattr(pol, "episodes", None),
          "losses": {str(k): v for k, v in getattr(pol, "losses", {}).items()},
          "paced_decisions": getattr(pol, "paced_steps", None),
          "yield_ratio": {str(k): round(v, 4) for k, v in getattr(getattr(pol, "yields", None), "ratio", {}).items()},
          "wall_ms": {str(k): round(v, 4) for k, v in sorted(pol.wall_ms.items(), key=lambda kv: str(kv[0]))},
          "replay_ms": {str(k): v for k, v in sorted(pol.replay_ms.items(), key=lambda kv: str(kv[0]))}}
print("policy, whole run:", json.dumps(policy))
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "spec_bench.json").write_text(json.dumps({"cells": rows, "policy": policy}, indent=2))
print(f"\n{REPEATS} runs per cell, speculative and plain alternating; tok/s: median (min-max); ratio: median of "
      f"the paired runs' speculative / plain (min-max); steps and acceptance: the last speculative run")
print("| prompts | batch | tokens | speculative tok/s | plain tok/s | speculative / plain | verify steps "
      "| rows per verify step | plain decode steps | paced | probes | draft acceptance | offered: tokens/step, acceptance "
      "| wall ms plain / verify | replay ms plain / verify |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    s, p = r["speculative"], r["plain"]
    acc = f"{100 * r['acceptance_rate']:.1f}%" if r["acceptance_rate"] is not None else "no drafts"
    print(f"| {r['prompts']} | {r['batch']} | {r['tokens']} | {s['tokens_per_second']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}) "
          f"| {p['tokens_per_second']:,.0f} ({p['min']:,.0f}-{p['max']:,.0f}) | {r['ratio_median']:.3f} "
          f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['verify_steps']} "
          f"| {r['drafted_rows'] / max(r['verify_steps'], 1):.1f} | {r['plain_decode_steps']} | {r['paced']} | {r['probes']} "
          f"| {acc} | {r['ngram_tokens_per_step']:.2f}, {100 * r['ngram_acceptance']:.0f}% "
          f"| {' / '.join('-' if v is None else f'{v:.3f}' for v in r['wall_ms_plain_verify'])} "
          f"| {' / '.join('-' if v is None else f'{v:.3f}' for v in r['replay_ms_plain_verify'])} |")
print("\nThe probes (the last speculative run; probe ms: host time of the probes that did not draft, share: of "
      "the run's seconds) and the steps of each engine's last run:")
print("| prompts | batch | probes | paced | hope-called | probe ms | probe share | steps spec / plain "
      "| fast-path steps spec / plain |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['prompts']} | {r['batch']} | {r['probes']} | {r['paced']} | {r['hope_probes']} | {r['probe_ms']:.2f} "
          f"| {100 * r['probe_share']:.2f}% | {' / '.join(map(str, r['steps_speculative_plain']))} "
          f"| {' / '.join(map(str, r['fast_path_steps_speculative_plain']))} |")
