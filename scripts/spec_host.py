"""Host time per step of the speculative engine against the plain one, on the CPU (static
backend, a tiny synthetic model whose `execute` is replaced by a draw of random tokens, so
that the loop's CPU time is the host's: packing, scheduling, the policy, proposals, read-back;
process time, not wall time: other processes on a shared machine do not count).
Drafts never match (the tokens are random, none is accepted). The speculative engine's policy
gets replay times (each verify key 1.5x its plain key) and measures wall times, as on CUDA.
Usage: python scripts/spec_host.py OUT_DIR [--batches 1,8,64] [--tokens 64] [--repeats 3]
(prints one line per cell: host us/step plain, speculative, the difference, propose calls, and
Python function calls per step of each engine, counted by cProfile in one more run: a figure
that the machine's load does not move)."""

import argparse
import cProfile
import pstats
import random
import time
from pathlib import Path

import torch

from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.serving.engine import Engine

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--batches", default="1,8,64")
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--repeats", type=int, default=3)
args = ap.parse_args()
batches = [int(b) for b in args.batches.split(",")]
torch.set_num_threads(1)

d = Config.default().to_dict()
d["device"] = "cpu"
d["limits"] = {"max_batch_size": max(batches), "max_seq_len": 256, "max_num_tokens": 512}
d["kv_cache"] = {**d.get("kv_cache", {}), "num_blocks": max(batches) * 16 + 8}
d["buckets"] = {**d["buckets"], "chunk_sizes": [64]}
d["speculative"] = {"method": "ngram", "draft_len": 4, "ngram_min": 1, "ngram_max": 3}
art = Path(args.out) / "artifacts"
if not (art / "manifest.json").exists():
    capture(Config.from_dict(d, source="spec_host"), art)
spec, plain = Engine(art), Engine(art, speculative=False)
pol = spec.scheduler.speculation
pol.replay_ms = {k: (1.5 if k.draft_len else 1.0) for k in spec.manifest.graph_keys if not k.is_prefill}
pol.measure = True
calls = [0]
propose = spec.drafter.propose
spec.drafter.propose = lambda *a, **kw: calls.__setitem__(0, calls[0] + 1) or propose(*a, **kw)
from trtgraph.runtime.step.executor import StepOutputs

gen = torch.Generator().manual_seed(0)
rows = spec.executor.buffers.max_rows
accepted = torch.zeros(spec.executor.buffers.max_seqs, dtype=torch.int64)


def fake_execute(key, eager=False):
    """The model's step, replaced: random tokens, no draft accepted."""
    return StepOutputs(None, torch.randint(3, 300, (rows,), generator=gen), accepted)


for eng in (spec, plain):
    eng.executor.execute = fake_execute
rng = random.Random(0)
workloads = {"never-match": lambda i: {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(32)]}}
for name, make in workloads.items():
    for bs in batches:
        reqs = [{"id": f"{name}-{i}", "max_tokens": args.tokens, "ignore_eos": True, **make(i)} for i in range(bs)]
        res = {}
        for eng in [e for rep in range(args.repeats + 1) for e in ((spec, plain) if rep % 2 else (plain, spec))]:
            list(eng.generate(reqs[:1]))
            c0 = calls[0]
            t = time.process_time()
            out = sorted((r.id, r.token_ids) for r in eng.generate(reqs))
            wall = time.process_time() - t
            steps = eng.stats.steps
            r = res.setdefault(eng is spec, {"host": [], "out": out, "steps": steps})
            r["host"].append(1e6 * wall / steps)
            if eng is spec:
                r["calls"] = calls[0] - c0
                r["verify"] = eng.stats.verify_steps
                r["ahead"] = eng.stats.to_json().get("fast_path_steps")
            else:
                r["ahead"] = eng.stats.to_json().get("fast_path_steps")
        s, p = res[True], res[False]
        for eng, r in ((spec, s), (plain, p)):
            prof = cProfile.Profile()
            prof.enable()
            list(eng.generate(reqs))
            prof.disable()
            r["calls_per_step"] = sum(v[1] for v in pstats.Stats(prof).stats.values()) / eng.stats.steps
        hs, hp = min(s["host"]), min(p["host"])  # the least disturbed run
        print(f"{name:12s} bs {bs:3d}: host us/step plain {hp:7.1f}  speculative {hs:7.1f}  (+{hs - hp:6.1f}, "
              f"{100 * (hs - hp) / hp:+.1f}%)  steps {p['steps']}/{s['steps']}  fast-path {p['ahead']}/{s['ahead']}  "
              f"verify {s['verify']}  propose calls {s['calls']}  Python calls/step {p['calls_per_step']:.0f}/"
              f"{s['calls_per_step']:.0f}", flush=True)
