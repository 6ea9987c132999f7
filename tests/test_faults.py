"""Faults and safety: out of memory during capture, `run` interrupted and resumed, nothing
loaded executes code, and random request mixes through the scheduler and static replay
equal the eager oracle with no KV block leaked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtgraph.artifacts import MANIFEST_NAME
from trtgraph.errors import CaptureError

from conftest import generate_with_scheduler, tiny_config

ROOT = Path(__file__).resolve().parents[1]


# ---- out of memory while capturing ---------------------------------------------------------


def test_out_of_memory_during_capture_names_the_key_and_writes_nothing(tmp_path, monkeypatch):
    """The device runs out of memory while one key is captured: the error names that key and
    suggests a smaller plan; no manifest (and no temporary file) is left behind."""
    from trtgraph.compiler import pipeline
    from trtgraph.runtime.step.executor import Executor

    real = Executor.capture

    def capture(self, key):
        if key.batch_size == 4 and key.chunk_size == 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, key)

    monkeypatch.setattr(Executor, "capture", capture)
    with pytest.raises(CaptureError) as err:
        pipeline.capture(tiny_config(), tmp_path)
    msg = str(err.value)
    assert "bs=4, prefill chunk=16" in msg and "out of device memory during capture" in msg
    assert "smaller plan" in msg and "No manifest was written" in msg
    assert not (tmp_path / MANIFEST_NAME).exists()
    assert not list(tmp_path.glob(".manifest-*"))


def test_out_of_memory_keeps_an_earlier_manifest_intact(tmp_path, monkeypatch):
    """A failed recapture into a directory that holds a good manifest leaves that manifest as it was."""
    from trtgraph.compiler import pipeline
    from trtgraph.runtime.step.executor import Executor

    pipeline.capture(tiny_config(), tmp_path)
    before = (tmp_path / MANIFEST_NAME).read_bytes()

    def warmup(self, key, eager=False):  # the capture's warm-up runs each key eagerly first
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(Executor, "execute", warmup)
    with pytest.raises(CaptureError, match="during warm-up"):
        pipeline.capture(tiny_config(), tmp_path)
    assert (tmp_path / MANIFEST_NAME).read_bytes() == before


# ---- run interrupted, then resumed -----------------------------------------------------------


def _prompts(path: Path, n: int) -> list[dict]:
    reqs = [{"id": f"r{i:03d}", "prompt": f"request {i} " * (1 + i % 7), "max_tokens": 120} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs), encoding="utf-8")
    return reqs


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "trtgraph", *args]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_run_keeps_finished_outputs_and_resume_completes_it(default_artifacts, tmp_path, sig):
    """Stopped mid-run: every finished result is on disk as valid JSONL, the summary names
    what did not finish, and --resume runs exactly those, giving the same tokens as one full run."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    reqs = _prompts(prompts, 64)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(_cli("run", "--prompts", str(prompts), "--manifest", str(default_artifacts),
                                 "--output", str(out)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be interrupted; make it longer"
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    stderr = stderr.decode()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    lines = out.read_text(encoding="utf-8").splitlines()
    first = [json.loads(line) for line in lines]  # every line is complete JSON
    assert 3 <= len(first) < len(reqs)
    m = re.search(r"interrupted: (\d+) of (\d+) requests finished and written .*; (\d+) did not finish", stderr)
    assert m and int(m.group(1)) == len(first) and int(m.group(3)) == len(reqs) - len(first), stderr
    assert "--resume" in stderr

    resumed = subprocess.run(_cli("run", "--prompts", str(prompts), "--manifest", str(default_artifacts),
                                  "--output", str(out), "--resume"), capture_output=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert f"resume: {len(first)} requests already in" in resumed.stderr.decode()
    final = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in reqs)  # each exactly once

    full = tmp_path / "full.jsonl"
    subprocess.run(_cli("run", "--prompts", str(prompts), "--manifest", str(default_artifacts), "--output",
                        str(full)), check=True, capture_output=True, env=env, timeout=300)
    want = {r["id"]: r["token_ids"] for r in map(json.loads, full.read_text(encoding="utf-8").splitlines())}
    assert {r["id"]: r["token_ids"] for r in final} == want


def test_an_interruption_right_after_a_line_is_written_counts_that_line(tmp_path, monkeypatch):
    """The signal lands between a result's write and its count (the window a subprocess test
    hits only by chance under load): the summary still counts every line on disk."""
    from types import SimpleNamespace

    from trtgraph.runtime.serving import file_run

    ids = [f"r{i}" for i in range(6)]
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=str), generate=lambda reqs: iter(
        SimpleNamespace(ttft_ms=1.0, rid=r) for r in reqs), stats=SimpleNamespace(to_json=dict), generation=None)
    requests = SimpleNamespace(ids=ids, for_model=lambda generation: ids,
                               lines=lambda results, text, raw=None: ((r.rid, {"id": r.rid}) for r in results))
    real_write = file_run._write_line

    def write_then_signal(out, line, output, num_written, num_requests):
        real_write(out, line, output, num_written, num_requests)
        if num_written == 2:  # the third line is on disk; the signal arrives before it is counted
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(file_run, "_write_line", write_then_signal)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    logged = []
    try:
        stats = file_run.serve_file(engine, requests, str(tmp_path / "out.jsonl"), resume=False,
                                    ascii_only=True, log=logged.append)
    finally:
        signal.signal(signal.SIGINT, previous)
    lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert stats is None and len(lines) == 3
    assert "interrupted: 3 of 6 requests finished" in logged[0] and "3 did not finish: r3, r4, r5" in logged[0]


def test_resume_repairs_a_line_cut_short_by_a_hard_kill(tmp_path):
    from trtgraph.runtime.serving.resume import resume_point

    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "a", "token_ids": [1], "finish_reason": "length"}\n'
                    b'{"id": "b", "token_ids": [2], "finish_reason": "stop"}\n{"id": "c", "tok')
    assert resume_point(out).done == {"a", "b"}
    assert out.read_bytes().endswith(b'"stop"}\n')  # valid JSONL again; "c" runs again


def test_resume_refuses_a_file_that_is_not_run_output(tmp_path):
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.resume import resume_point

    out = tmp_path / "notes.txt"
    out.write_text("hello\nworld\n")
    with pytest.raises(PromptError, match="line 1: not a result line"):
        resume_point(out)


def test_resume_needs_an_output_file(default_artifacts, tmp_path):
    from click.testing import CliRunner

    from trtgraph.cli import main

    prompts = tmp_path / "p.jsonl"
    _prompts(prompts, 2)
    res = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(default_artifacts), "--resume"])
    assert res.exit_code == 2 and "--resume needs --output" in res.output


# ---- safety: nothing loaded executes code -----------------------------------------------------

_UNSAFE = [
    (re.compile(r"\bpickle\b"), "pickle"),
    (re.compile(r"torch\.load\("), "torch.load"),
    (re.compile(r"yaml\.(load|unsafe_load|full_load)\("), "yaml.load"),
    (re.compile(r"(?<![\w.])(eval|exec)\("), "eval/exec"),
    (re.compile(r"Loader\s*=\s*yaml\.(Loader|UnsafeLoader|FullLoader)"), "unsafe YAML loader"),
    (re.compile(r"trust_remote_code"), "remote code"),
]


def _code_only(line: str) -> str:
    """A source line without its comment and without the text of its string literals (a
    message may say "pickle files are never loaded"; code that loads one is still code)."""
    code = line.split("#", 1)[0]
    return re.sub(r"(\"[^\"]*\"|'[^']*')", '""', code)


def test_the_unsafe_code_scan_sees_code_next_to_the_word_never():
    """The scan once skipped every line containing "never"; code beside it is still found."""
    for line in ['data = pickle.loads(blob)  # never reached', 'x = torch.load(p); never = 1',
                 'msg = "never unpickled"; obj = pickle.load(f)']:
        assert any(pattern.search(_code_only(line)) for pattern, _ in _UNSAFE), line
    assert not any(pattern.search(_code_only('raise Error("pickle files are never loaded")')) for pattern, _ in _UNSAFE)


def test_no_module_can_load_code_from_a_file():
    """Checkpoints, configs, prompts and manifests are read as safetensors, safe YAML and
    JSON only: the package never unpickles, never evals, never uses an unsafe YAML loader."""
    found = []
    for path in sorted((ROOT / "trtgraph").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            code = _code_only(line)
            for pattern, what in _UNSAFE:
                if pattern.search(code):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_pickle_checkpoint_is_never_loaded(tmp_path):
    """A directory with only pytorch_model.bin is refused before anything reads it."""
    from trtgraph.errors import WeightLoadError
    from trtgraph.models.loader import weight_files

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 this would be a pickle")
    with pytest.raises(WeightLoadError, match="pickle"):
        weight_files(tmp_path)


def test_manifest_paths_must_stay_inside_the_artifacts_directory(default_artifacts, tmp_path):
    """A manifest (digest recomputed, as a forger would) pointing its Triton cache outside is refused."""
    import shutil

    from trtgraph.artifacts import _digest, load_manifest
    from trtgraph.errors import ManifestError

    art = tmp_path / "art"
    shutil.copytree(default_artifacts, art)
    for bad in ("../outside", "/etc", "triton-cache/../../x"):
        body = json.loads((art / MANIFEST_NAME).read_text())
        body["paths"]["triton_cache"] = bad
        body["digest"] = _digest(body)
        (art / MANIFEST_NAME).write_text(json.dumps(body))
        with pytest.raises(ManifestError, match="leaves the artifacts directory"):
            load_manifest(art)


# ---- property: random mixes equal the oracle, and nothing leaks ---------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Engines over KV caches of three sizes (17 blocks is the minimum for max_seq_len 256)."""
    from trtgraph.compiler.pipeline import capture
    from trtgraph.runtime.serving.engine import Engine

    out = {}
    for blocks in (17, 24, 64):
        path = tmp_path_factory.mktemp(f"kv{blocks}")
        capture(tiny_config(kv_cache={"num_blocks": blocks}), path)
        out[blocks] = Engine(path)
    return out


_request = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 120),
    "max_tokens": st.integers(1, 40),
    "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.3]),
    "top_k": st.sampled_from([0, 1, 5, 50]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "seed": st.integers(0, 2**31),
    "first_token": st.integers(0, 255),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(mix=st.lists(_request, min_size=1, max_size=14), blocks=st.sampled_from([17, 24, 64]), data=st.data())
def test_random_mixes_equal_the_oracle_and_leak_no_block(engines, mix, blocks, data):
    import oracle

    engine = engines[blocks]
    reqs = [{"id": f"q{i}", "prompt_token_ids": [(r["first_token"] + 7 * j) % 256 for j in range(r["prompt_len"])],
             "max_tokens": r["max_tokens"], "temperature": r["temperature"], "top_k": r["top_k"],
             "top_p": r["top_p"], "seed": r["seed"]} for i, r in enumerate(mix)]
    order = data.draw(st.permutations(range(len(reqs))), label="arrival order")
    reqs = [reqs[i] for i in order]
    got, sched = generate_with_scheduler(engine, reqs)
    assert sched.allocator.num_free == sched.allocator.num_blocks - 1, "KV blocks leaked"
    assert not sched.running and not sched.waiting
    for r in reqs:
        want = oracle.generate(engine.executor.loaded, r["prompt_token_ids"], r["max_tokens"],
                               temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"], seed=r["seed"])
        assert got[r["id"]].token_ids == want, r


def test_out_of_memory_loading_the_model_or_kv_cache_says_what_to_shrink(tmp_path, monkeypatch):
    from trtgraph.compiler import pipeline
    from trtgraph.runtime.step.executor import Executor

    def build(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    monkeypatch.setattr(Executor, "build", build)
    with pytest.raises(CaptureError, match="allocating the KV cache .* smaller kv_cache.num_blocks"):
        pipeline.capture(tiny_config(), tmp_path)
    assert not (tmp_path / MANIFEST_NAME).exists()
