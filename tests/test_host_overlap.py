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
