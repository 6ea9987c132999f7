"""When the rows change (requests finish and waiting ones are admitted), the engine forms and
launches the next step before it turns the finished requests' tokens into text, so that
text work overlaps the device's next step (issue 14)."""

from __future__ import annotations

import pytest

from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.launcher import StepLauncher


@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


def test_the_next_step_launches_before_the_finished_requests_text(engine, monkeypatch):
    log: list[tuple[str, set]] = []
    launch, news = StepLauncher.launch, Engine._news

    def logged_launch(self, step, stats):
        log.append(("launch", {s.request.id for s in step.seqs}))
        return launch(self, step, stats)

    def logged_news(self, seq, reason, text=None):
        if reason is not None:
            log.append(("finished", {seq.request.id}))
        return news(self, seq, reason, text)

    monkeypatch.setattr(StepLauncher, "launch", logged_launch)
    monkeypatch.setattr(Engine, "_news", logged_news)
    rows = engine.scheduler.plan.max_batch_size
    # one more request than rows: the last waits until the first ones finish
    prompts = [{"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7], "max_tokens": 3, "ignore_eos": True}
               for i in range(rows + 1)]
    results = list(engine.generate(prompts))
    assert sorted(len(r.token_ids) for r in results) == [3] * (rows + 1)
    late = f"r{rows}"
    first_launch = next(i for i, (what, ids) in enumerate(log) if what == "launch" and late in ids)
    first_finished = next(i for i, (what, _) in enumerate(log) if what == "finished")
    assert first_launch < first_finished, log


def test_a_wave_that_ends_together_hands_over_before_its_last_tokens_are_read(engine, monkeypatch):
    """Rows that all reach max_tokens in one step: the waiting requests' step is launched before
    that step's tokens are read (no bubble at the wave's end), and no step is launched for rows
    that had all finished. The first step is launched before every request is admitted (the rest
are admitted in slices while the device runs)."""
    log: list[tuple[str, set]] = []
    launch, wait, admit = StepLauncher.launch, StepLauncher.wait, Engine._admit

    def logged_launch(self, step, stats):
        log.append(("launch", {s.request.id for s in step.seqs}))
        return launch(self, step, stats)

    def logged_wait(self, f, stats):
        log.append(("wait", {s.request.id for s in f.step.seqs}, all(s.finished for s in f.step.seqs)))
        return wait(self, f, stats)

    def logged_admit(self, request, stream, arrived):
        log.append(("add", {request.id}))
        return admit(self, request, stream, arrived)

    monkeypatch.setattr(StepLauncher, "launch", logged_launch)
    monkeypatch.setattr(StepLauncher, "wait", logged_wait)
    monkeypatch.setattr(Engine, "_admit", logged_admit)
    rows = engine.scheduler.plan.max_batch_size
    prompts = [{"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7], "max_tokens": 3, "ignore_eos": True}
               for i in range(2 * rows)]
    results = list(engine.generate(prompts))
    assert sorted(len(r.token_ids) for r in results) == [3] * (2 * rows)
    first_launch = next(i for i, e in enumerate(log) if e[0] == "launch")
    last_add = max(i for i, e in enumerate(log) if e[0] == "add")
    assert first_launch < last_add, log[:5]
    assert not [e for e in log if e[0] == "wait" and e[2]], "a step was launched for rows that had all finished"
    late = f"r{rows}"
    late_launch = next(i for i, e in enumerate(log) if e[0] == "launch" and late in e[1])
    last_wave_wait = max(i for i, e in enumerate(log) if e[0] == "wait" and "r0" in e[1])
    assert late_launch < last_wave_wait, log


def test_decode_launched_before_the_prefills_tokens_are_read_draws_the_same_tokens(default_artifacts,
                                                                                   one_torch_thread):
    """A wave's first decode step is launched while its prefill runs (the rows' input tokens
    gathered on the device from the prefill's drawn tokens), and later prefill chunks while
    the earlier ones run: the tokens equal those of an engine that packs every step's full
    inputs on the host after reading the step before (no step launched ahead)."""
    ahead, plain = Engine(default_artifacts), Engine(default_artifacts)
    plain.scheduler.fast_path = False
    rows = ahead.scheduler.plan.max_batch_size
    gathered = []
    prepare = StepLauncher._prepare

    def logged(self, step, stats):
        gathered.append(len(step.gather))
        return prepare(self, step, stats)

    prompts = [{"id": f"r{i}", "prompt_token_ids": [(11 * i + j) % 300 + 3 for j in range(20 + 9 * i)],
                "max_tokens": 6 + i % 3, "temperature": 0.8 if i % 2 else 0.0, "seed": i}
               for i in range(2 * rows)]
    StepLauncher._prepare = logged
    try:
        got = {r.id: r.token_ids for r in ahead.generate(prompts)}
    finally:
        StepLauncher._prepare = prepare
    want = {r.id: r.token_ids for r in plain.generate(prompts)}
    assert got == want
    assert sum(1 for g in gathered if g) >= 1, gathered
