"""Combinations of engine features, each tested alone elsewhere, against the README's promises:
speculative decoding gives the plain tokens (with n > 1, stop strings and ids, min_tokens,
logit_bias, logprobs, max_tokens 1, ignore_eos), `n` completions with seed s are the requests
with seeds completion_seed(s, 0), completion_seed(s, 1), ... (under preemption, with processors,
at block boundaries), a crowd gives
each request its tokens alone, and `--resume` after an interrupt completes the same file.
(The twelfth session's adversarial pass over combinations found no defect here; these keep it so.)"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from trtgraph.runtime.serving.requests import completion_seed

ROOT = Path(__file__).resolve().parents[1]
P = "one two three four " * 5


@pytest.fixture(scope="module")
def arts(tmp_path_factory, one_torch_thread):
    """Plain (large cache), and speculative over a 20-block cache (preemption)."""
    from trtgraph.compiler.pipeline import capture

    out = {}
    for name, changes in (("plain", {}),
                          ("spec_small", {"speculative": {"draft_len": 3, "ngram_min": 1, "ngram_max": 3},
                                          "kv_cache": {"num_blocks": 20}}),
                          ("small", {"kv_cache": {"num_blocks": 20}})):
        out[name] = tmp_path_factory.mktemp(name)
        capture(tiny_config(**changes), out[name])
    return out


@pytest.fixture(scope="module")
def engines(arts):
    from trtgraph.runtime.serving.engine import Engine

    return {"ref": Engine(arts["plain"]), "spec": Engine(arts["spec_small"]),
            "nospec": Engine(arts["spec_small"], speculative=False), "small": Engine(arts["small"])}


def _key(r):
    if r.choices:
        return [(c.token_ids, c.finish_reason, c.text, [e["token_id"] for e in c.logprobs or []]) for c in r.choices]
    return (r.token_ids, r.finish_reason, r.text, r.error, [e["token_id"] for e in r.logprobs or []])


def _alone(engine, req):
    return _key(list(engine.generate([req]))[0])


def _separate(engine, req):
    """Request `req` (n > 1) as n requests with seeds completion_seed(seed, j): their keys in index order."""
    reqs = [dict(req, id=f"{req['id']}-{j}", n=1, seed=completion_seed(req["seed"], j)) for j in range(req["n"])]
    got = {r.id: r for r in engine.generate(reqs)}
    return [(lambda k: k[:3] + (k[4],))(_key(got[r["id"]])) for r in reqs]


def test_speculative_with_processors_stops_and_n_gives_the_plain_tokens_in_a_crowd(engines):
    reqs = [dict(prompt=P, max_tokens=30, n=3, temperature=0.8, seed=5, stop=["thr"], logprobs=2),
            dict(prompt=P, max_tokens=30, stop=[248], min_tokens=7, logit_bias={"76": 2}),
            dict(prompt=P, max_tokens=30, stop=["two th", 76], min_tokens=3, ignore_eos=True, logprobs=0),
            dict(prompt=P, max_tokens=1, n=4, temperature=0.9, seed=3),
            dict(prompt=P[4:], max_tokens=40, temperature=0.5, seed=9, top_k=5, min_p=0.05),
            dict(prompt="abcabcabcabcabc", max_tokens=60, stop=[97], min_tokens=20)]
    reqs = [dict(r, id=f"r{i}") for i, r in enumerate(reqs)]
    spec = {r.id: _key(r) for r in engines["spec"].generate(reqs)}
    assert engines["spec"].stats.to_json()["speculative"]["verify_steps"] > 0
    plain = {r.id: _key(r) for r in engines["nospec"].generate(reqs)}
    for r in reqs:
        assert spec[r["id"]] == plain[r["id"]] == _alone(engines["ref"], r), r


@pytest.mark.parametrize("which", ["spec", "small"])
def test_n_completions_under_preemption_are_the_separately_seeded_requests(engines, which):
    eng = engines[which]
    n_req = dict(id="n", prompt=P, max_tokens=60, n=4, temperature=0.9, seed=7, top_k=20, logit_bias={"32": -100},
                 stop=["zzz"], logprobs=1)
    crowd = [dict(id=f"c{i}", prompt=P + str(i) * 40, max_tokens=100, temperature=0.8, seed=i) for i in range(3)]
    if which == "small":  # penalties: refused with speculative decoding, as documented
        crowd.append(dict(id="pen", prompt=P, max_tokens=60, temperature=0.9, seed=3, repetition_penalty=1.3,
                          presence_penalty=0.5, frequency_penalty=0.4))
    got = {r.id: r for r in eng.generate([n_req] + crowd)}
    assert eng.stats.preemptions > 0
    assert _key(got["n"]) == _separate(engines["ref"], n_req)
    for c in crowd:
        assert _key(got[c["id"]]) == _alone(engines["ref"], c), c["id"]
    assert eng.scheduler.allocator.num_free == eng.scheduler.allocator.num_blocks - 1, "KV blocks leaked"


@pytest.mark.parametrize("length", [1, 16, 17, 64, 65, 240])
def test_n_at_block_and_chunk_boundaries_with_processors_and_speculation(engines, length):
    rng = random.Random(length)
    ids = [rng.randrange(320) for _ in range(length)]
    mt = min(16, 256 - length)  # 240 + 16: exactly max_seq_len
    req = dict(id="n", prompt_token_ids=ids, max_tokens=mt, n=4, seed=100 + length, temperature=0.7,
               logit_bias={"7": 4}, min_tokens=3, stop=[7, 9, "a"])
    crowd = [dict(id=f"c{i}", prompt_token_ids=ids[:max(1, length - i)], max_tokens=mt, temperature=0.9, seed=i)
             for i in range(3)]
    want = _separate(engines["ref"], req)
    for which in ("spec", "small"):
        got = {r.id: r for r in engines[which].generate([req] + crowd)}
        assert _key(got["n"]) == want, which


def test_resume_after_sigterm_on_a_speculative_preempting_run_completes_the_same_file(arts, tmp_path):
    rng = random.Random(9)
    lines = []
    for i in range(40):
        r = dict(id=f"r{i}", prompt=P[i % 13:] + str(i), max_tokens=rng.randint(20, 80),
                 temperature=rng.choice([0, 0.8]), seed=i)
        if i % 5 == 0:
            r["n"] = 3
        if i % 7 == 0:
            r["stop"] = ["thr", 76]
        lines.append(r)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in lines))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "trtgraph", "run", "--prompts", str(prompts), "--manifest", str(arts["spec_small"])]
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    subprocess.run(cmd + ["--output", str(full)], check=True, capture_output=True, env=env, timeout=300)
    proc = subprocess.Popen(cmd + ["--output", str(part)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if part.exists() and len(part.read_text().splitlines()) >= 5:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]  # really interrupted mid-run
    subprocess.run(cmd + ["--output", str(part), "--resume"], check=True, capture_output=True, env=env, timeout=300)

    def tokens(path):
        out = {}
        for d in map(json.loads, path.read_text().splitlines()):
            assert d["id"] not in out, f"{d['id']} written twice"
            out[d["id"]] = [c["token_ids"] for c in d["choices"]] if "choices" in d else d["token_ids"]
        return out

    assert tokens(part) == tokens(full)
