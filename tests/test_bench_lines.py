"""`trtgraph bench`'s issue-14 lines on the CPU: the mixed workload fits the manifest's limits
and runs through the engine, the run is set against its step-time bound, and the report
shows those and the start-up phases."""

from __future__ import annotations

import pytest

from trtgraph.bench import mixed_prompts, mixed_run, step_bound
from trtgraph.bench_report import markdown
from trtgraph.runtime.serving.engine import Engine


def test_mixed_prompts_fit_the_limits_and_a_third_sample():
    prompts = mixed_prompts(300, 320, 256, sampled=True)
    assert all(len(p["prompt_token_ids"]) + p["max_tokens"] <= 256 for p in prompts)
    assert all(8 <= len(p["prompt_token_ids"]) and 16 <= p["max_tokens"] for p in prompts)
    sampled = sum("temperature" in p for p in prompts)
    assert 70 <= sampled <= 130
    long = mixed_prompts(300, 128256, 2048, sampled=False)
    assert max(len(p["prompt_token_ids"]) for p in long) > 1000 and max(p["max_tokens"] for p in long) > 200
    assert not any("temperature" in p for p in long)


def test_mixed_run_bound_and_report(default_artifacts, one_torch_thread):
    engine = Engine(default_artifacts)
    logged = []
    mixed = mixed_run(engine, 12, logged.append)
    assert mixed["requests"] == 12 and mixed["completion_tokens"] > 0 and "padding " in logged[0]
    run = {"tokens_per_second": 500.0, "steps_per_key": {"(bs=8, decode draft=0, greedy)": 3,
                                                         "(bs=4, prefill chunk=64, greedy)": 1}}
    bound = step_bound(run, [{"batch_size": 4, "replay_ms": 2.0}, {"batch_size": 8, "replay_ms": 4.0}])
    assert bound["batch_size"] == 8 and bound["bound_tokens_per_second"] == 2000.0 and bound["fraction"] == 0.25
    assert step_bound({"tokens_per_second": 1.0, "steps_per_key": {}}, []) is None
    assert "own_steps" not in bound  # no gpu_timing: the first figure alone
    timed = {**run, "completion_tokens": 1000, "seconds": 2.0, "steps": 4, "gpu_busy_seconds": 1.6}
    both = step_bound(timed, [{"batch_size": 8, "replay_ms": 4.0}])
    assert both["bound_tokens_per_second"] == 2000.0 and both["fraction"] == 0.25  # the first figure, kept
    assert both["own_steps"]["bound_tokens_per_second"] == 625.0 and both["own_steps"]["fraction"] == pytest.approx(0.8)
    assert "the run reached 80.0% of it" in markdown({"device": "cpu", "model": {"architecture": "X", "parameter_count": 1,
        "dtype": "float32"}, "kernels": "torch", "context_len": 8, "hbm_bytes_per_second": 1e12, "decode": [], "keys": [],
        "run": {**mixed, "tokens_per_second": 500.0}, "run_bound": both})
    r = {"device": "cpu", "model": {"architecture": "X", "parameter_count": 1, "dtype": "float32"}, "kernels": "torch",
         "context_len": 8, "hbm_bytes_per_second": 1e12, "decode": [], "keys": [],
         "run": {**mixed, "tokens_per_second": 500.0}, "run_bound": bound, "mixed": mixed,
         "startup": {"phases_seconds": {"interpreter": 0.25, "imports": 0.5, "re_record": 1.25}, "total_seconds": 2.0}}
    text = markdown(r)
    assert "reached 25.0% of it" in text and "mixed workload: 12 requests" in text
    assert "engine start-up after imports (1.25 s): re_record 1.25 s; before it (interpreter and imports; with " \
           "--config, since the capture) 0.75 s" in text
