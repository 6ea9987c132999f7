"""A Ctrl-C after step() read a step and drained another (a step launched ahead whose rows had all
finished) but before it made their news: Engine._recover's `_orphans` must find every completion
of an n > 1 request that finished in the first step read, not only those of the step drained last."""

from __future__ import annotations

from types import SimpleNamespace

from trtgraph.runtime.serving.engine import Engine


def test_a_completion_finished_before_a_drain_gets_its_result_after_a_ctrl_c(default_artifacts, one_torch_thread):
    engine = Engine(default_artifacts)
    real = Engine._drawn
    fired = []

    def drawn(self, f):
        out = real(self, f)
        if not fired and any(seq.request.n > 1 and reason is not None for seq, reason, _ in out):
            fired.append(1)
            wait, post = self.launcher.wait, self.scheduler.postprocess
            self.launcher.wait = lambda f, stats: ([], [], [])
            self.scheduler.postprocess = lambda *args: []
            try:  # a drained step over other rows (its tokens already applied): read, nothing news
                real(self, SimpleNamespace(step=SimpleNamespace(seqs=[])))
            finally:
                self.launcher.wait, self.scheduler.postprocess = wait, post
            raise KeyboardInterrupt  # as at the _launch_next after the drain, before the news are made
        return out

    engine._drawn = drawn.__get__(engine)
    two = {"id": "two", "prompt_token_ids": [5, 9, 13, 17], "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 3}
    ids = engine.submit([two, {"id": "one", "prompt_token_ids": [1, 2, 3], "max_tokens": 9}])
    done = {}
    for _ in range(200):
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            continue
        done.update((o.id, o.result) for o in outputs if o.finished)
        if not engine.has_unfinished():
            break
    assert fired and set(done) == set(ids), (fired, sorted(done))
    assert [len(c.token_ids) for c in done["two"].choices] == [6, 6]

