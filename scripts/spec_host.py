"""Host time per step of the speculative engine against the plain one, on the CPU (static
backend, a tiny synthetic model whose `execute` is replaced by a draw of random tokens, so
that the loop's CPU time is the host's: packing, scheduling, the policy, proposals, read-back;
process time, not wall time: other processes on a shared machine do not count).
Drafts never match (the tokens are random, none is accepted). The speculative engine's policy
gets replay times (each verify key 1.5x its plain key) and measures wall times, as on CUDA.
Usage: python scripts/spec_host.py OUT_DIR [--batches 1,8,64] [--tokens 64] [--repeats 3] [--phases] [--policy N=V,...]
(prints one line per cell: host us/step plain, speculative, the difference, the rows proposed for, the
host us/step of the probes that did not draft (wall clock, the policy's `probe_seconds`), and
Python function calls per step of each engine, counted by cProfile in one more run: a figure
that the machine's load does not move; then, of the least disturbed speculative run: its probes,
those that hope called, their host time's share of the run's wall time (with --walls also of its
steps at the GPU's plain step time: the share on the GPU), and the step of its first draft
decision). --policy N=V,...: the speculation policy's constants for the run, as spec_bench.py's."""

import argparse
import os
import cProfile
import pstats
import random
import time
from pathlib import Path

import torch

from trtgraph.compiler.pipeline import capture
from trtgraph.config import Config
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.requests import parse_request

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--batches", default="1,8,64")
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--workloads", default="never-match", help="never-match, copy (comma-separated)")
ap.add_argument("--noise", type=float, default=0.0, help="copy: each drawn token is a random one of the cycle's with "
                "this probability (drafts partly accepted, no draft paying: a regime of spec_bench's repetitive and "
                "code-like sets, where the policy's hopeful probes show)")
ap.add_argument("--always", action="store_true", help="no replay times: the speculative engine drafts at every match")
ap.add_argument("--profile", type=int, default=0, help="print the N costliest functions of the speculative run (cumulative)")
ap.add_argument("--phases", action="store_true", help="µs per step by phase (forming, packing, model, read-back, "
                "postprocess, outputs, the rest), best of --repeats runs per engine")
ap.add_argument("--plan", default="default", choices=("default", "spec-bench"),
                help="spec-bench: spec_bench.py's prefill shape (1 or 2 prompts a step, chunks of 64 and 256)")
ap.add_argument("--walls", help="a spec_bench.json: the speculative policy decides with its measured wall and replay "
                "times, frozen (the probes' cost and the episodes are timed on this CPU); prints the steps each engine "
                "ran by kind")
ap.add_argument("--policy", help="NAME=VALUE,...: constants of the speculation policy (speculation.py) for the run, as "
                "spec_bench.py's --policy (e.g. PROBE_BUDGET=0: hope-called probes not bounded by the probe budget)")
args = ap.parse_args()
if args.policy:
    from trtgraph.runtime.serving.speculation import set_constant
    for item in args.policy.split(","):
        name, _, value = item.partition("=")
        try:
            set_constant(name, value)
        except ValueError as e:
            ap.error(f"--policy: {e}")
batches = [int(b) for b in args.batches.split(",")]
torch.set_num_threads(1)

d = Config.default().to_dict()
d["device"] = "cpu"
d["limits"] = {"max_batch_size": max(batches), "max_seq_len": 256, "max_num_tokens": 512}
d["kv_cache"] = {**d.get("kv_cache", {}), "num_blocks": max(batches) * 16 + 8}
d["buckets"] = {**d["buckets"], "chunk_sizes": [64]}
if args.plan == "spec-bench":  # as scripts/spec_bench.py: prompts of 71-74 tokens take two chunks, two rows a step
    d["buckets"] = {**d["buckets"], "context_batch_sizes": [1, 2], "chunk_sizes": [64, 256], "sampling": ["greedy"]}
d["speculative"] = {"method": "ngram", "draft_len": 4, "ngram_min": 1, "ngram_max": 3}
art = Path(args.out) / f"artifacts-{args.plan}"
if not (art / "manifest.json").exists():
    capture(Config.from_dict(d, source="spec_host"), art)
spec, plain = Engine(art), Engine(art, speculative=False)
vocab = spec.executor.loaded.config.vocab_size
pol = spec.scheduler.speculation
pol.replay_ms = {k: (1.5 if k.draft_len else 1.0) for k in spec.manifest.graph_keys if not k.is_prefill}
pol.measure = True
if args.always:
    pol.replay_ms = {}
if args.walls:
    import json
    measured = json.loads(Path(args.walls).read_text())["policy"]
    by_name = {str(k): k for k in spec.manifest.graph_keys}
    pol.replay_ms = {by_name[n]: ms for n, ms in measured["replay_ms"].items() if n in by_name}
    pol.wall_ms = {by_name[n]: ms for n, ms in measured["wall_ms"].items() if n in by_name}
    pol.record = lambda *a, **kw: None  # the walls stay the GPU's; the probes' own cost and episodes are timed here
calls = [0]  # rows proposed for (propose_many's rows where the drafter has it, else propose calls)
if hasattr(spec.drafter, "propose_many"):
    many = spec.drafter.propose_many
    spec.drafter.propose_many = lambda ids, *a, **kw: calls.__setitem__(0, calls[0] + len(ids)) or many(ids, *a, **kw)
else:
    propose = spec.drafter.propose
    spec.drafter.propose = lambda *a, **kw: calls.__setitem__(0, calls[0] + 1) or propose(*a, **kw)
from trtgraph.runtime.step.executor import StepOutputs

gen = torch.Generator().manual_seed(0)
rows = spec.executor.buffers.max_rows
accepted = torch.zeros(spec.executor.buffers.max_seqs, dtype=torch.int64)


# The copy workload: a model that continues a cycle of CYCLE distinct tokens; with --plan spec-bench a cycle
# of 7 in prompts of 71 tokens, as spec_bench.py's copy lines ("d['key'] = value\n" ten times over: 71 tokens).
CYCLE = 7 if args.plan == "spec-bench" else 37
PROMPT = 71 if args.plan == "spec-bench" else 2 * CYCLE
succ = torch.arange(512)
succ[3:3 + CYCLE] = torch.roll(torch.arange(3, 3 + CYCLE), -1)
mode = {"copy": False}


def fake_execute(key, eager=False, ex=None):
    """The model's step, replaced. never-match: random tokens, no draft accepted. copy: each
    token's successor in the cycle (the inputs as the graph would see them: the packed ones on
    the full path, the last step's tokens on the fast path), drafts verified as the graph does."""
    if not mode["copy"]:
        return StepOutputs(None, torch.randint(3, 300, (rows,), generator=gen), accepted)
    b, T, B, q = ex.buffers, key.num_tokens, key.batch_size, key.q_len
    if ex._fake_fresh:
        ids = torch.from_numpy(b.host.input_ids[:T].copy())
        src = torch.from_numpy(b.host.gather_src[:B].copy())
        if not key.is_prefill and (src >= 0).any():
            ids[:B] = torch.where(src >= 0, b.next_tokens[src.clamp(min=0)], ids[:B])
    else:  # the fast path: the last step's drawn tokens
        ids = b.next_tokens[:T].clone()
    ex._fake_fresh = False
    last = torch.from_numpy(b.host.logits_indices[:B].copy()) if key.is_prefill else None
    toks = succ[ids.clamp(0, 511)]
    if args.noise:
        toks = torch.where(torch.rand(toks.shape, generator=gen) < args.noise,
                           torch.randint(3, 3 + CYCLE, toks.shape, generator=gen), toks)
    if key.is_prefill:
        toks = toks[last]
    b.next_tokens[:len(toks)] = toks
    if key.draft_len:
        match = ids.view(B, q)[:, 1:] == toks.view(B, q)[:, :-1]
        b.accepted[:B] = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return StepOutputs(None, b.next_tokens, b.accepted)


def fresh(method, ex):
    def call(*a, **kw):
        ex._fake_fresh = method.__name__ == "prepare"
        return method(*a, **kw)
    return call


for eng in (spec, plain):
    ex = eng.executor
    ex._fake_fresh = True
    ex.prepare, ex.advance_decode = fresh(ex.prepare, ex), fresh(ex.advance_decode, ex)
    ex.execute = lambda key, eager=False, ex=ex: fake_execute(key, eager, ex)
PHASES = {"forming": [], "packing": [], "model": [], "read-back": [], "postprocess": [], "outputs": []}


def timed_phases(eng):
    """Wrap the engine's methods of each phase (none nested in another) with a process-time
    clock; the returned dict is the phase -> seconds of the runs since the last reset."""
    spent = dict.fromkeys(PHASES, 0.0)
    sched, launcher = eng.scheduler, eng.launcher

    def wrap(obj, name, phase):
        method = getattr(obj, name)

        def call(*a, **kw):
            t = time.process_time()
            try:
                return method(*a, **kw)
            finally:
                spent[phase] += time.process_time() - t
        setattr(obj, name, call)
    for name in ("schedule", "extend_decode", "form_ahead"):
        wrap(sched, name, "forming")
    wrap(launcher, "_prepare", "packing")
    wrap(eng.executor, "execute", "model")
    wrap(launcher, "wait", "read-back")
    wrap(sched, "postprocess", "postprocess")
    wrap(eng, "_news", "outputs")
    return spent


first = [None]  # the step (engine's count) at the timed run's first draft decision
decide = pol.decide


def noting(*a, **kw):
    out = decide(*a, **kw)
    if out and first[0] is None:
        first[0] = spec.stats.steps
    return out


pol.decide = noting
phase_clock = {id(e): timed_phases(e) for e in (spec, plain)} if args.phases else {}
rng = random.Random(0)
workloads = {"never-match": lambda i: {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(32)]},
             "copy": lambda i: {"prompt_token_ids": [3 + (i + j) % CYCLE for j in range(PROMPT)]}}
for name in args.workloads.split(","):
    make = workloads[name]
    mode["copy"] = name == "copy"
    for bs in batches:
        reqs = [parse_request({"id": f"{name}-{i}", "max_tokens": args.tokens, "ignore_eos": True, **make(i)}, "spec_host",
                              vocab) for i in range(bs)]  # parsed once: the runs time the steps, not the parsing
        res = {}
        for eng in [e for rep in range(args.repeats + 1) for e in ((spec, plain) if rep % 2 else (plain, spec))]:
            list(eng.generate(reqs[:1]))
            c0 = calls[0]
            spent = phase_clock.get(id(eng))
            if spent:
                spent.update(dict.fromkeys(spent, 0.0))
            p0, n0, h0, first[0] = pol.probe_seconds, pol.probes, pol.hope_probes, None
            t, w = time.process_time(), time.perf_counter()
            out = sorted((r.id, r.token_ids) for r in eng.generate(reqs))
            wall, wall_s = time.process_time() - t, time.perf_counter() - w
            steps = eng.stats.steps
            r = res.setdefault(eng is spec, {"host": [], "out": out, "steps": steps})
            if eng is spec and 1e6 * wall / steps < min(r["host"], default=float("inf")):  # the least disturbed run's
                r["probe_us"] = 1e6 * (pol.probe_seconds - p0) / steps  # probes (that did not draft), per step
                plain_ms = min((ms for k, ms in pol.wall_ms.items() if not k.draft_len and k.batch_size >= bs),
                               default=None) if args.walls else None  # (the GPU's step time: the run's time there)
                r["probing"] = (pol.probes - n0, pol.hope_probes - h0, (pol.probe_seconds - p0) / wall_s,
                                plain_ms and (pol.probe_seconds - p0) / (1e-3 * plain_ms * steps),
                                first[0])
            r["host"].append(1e6 * wall / steps)
            if spent and 1e6 * wall / steps <= min(r["host"]):  # the least disturbed run's phases
                r["phases"] = {k: 1e6 * v / steps for k, v in spent.items()}
                r["phases"]["rest"] = 1e6 * wall / steps - sum(r["phases"].values())
            st, keys = eng.stats, eng.stats.steps_per_key  # the steps by kind (the last timed run's)
            r["kinds"] = (sum(n for k, n in keys.items() if k.is_prefill), st.plain_decode_steps, st.verify_steps,
                          st.verify_rows, st.verify_tokens,
                          sum(n * k.batch_size for k, n in keys.items() if not k.is_prefill and not k.draft_len))
            if eng is spec:
                r["calls"] = calls[0] - c0
                r["verify"] = eng.stats.verify_steps
                r["ahead"] = eng.stats.to_json().get("fast_path_steps")
            else:
                r["ahead"] = eng.stats.to_json().get("fast_path_steps")
        s, p = res[True], res[False]
        pol.decide = decide  # (unwrapped: the calls per step are the engine's)
        for eng, r in ((spec, s), (plain, p)):
            prof = cProfile.Profile()
            prof.enable()
            list(eng.generate(reqs))
            prof.disable()
            r["calls_per_step"] = sum(v[1] for v in pstats.Stats(prof).stats.values()) / eng.stats.steps
            if eng is spec and args.profile:
                print(f"{name} bs {bs}: speculative, {eng.stats.steps} steps, {eng.stats.verify_steps} verify")
                pstats.Stats(prof).sort_stats(os.environ.get("SPEC_HOST_SORT", "tottime")).print_stats(args.profile)
        st = spec.stats.to_json().get("speculative") or {}
        pol.decide = noting
        hs, hp = min(s["host"]), min(p["host"])  # the least disturbed run
        print(f"{name:12s} bs {bs:3d}: host us/step plain {hp:7.1f}  speculative {hs:7.1f}  (+{hs - hp:6.1f}, "
              f"{100 * (hs - hp) / hp:+.1f}%)  steps {p['steps']}/{s['steps']}  fast-path {p['ahead']}/{s['ahead']}  "
              f"verify {s['verify']} accepted {st.get('acceptance_rate')}  rows proposed for {s['calls']}  probes' host us/step "
              f"{s['probe_us']:.1f}  Python calls/step {p['calls_per_step']:.0f}/"
              f"{s['calls_per_step']:.0f}", flush=True)
        n_probes, n_hope, share, gpu_share, at = s["probing"]
        print(f"    probes {n_probes} (hope-called {n_hope})  probes' share of the run's wall time {share:.4f}"
              + (f", of its steps at the --walls plain step's time {gpu_share:.4f}" if gpu_share else "") + "  "
              f"first draft decision at step {at}", flush=True)
        for label, r in (("plain", p), ("speculative", s)):  # the last timed run's steps, by kind
            pre, dec, ver, vrows, vtok, drows = r["kinds"]
            print(f"    {label:12s} steps: prefill {pre}  plain decode {dec}  verify {ver}"
                  + (f" (rows per verify step {vrows / ver:.1f}, tokens per row {vtok / max(vrows, 1):.2f})" if ver else "")
                  + f"  rows per plain decode step {drows / max(dec, 1):.1f} (keys' sizes)", flush=True)
        for label, r in (("plain", p), ("speculative", s)) if args.phases else ():
            print(f"    {label:12s} us/step: " + "  ".join(f"{k} {v:6.1f}" for k, v in r["phases"].items()), flush=True)
