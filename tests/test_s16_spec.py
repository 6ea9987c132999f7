"""A speculative engine whose batch does not draft costs what the plain engine costs (the
sixteenth session's performance pass): its plain fast-path steps make a constant few more
Python calls than the plain engine's, and its probes' host work stays small."""

from __future__ import annotations

import sys

import pytest

from conftest import generate_with_scheduler, tiny_config

K = 3


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from trtgraph.compiler.pipeline import capture
    from trtgraph.runtime.serving.engine import Engine

    out = tmp_path_factory.mktemp("s16spec")
    capture(tiny_config(speculative={"draft_len": K, "ngram_min": 1, "ngram_max": 3}, kv_cache={"num_blocks": 30}), out)
    return Engine(out), Engine(out, speculative=False)


def _priced(engine, monkeypatch, verify_over_plain: float):
    keys = [k for k in engine.manifest.graph_keys if not k.is_prefill]
    monkeypatch.setattr(engine.scheduler.speculation, "replay_ms",
                        {k: verify_over_plain if k.draft_len else 1.0 for k in keys})


def test_a_plain_fast_path_step_of_the_speculative_engine_makes_a_few_more_calls_than_the_plain_one(
        engines, monkeypatch):
    """Forming a step launched ahead on the fast path (`extend_decode`) where no probe is due:
    the speculative engine's policy (timing steps as on CUDA) adds at most 3 Python calls to
    the plain engine's (its hand-out's clock read and run count, the probe countdown); before,
    8 (the properties and helpers each step went through)."""
    from trtgraph.runtime.serving.scheduler import Scheduler

    spec, plain = engines
    _priced(spec, monkeypatch, 1.0 + K)  # no estimate below certainty makes a verify step pay
    monkeypatch.setattr(spec.scheduler.speculation, "measure", True)
    calls: dict[int, list[int]] = {}
    extend = Scheduler.extend_decode

    def counted(self, step, unread=1):
        n = [0]
        probe = self._probe

        def prof(frame, event, arg):
            if event in ("call", "c_call"):
                n[0] += 1
        sys.setprofile(prof)
        try:
            out = extend(self, step, unread)
        finally:
            sys.setprofile(None)
        if out is not None and out.repeats and self._probe is probe:  # a fast-path step, no probe noted
            calls.setdefault(id(self), []).append(n[0])
        return out

    monkeypatch.setattr(Scheduler, "extend_decode", counted)
    reqs = [{"id": f"r{i}", "prompt": "Random words: quince, harbour, velvet " + "x" * i, "max_tokens": 40,
             "temperature": 0.8, "seed": i} for i in range(3)]
    got, _ = generate_with_scheduler(spec, reqs)
    want, _ = generate_with_scheduler(plain, reqs)
    s, p = calls[id(spec.scheduler)], calls[id(plain.scheduler)]
    assert len(s) > 20 and len(p) > 20
    assert min(s) - min(p) <= 3, (min(s), min(p))
    for r in reqs:
        assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]


def test_the_policy_totals_its_probes_host_time_and_counts_the_probes_hope_called(engines, monkeypatch):
    """probe_seconds: the host time of the probes that did not draft (what `spaced` prices);
    hope_probes: the probes the one before called by hope (the floor PROBE_SHARE sets does not space
    those: the probe budget bounds them)."""
    spec, plain = engines
    pol = spec.scheduler.speculation
    reqs = [{"id": f"r{i}", "prompt": "one two three four " * (i + 2), "max_tokens": 40} for i in range(3)]
    want, _ = generate_with_scheduler(plain, reqs)
    for verify_ms, hoping in ((1.0 + K, False), (2.5, True)):  # K + 1 tokens a row cannot pay 1 + K; they can 2.5
        _priced(spec, monkeypatch, verify_ms)
        pol.floor, pol.interval, pol.row_ms = 0, 1, None  # (what an earlier test's timed probes left)
        seconds, probes, hope = pol.probe_seconds, pol.probes, pol.hope_probes
        got, _ = generate_with_scheduler(spec, reqs)
        assert pol.probes - probes >= 3
        assert 0 < pol.probe_seconds - seconds < 1.0
        assert (pol.hope_probes - hope > 0) == hoping and pol.hope_probes - hope < pol.probes - probes
        for r in reqs:
            assert got[r["id"]].token_ids == want[r["id"]].token_ids, r["id"]
