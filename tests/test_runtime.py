"""Acceptance test of the replay-only runtime (trtgraph/runtime/serving/engine.py and friends).

A mix of prompts larger than max_batch_size, of every length from one token to several
prefill chunks, greedy and seeded sampled, served on a KV cache small enough to force
preemption: every request finishes, every output equals the one-sequence eager oracle and
the eager engine, seeded outputs do not depend on the batch, nothing is captured or run
eagerly after lock, no KV block leaks. Plus refusals, stop conditions and the LLM API.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

import trtgraph
from trtgraph.buckets import GREEDY, SAMPLED, BatchShape, GraphKey, select
from trtgraph.errors import BucketMissError, CaptureError, ReplayMismatchError
import oracle
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.requests import read_prompts
from trtgraph.runtime.serving.scheduler import Scheduler

MAX_SEQ_LEN = 256
RESULT_FIELDS = {"id", "text", "token_ids", "finish_reason", "error", "usage", "ttft_ms", "tpot_ms"}
TEXT = "The quick brown fox — jumps über the lazy dog ✓ 0123456789; ¿qué? naïve café 日本語. " * 4


def text_of_bytes(n: int) -> str:
    """Text whose UTF-8 encoding is close to (at most) n bytes, multi-byte characters included."""
    return TEXT.encode("utf-8")[:n].decode("utf-8", errors="ignore")


def byte_text(token_ids) -> str:
    """What the byte tokenizer decodes: bytes are ids < 256, others are skipped."""
    return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


# ---- the mix -----------------------------------------------------------------------------

# prompt length (tokens), max_tokens; the first four are short so a step uses chunk 16.
SHAPES = [(1, 1), (5, 60), (12, 8), (16, 33), (17, 2), (31, 45), (48, 17), (63, 60), (64, 5), (65, 24),
          (80, 60), (96, 12), (100, 40), (110, 3), (127, 55), (128, 30), (129, 9), (140, 60), (150, 48),
          (3, 20), (9, 1), (33, 36), (70, 60), (150, 14)]
SAMPLING = [(0.8, 0, 1.0), (1.3, 20, 1.0), (0.6, 0, 0.9), (1.0, 50, 0.8), (2.0, 5, 0.95), (0.9, 0, 0.5)]


def prompt_mix() -> list[dict]:
    lines = []
    for i, (length, max_tokens) in enumerate(SHAPES):
        req: dict = {"id": f"req-{i:02d}", "max_tokens": max_tokens}
        if i % 4 in (0, 1) and length > 1:
            req["prompt"] = text_of_bytes(length)
        else:
            req["prompt_token_ids"] = [(i * 37 + j * 11) % 320 for j in range(length)]  # ids >= 256 too
        if i % 2 == 1:
            temperature, top_k, top_p = SAMPLING[(i // 2) % len(SAMPLING)]
            req.update(temperature=temperature, top_k=top_k, top_p=top_p, seed=1000 + 17 * i)
        lines.append(req)
    return lines


def prompt_ids_of(req: dict) -> list[int]:
    return list(req["prompt"].encode("utf-8")) if "prompt" in req else list(req["prompt_token_ids"])


# ---- serving with a step bound and the scheduler in reach ------------------------------------

class _Bounds:
    """Wraps the engine's scheduler for one generate(), failing (not hanging) on a livelock:
    too many steps in a row in which no sequence drew a token, or too many steps overall."""
    max_steps = 5000
    max_steps_without_a_token = 200  # a 256-token prompt is 4 chunks; recomputing 8 of them is < 40

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.num_scheduled = self.steps_without_a_token = 0

    def _state(self) -> str:
        s = self.sched
        return (f"running {[(q.request.id, q.num_computed, len(q.all_ids)) for q in s.running]}, "
                f"{len(s.waiting)} waiting, {s.num_preemptions} preemptions so far")

    def schedule(self):
        self.num_scheduled += 1
        if self.num_scheduled > self.max_steps:
            raise AssertionError(f"the engine did not finish within {self.max_steps} steps: {self._state()}")
        return Scheduler.schedule(self.sched)

    def advance(self, step, tokens, accepted=None, now=None):
        drew = Scheduler.advance(self.sched, step, tokens, accepted, now)
        self.steps_without_a_token = 0 if drew else self.steps_without_a_token + 1
        if self.steps_without_a_token > self.max_steps_without_a_token:
            raise AssertionError(f"livelock: {self.steps_without_a_token} steps in a row drew no token: "
                                 f"{self._state()}")
        return drew


@dataclass
class Served:
    results: dict  # id -> Result
    order: list  # ids in the order generate() yielded them
    stats: object
    scheduler: Scheduler
    captures_before: int
    captures_after: int
    replays: Counter  # replays during this run, per key
    eager_steps: int


@contextmanager
def bounded_scheduler(engine: Engine):
    bounds = _Bounds(engine.scheduler)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.scheduler, "schedule", bounds.schedule)
        mp.setattr(engine.scheduler, "advance", bounds.advance)
        yield


def serve(engine: Engine, requests) -> Served:
    runner = engine.executor.runner
    captures, replays = runner.num_captures, Counter(runner.replays)
    with bounded_scheduler(engine):
        out = list(engine.generate(requests))
    order = [r.id for r in out]
    assert len(set(order)) == len(order), f"a request was answered twice: {order}"
    return Served({r.id: r for r in out}, order, engine.stats, engine.scheduler, captures,
                  runner.num_captures, Counter(runner.replays) - replays, engine.executor.num_eager_steps)


def oracle_tokens(engine: Engine, req: dict, **extra) -> list[int]:
    return oracle.generate(engine.executor.loaded, prompt_ids_of(req), req["max_tokens"],
                           temperature=req.get("temperature", 0.0), top_k=req.get("top_k", 0),
                           top_p=req.get("top_p", 1.0), seed=req.get("seed", 0), **extra)


@pytest.fixture(scope="module")
def mix_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mix") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in prompt_mix()), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def replay_engine(small_kv_artifacts):
    return Engine(small_kv_artifacts)


@pytest.fixture(scope="module")
def crowd(replay_engine, mix_file):
    requests = read_prompts(mix_file, replay_engine.executor.loaded.config.vocab_size)
    assert len(requests) == len(SHAPES) > replay_engine.config.limits.max_batch_size
    return serve(replay_engine, requests)


@pytest.fixture(scope="module")
def eager_crowd(small_kv_artifacts, mix_file):
    engine = Engine(small_kv_artifacts, eager=True)
    return serve(engine, read_prompts(mix_file))


@pytest.fixture(scope="module")
def oracle_outputs(replay_engine):
    return {r["id"]: oracle_tokens(replay_engine, r) for r in prompt_mix()}


# ---- the mix: everything finishes, equals the oracle and eager ---------------------------------

def test_every_request_of_the_mix_finishes_with_max_tokens(crowd):
    mix = prompt_mix()
    assert sorted(crowd.results) == sorted(r["id"] for r in mix)
    for req in mix:
        res = crowd.results[req["id"]]
        assert res.error is None and res.finish_reason == "length", (req["id"], res.finish_reason, res.error)
        assert len(res.token_ids) == req["max_tokens"]
        assert res.prompt_tokens == len(prompt_ids_of(req))
        assert res.text == byte_text(res.token_ids)
    assert crowd.stats.refused == 0
    assert crowd.stats.completion_tokens == sum(m for _, m in SHAPES)
    assert crowd.stats.prompt_tokens == sum(len(prompt_ids_of(r)) for r in mix)


def test_the_mix_forces_preemption_and_both_chunk_sizes(crowd):
    assert crowd.stats.preemptions > 0
    assert crowd.scheduler.num_preemptions == crowd.stats.preemptions
    keys = set(crowd.stats.steps_per_key)
    assert {k.chunk_size for k in keys if k.is_prefill} == {16, 64}
    assert {k.sampling for k in keys} == {GREEDY, SAMPLED}
    assert GraphKey(8, 0, 0, GREEDY) in keys or GraphKey(8, 0, 0, SAMPLED) in keys  # a full decode batch
    assert sum(crowd.stats.steps_per_key.values()) == crowd.stats.steps


def test_prompt_text_is_tokenized_as_utf8_bytes(replay_engine):
    for req in prompt_mix():
        if "prompt" in req:
            assert replay_engine.tokenizer.encode(req["prompt"]) == list(req["prompt"].encode("utf-8"))
    assert any(len(r["prompt"]) < len(r["prompt"].encode()) for r in prompt_mix() if "prompt" in r)


def test_greedy_outputs_equal_the_oracle(crowd, oracle_outputs):
    greedy = [r for r in prompt_mix() if r.get("temperature", 0.0) == 0.0]
    assert len(greedy) >= 10
    for req in greedy:
        assert crowd.results[req["id"]].token_ids == oracle_outputs[req["id"]], req["id"]


def test_seeded_sampled_outputs_equal_the_oracle(crowd, oracle_outputs):
    sampled = [r for r in prompt_mix() if r.get("temperature", 0.0) > 0]
    assert len(sampled) >= 10
    for req in sampled:
        assert crowd.results[req["id"]].token_ids == oracle_outputs[req["id"]], req["id"]


def test_sampling_differs_from_greedy_for_some_request(replay_engine, oracle_outputs):
    """Otherwise the sampled equality above would say nothing about the sampler."""
    sampled = [r for r in prompt_mix() if r.get("temperature", 0.0) > 0 and r["max_tokens"] >= 20]
    assert any(oracle_outputs[r["id"]] != oracle_tokens(replay_engine, {**r, "temperature": 0.0})
               for r in sampled)


def test_replay_equals_eager_engine(crowd, eager_crowd):
    assert sorted(eager_crowd.results) == sorted(crowd.results)
    for rid, res in crowd.results.items():
        assert eager_crowd.results[rid].token_ids == res.token_ids, rid
        assert eager_crowd.results[rid].finish_reason == res.finish_reason
    # the eager engine really ran eagerly, and replayed nothing
    assert eager_crowd.eager_steps == eager_crowd.stats.steps > 0
    assert sum(eager_crowd.replays.values()) == 0


def test_seeded_request_is_the_same_alone_and_in_the_crowd(replay_engine, crowd, mix_file):
    seeded = [r for r in read_prompts(mix_file) if r.temperature > 0 and r.seed is not None]
    assert len(seeded) >= 10
    for req in seeded:
        alone = serve(replay_engine, [req])
        assert alone.stats.steps > 0 and alone.stats.preemptions == 0
        assert alone.results[req.id].token_ids == crowd.results[req.id].token_ids, req.id
        assert alone.captures_after == alone.captures_before
        assert alone.scheduler.allocator.num_free == replay_engine.executor.num_blocks - 1


def test_nothing_is_captured_or_run_eagerly_after_lock(replay_engine, crowd):
    runner = replay_engine.executor.runner
    assert runner.locked
    assert crowd.captures_after == crowd.captures_before == len(replay_engine.manifest.graph_keys)
    assert crowd.eager_steps == 0
    assert sum(crowd.replays.values()) == crowd.stats.steps > 0
    assert crowd.replays == crowd.stats.steps_per_key
    with pytest.raises(CaptureError, match="after lock"):
        replay_engine.executor.capture(replay_engine.manifest.graph_keys[0])
    assert runner.num_captures == crowd.captures_before


def test_no_kv_block_leaks_after_generate(replay_engine, crowd):
    sched = crowd.scheduler
    assert sched.allocator.num_blocks == replay_engine.executor.num_blocks == 20
    assert not sched.has_work and not sched.running and not sched.waiting
    assert sched.allocator.num_free == replay_engine.executor.num_blocks - 1


def test_steady_decoding_takes_the_fast_path(crowd, oracle_outputs):
    stats = crowd.stats
    decode_steps = sum(n for k, n in stats.steps_per_key.items() if not k.is_prefill)
    assert 0 < stats.fast_path_steps <= decode_steps
    assert all(crowd.results[rid].token_ids == toks for rid, toks in oracle_outputs.items())


def test_padding_accounting(crowd):
    s = crowd.stats
    assert s.real_tokens <= s.padded_tokens
    assert s.padded_tokens == sum(k.num_tokens * n for k, n in s.steps_per_key.items())
    assert 0.0 <= s.padding_waste < 1.0


def test_long_prompts_arriving_while_others_decode_on_a_tight_cache_finish(replay_engine):
    """Prompts of 1..139 tokens with growing max_tokens on 19 usable blocks: sequences
    mid-way through a chunked prefill compete for blocks. Each must still finish with the
    oracle's tokens (no livelock of prefills preempting each other)."""
    reqs = [{"id": f"t{i}", "prompt_token_ids": [(i * 7 + j) % 256 for j in range(1 + 6 * i)],
             "max_tokens": 1 + 2 * i} for i in range(24)]
    served = serve(replay_engine, reqs)
    assert served.stats.preemptions > 0
    for req in reqs:
        r = served.results[req["id"]]
        assert r.finish_reason == "length" and r.token_ids == oracle_tokens(replay_engine, req), req["id"]
    assert served.scheduler.allocator.num_free == replay_engine.executor.num_blocks - 1


# ---- bucket misses and replay mismatches ------------------------------------------------------

def test_select_outside_the_recorded_keys_names_the_nearest(replay_engine):
    plan = replay_engine.manifest.plan()
    assert select(plan, BatchShape(3)) == GraphKey(4)  # a batch that fits takes the smallest key
    with pytest.raises(BucketMissError) as exc:
        select(plan, BatchShape(9))
    msg = str(exc.value)
    assert "batch of 9" in msg and "nearest recorded keys" in msg and str(GraphKey(8)) in msg
    with pytest.raises(BucketMissError) as exc:
        select(plan, BatchShape(5, chunk_size=64))
    assert str(GraphKey(4, 0, 64)) in str(exc.value)
    with pytest.raises(BucketMissError) as exc:
        select(plan, BatchShape(1, chunk_size=32, sampling=SAMPLED))
    msg = str(exc.value)
    assert "chunk=32" in msg and ("chunk=16" in msg or "chunk=64" in msg)


def test_select_sampled_batch_in_a_greedy_only_plan_misses(greedy_only_artifacts):
    from trtgraph.artifacts import load_manifest

    plan = load_manifest(greedy_only_artifacts).plan()
    assert select(plan, BatchShape(2)) == GraphKey(2)
    with pytest.raises(BucketMissError, match="nearest recorded keys"):
        select(plan, BatchShape(2, sampling=SAMPLED))


def test_runner_replay_of_an_unrecorded_key_raises(replay_engine):
    ex = replay_engine.executor
    key, known = GraphKey(3), GraphKey(4)
    with pytest.raises(ReplayMismatchError, match="no graph was recorded") as exc:
        ex.runner.replay(key, ex.metadata[known], key.num_tokens, ex.buffers.dev.positions[:key.num_tokens])
    assert str(known) in str(exc.value)  # lists the recorded keys
    with pytest.raises(ReplayMismatchError, match="different object"):
        ex.runner.replay(known, ex.metadata[GraphKey(2)], known.num_tokens,
                         ex.buffers.dev.positions[:known.num_tokens])


@pytest.mark.parametrize("eager", [False, True], ids=["replay", "eager"])
@pytest.mark.parametrize("key", [GraphKey(3), GraphKey(16), GraphKey(2, 0, 32), GraphKey(9, 0, 16)],
                         ids=str)
def test_execute_of_an_unrecorded_key_raises_replay_mismatch(replay_engine, key, eager):
    ex = replay_engine.executor
    assert key not in replay_engine.manifest.capture_order  # never recorded
    replays, eager_steps = sum(ex.runner.replays.values()), ex.num_eager_steps
    with pytest.raises(ReplayMismatchError) as exc:
        ex.execute(key, eager=eager)
    assert str(key) in str(exc.value)
    assert sum(ex.runner.replays.values()) == replays and ex.num_eager_steps == eager_steps


# ---- per-request refusals ---------------------------------------------------------------------

def test_greedy_only_manifest_refuses_sampled_requests_per_request(greedy_only_artifacts):
    engine = Engine(greedy_only_artifacts)
    reqs = [
        {"id": "g1", "prompt": "Hello there", "max_tokens": 12},
        {"id": "s1", "prompt": "Hello there", "max_tokens": 12, "temperature": 0.7, "seed": 1},
        {"id": "g2", "prompt_token_ids": list(range(40, 110)), "max_tokens": 20},
        {"id": "long", "prompt_token_ids": [7] * 200, "max_tokens": 100},
        {"id": "g3", "prompt_token_ids": [9] * 200, "max_tokens": 56},  # exactly max_seq_len: fine
    ]
    served = serve(engine, reqs)
    res = served.results
    assert set(res) == {r["id"] for r in reqs}
    assert res["s1"].finish_reason == "error" and "greedy" in res["s1"].error and res["s1"].token_ids == []
    assert res["long"].finish_reason == "error" and "max_seq_len" in res["long"].error
    assert str(MAX_SEQ_LEN) in res["long"].error and "300" in res["long"].error
    assert served.order[:2] == ["s1", "long"]  # refusals come back first
    assert served.stats.refused == 2
    for req in reqs:
        if req["id"].startswith("g"):
            r = res[req["id"]]
            assert r.error is None and r.finish_reason == "length"
            assert r.token_ids == oracle_tokens(engine, req)
    assert served.scheduler.allocator.num_free == engine.executor.num_blocks - 1


def test_over_length_request_is_refused_on_a_full_manifest_too(default_engine):
    served = serve(default_engine, [{"id": "x", "prompt": "a" * 250, "max_tokens": 7, "temperature": 1.0},
                                    {"id": "ok", "prompt": "a" * 250, "max_tokens": 6}])
    assert served.results["x"].finish_reason == "error"
    assert "max_seq_len (256)" in served.results["x"].error and "257" in served.results["x"].error
    assert served.results["ok"].finish_reason == "length" and len(served.results["ok"].token_ids) == 6


# ---- stop conditions, usage, timings ----------------------------------------------------------

@pytest.fixture(scope="module")
def default_engine(default_artifacts):
    return Engine(default_artifacts)


@pytest.fixture(scope="module")
def stop_case(default_engine):
    """A prompt whose greedy output has a first-time token and a first-time ASCII byte
    mid-way: the stop token and the stop string."""
    for i in range(40):
        req = {"id": "probe", "prompt": f"stop conditions, attempt {i}: ", "max_tokens": 40}
        out = oracle_tokens(default_engine, req)
        tok = next((j for j in range(5, 30) if out[j] not in out[:j]), None)
        ch = next((j for j in range(3, 30) if 32 <= out[j] < 127 and out[j] not in out[:j]), None)
        if tok is not None and ch is not None:
            return req, out, tok, ch
    pytest.fail("no prompt gives a usable stop token / stop string")


def test_stop_conditions_usage_and_timings(default_engine, stop_case):
    base, out, j_tok, j_chr = stop_case
    stop_char = chr(out[j_chr])
    reqs = [
        {**base, "id": "stop-token", "stop": out[j_tok]},
        {**base, "id": "stop-token-list", "stop": [319, out[j_tok]]},
        {**base, "id": "stop-string", "stop": [stop_char, "never-appears\u2603"]},
        {**base, "id": "length", "max_tokens": 7},
        {**base, "id": "one", "max_tokens": 1},
        {**base, "id": "no-hit", "stop": ["never-appears\u2603"], "max_tokens": 25},
    ]
    served = serve(default_engine, reqs)
    res = served.results
    prompt_len = len(base["prompt"].encode())

    for rid in ("stop-token", "stop-token-list"):
        r = res[rid]
        assert r.finish_reason == "stop", rid
        assert r.token_ids == out[:j_tok + 1] and r.token_ids[-1] == out[j_tok]
    r = res["stop-string"]
    assert r.finish_reason == "stop"
    assert r.token_ids == out[:j_chr + 1]
    assert r.text == byte_text(out[:j_chr]) and stop_char not in r.text
    assert res["length"].finish_reason == "length" and res["length"].token_ids == out[:7]
    assert res["one"].finish_reason == "length" and res["one"].token_ids == out[:1]
    assert res["no-hit"].finish_reason == "length" and res["no-hit"].token_ids == out[:25]
    assert res["no-hit"].text == byte_text(out[:25])

    total_ms = served.stats.seconds * 1e3
    for rid, r in res.items():
        body = r.to_json()
        assert set(body) == RESULT_FIELDS
        assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(r.token_ids)}
        assert isinstance(r.ttft_ms, float) and 0.0 <= r.ttft_ms <= total_ms + 1e-6, rid
        if len(r.token_ids) > 1:
            assert isinstance(r.tpot_ms, float) and r.tpot_ms >= 0.0 and math.isfinite(r.tpot_ms), rid
        else:
            assert r.tpot_ms is None
    assert served.stats.completion_tokens == sum(len(r.token_ids) for r in res.values())
    assert served.scheduler.allocator.num_free == default_engine.executor.num_blocks - 1


# ---- the Python API ---------------------------------------------------------------------------

def test_llm_generate_returns_results_in_input_order(default_artifacts):
    llm = trtgraph.LLM(default_artifacts)
    reqs = [
        {"id": "slow", "prompt": "first in, last out", "max_tokens": 40},
        {"id": 7, "prompt_token_ids": [1, 2, 3], "max_tokens": 2},
        {"id": "refused", "prompt_token_ids": [5] * 250, "max_tokens": 50},
        {"id": "sampled", "prompt": "¿qué?", "max_tokens": 9, "temperature": 0.9, "top_p": 0.9, "seed": 5},
    ]
    streamed = [d.id for d in llm.stream(reqs) if d.finished]
    assert streamed != ["slow", "7", "refused", "sampled"]  # they finish out of order ...
    out = [c.to_json() for c in llm.generate(reqs)]
    assert [r["id"] for r in out] == ["slow", "7", "refused", "sampled"]  # ... but come back in order
    for r in out:
        assert set(r) == RESULT_FIELDS
        assert set(r["usage"]) == {"prompt_tokens", "completion_tokens"}
        assert r["usage"]["completion_tokens"] == len(r["token_ids"])
    assert [r["finish_reason"] for r in out] == ["length", "length", "error", "length"]
    assert len(out[0]["token_ids"]) == 40 and len(out[1]["token_ids"]) == 2 and len(out[3]["token_ids"]) == 9
    assert out[0]["usage"]["prompt_tokens"] == len("first in, last out")
    assert out[3]["usage"]["prompt_tokens"] == len("¿qué?".encode())
    assert "max_seq_len" in out[2]["error"] and out[2]["token_ids"] == []
    assert out[0]["token_ids"] == oracle.generate(llm.engine.executor.loaded, list(b"first in, last out"), 40)
    assert out[0]["text"] == byte_text(out[0]["token_ids"])
    json.dumps(out)  # JSON-serialisable as the JSONL is
    assert llm.stats["requests"] == 4 and llm.stats["refused"] == 1


def test_duplicate_ids_in_one_generate_call_are_refused(default_artifacts):
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.llm import LLM

    llm = LLM(default_artifacts)
    with pytest.raises(PromptError, match="duplicate id 'a'"):
        llm.generate([{"id": "a", "prompt": "one", "max_tokens": 3}, {"id": "a", "prompt": "two", "max_tokens": 5}])
    with pytest.raises(PromptError, match="duplicate id '1'"):
        llm.generate([{"id": 1, "prompt": "one", "max_tokens": 3}, {"id": "1", "prompt": "two", "max_tokens": 5}])


def test_subnormal_temperature_acts_like_a_tiny_one_not_noise():
    from trtgraph.kernels import sampler_reference as sampler

    logits = torch.randn((4, 300), generator=torch.Generator().manual_seed(0))
    for temp in (1e-40, 1e-45, 1e-7):
        t = torch.full((4,), temp)
        got = sampler.sample(logits, t, torch.zeros(4, dtype=torch.int64), torch.ones(4),
                             torch.arange(4), torch.full((4,), 3))
        assert torch.equal(got, logits.argmax(-1)), temp
