"""Outputs, paths, signals and processes (issue 11): no output may overwrite an input or
another output, paths are checked before any work, signals and broken pipes end a command
cleanly, a failed capture leaves nothing behind, and rows are checked where they enter the
step buffers. One test per defect; each failed before its fix."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from trtgraph.artifacts import MANIFEST_NAME, TRITON_CACHE_DIR
from trtgraph.cli import main
from trtgraph.errors import CaptureError, PromptError, ReplayMismatchError

from conftest import tiny_config

import trtgraph

ROOT = Path(trtgraph.__file__).resolve().parents[1]  # the trtgraph under test, for subprocesses
PROMPTS = [{"id": f"r{i}", "prompt": f"prompt {i} ünïcödé", "max_tokens": 6} for i in range(3)]


def cli(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def write_prompts(path: Path, rows=PROMPTS, n: int | None = None, max_tokens: int = 120) -> Path:
    rows = rows if n is None else [{"id": f"r{i:03d}", "prompt": f"request {i} " * (1 + i % 7),
                                    "max_tokens": max_tokens} for i in range(n)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def art(default_artifacts, tmp_path):
    """A private copy of the default artifacts: a test that fails must not damage the shared one."""
    dst = tmp_path / "art"
    shutil.copytree(default_artifacts, dst)
    return dst


@pytest.fixture
def no_model(monkeypatch):
    """Any model work (an Engine) fails the test: refusals must come before it."""
    from trtgraph.runtime.serving import engine

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(engine.Engine, "__init__", refuse)


def _assert_refused(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.stderr.splitlines()[-1].startswith("error: ") and "Traceback" not in res.output
    for needle in needles:
        assert str(needle) in res.stderr, (needle, res.stderr)


# ---- item 1: an output is never an input, an artifact or another output ------------------------

def _clash_cases(tmp: Path, art: Path):
    prompts = write_prompts(tmp / "prompts.jsonl")
    (tmp / "link.jsonl").symlink_to(prompts)
    os.link(prompts, tmp / "hard.jsonl")
    base = ["run", "--prompts", prompts, "--manifest", art]
    return {
        "output-is-prompts": (base + ["--output", prompts], [prompts]),
        "summary-is-prompts": (base + ["--output", tmp / "o.jsonl", "--summary-json", prompts], [prompts]),
        "summary-is-output": (base + ["--output", tmp / "o.jsonl", "--summary-json", tmp / "o.jsonl"],
                              ["--summary-json", "--output"]),
        "output-is-manifest": (base + ["--output", art / MANIFEST_NAME], [art / MANIFEST_NAME]),
        "output-in-triton-cache": (base + ["--output", art / TRITON_CACHE_DIR / "x.jsonl"], ["Triton cache"]),
        "output-symlink-to-prompts": (base + ["--output", tmp / "link.jsonl"], ["resolves to", prompts]),
        "output-hard-link-to-prompts": (base + ["--output", tmp / "hard.jsonl"], [prompts]),
        "resume-output-is-prompts": (base + ["--resume", "--output", prompts], [prompts]),
    }


CLASH_IDS = ["output-is-prompts", "summary-is-prompts", "summary-is-output", "output-is-manifest",
             "output-in-triton-cache", "output-symlink-to-prompts", "output-hard-link-to-prompts",
             "resume-output-is-prompts"]


@pytest.mark.parametrize("case", CLASH_IDS)
def test_an_output_that_is_an_input_or_another_output_is_refused_before_any_work(case, art, tmp_path, no_model):
    args, needles = _clash_cases(tmp_path, art)[case]
    before = {p: p.read_bytes() for p in [tmp_path / "prompts.jsonl", art / MANIFEST_NAME]}
    _assert_refused(cli(*args), *needles)
    assert {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "o.jsonl").exists()


def test_capture_refuses_to_write_its_manifest_over_its_config_or_into_the_checkpoint(tmp_path):
    d = tiny_config().to_dict()
    cfg = tmp_path / "art" / MANIFEST_NAME  # a config file named like the manifest, in --out
    cfg.parent.mkdir()
    cfg.write_text(yaml.safe_dump(d))
    before = cfg.read_bytes()
    _assert_refused(cli("capture", "--config", cfg, "--out", tmp_path / "art"), "the config (--config)")
    assert cfg.read_bytes() == before
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    d["model"] = {"path": str(ckpt)}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(d))
    _assert_refused(cli("capture", "--config", tmp_path / "m.yaml", "--out", ckpt / "art"), "checkpoint directory")
    assert list(ckpt.iterdir()) == []


def test_bench_refuses_an_output_that_is_its_config(tmp_path):
    cfg = tmp_path / "bench.json"
    cfg.write_text(yaml.safe_dump(tiny_config().to_dict()))
    before = cfg.read_bytes()
    _assert_refused(cli("bench", "--config", cfg, "--out", tmp_path), "the config (--config)")
    assert cfg.read_bytes() == before


# ---- item 8: outputs in a missing or read-only directory, and the Triton cache -------------------

def _read_only_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    if os.access("/sys", os.W_OK) and not _refuses_files(Path("/sys")):
        pytest.skip("no read-only directory for root here")
    return Path("/sys")  # sysfs refuses new files even to root


def _refuses_files(d: Path) -> bool:
    try:
        (d / "trtgraph-probe").touch()
    except OSError:
        return True
    (d / "trtgraph-probe").unlink()
    return False


@pytest.mark.parametrize("flag", ["--output", "--summary-json"])
@pytest.mark.parametrize("where", ["missing", "read-only"])
def test_an_output_in_a_missing_or_read_only_directory_is_refused_before_the_model_loads(
        flag, where, art, tmp_path, no_model):
    parent = tmp_path / "no-such-dir" if where == "missing" else _read_only_dir(tmp_path)
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    res = cli("run", "--prompts", prompts, "--manifest", art, flag, parent / "out.json")
    _assert_refused(res, flag, "does not exist" if where == "missing" else "cannot write")


@pytest.mark.parametrize("kind", ["file", "symlink-out"])
def test_capture_refuses_a_triton_cache_a_run_would_refuse(kind, tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    if kind == "file":
        (out / TRITON_CACHE_DIR).write_text("not a directory")
    else:
        (tmp_path / "elsewhere").mkdir()
        (out / TRITON_CACHE_DIR).symlink_to(tmp_path / "elsewhere")
    _assert_refused(cli("capture", "--device", "cpu", "--out", out), TRITON_CACHE_DIR)
    assert not (out / MANIFEST_NAME).exists()


def test_run_with_a_triton_cache_that_became_a_file_exits_2(art, tmp_path):
    shutil.rmtree(art / TRITON_CACHE_DIR)
    (art / TRITON_CACHE_DIR).write_text("x")
    res = cli("run", "--prompts", write_prompts(tmp_path / "p.jsonl"), "--manifest", art)
    _assert_refused(res, TRITON_CACHE_DIR, "must be a directory")


def test_triton_kernels_without_cuda_exit_2_naming_the_field(tmp_path, monkeypatch):
    """Decided: refused (exit 2) unless TRITON_INTERPRET=1 asks for Triton's interpreter."""
    from trtgraph.kernels import resolve

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = tmp_path / "m.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(kernels="triton").to_dict()))
    _assert_refused(cli("capture", "--config", cfg, "--out", tmp_path / "art"), "kernels = 'triton'",
                    "TRITON_INTERPRET=1")
    assert not (tmp_path / "art").exists()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("triton", "cpu") == "triton"


def _cpu_oom():
    try:
        torch.empty(1 << 60, dtype=torch.uint8)  # the CPU allocator's own error
    except RuntimeError as exc:
        return exc
    raise AssertionError("expected the allocation to fail")


def test_host_memory_running_out_during_capture_is_the_same_capture_error(tmp_path, monkeypatch):
    from trtgraph.compiler import pipeline
    from trtgraph.runtime.step.executor import Executor

    def capture(self, key):
        raise _cpu_oom()

    monkeypatch.setattr(Executor, "capture", capture)
    with pytest.raises(CaptureError, match=r"out of host memory during capture .*No manifest was written"):
        pipeline.capture(tiny_config(), tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_host_memory_running_out_at_run_start_up_exits_2(art, tmp_path, monkeypatch):
    from trtgraph.runtime.step.executor import Executor

    def build(*a, **k):
        raise _cpu_oom()

    monkeypatch.setattr(Executor, "build", build)
    res = cli("run", "--prompts", write_prompts(tmp_path / "p.jsonl"), "--manifest", art)
    _assert_refused(res, "out of memory", "kv_cache.num_blocks")


BENCH_BAD = [
    (["--context-len", "-1"], "--context-len"),
    (["--context-len", "256"], "--context-len 256"),  # = limits.max_seq_len
    (["--context-len", "100000"], "--context-len"),
    (["--prompts", "-1"], "--prompts"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--prompt-len", "200"], "--prompt-len 200 + --max-tokens 128"),
    (["--attention-batch", "-2"], "--attention-batch"),
    (["--attention-context", "0"], "--attention-context"),
]


@pytest.mark.parametrize("args,needle", BENCH_BAD, ids=[" ".join(a) for a, _ in BENCH_BAD])
def test_bench_options_out_of_range_exit_2_before_any_work(args, needle, art, tmp_path, monkeypatch):
    import trtgraph.bench

    def refuse(*a, **k):
        raise AssertionError("bench started before refusing its options")

    monkeypatch.setattr(trtgraph.bench.Engine, "__init__", refuse)
    res = cli("bench", "--manifest", art, "--out", tmp_path / "b", *args)
    assert res.exit_code == 2, (res.output, res.exception)
    assert needle in res.stderr and "Traceback" not in res.output


def test_bench_context_that_does_not_fit_the_kv_cache_exits_2(tmp_path, small_kv_artifacts, monkeypatch):
    import trtgraph.bench

    monkeypatch.setattr(trtgraph.bench.Engine, "__init__", lambda *a, **k: pytest.fail("bench started"))
    res = cli("bench", "--manifest", small_kv_artifacts, "--out", tmp_path / "b", "--context-len", "100",
              "--prompts", "0")
    assert res.exit_code == 2 and "KV blocks" in res.stderr and "--context-len 100" in res.stderr, res.output


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_output_that_stops_taking_data_exits_2_saying_how_to_continue(default_artifacts, tmp_path):
    res = cli("run", "--prompts", write_prompts(tmp_path / "p.jsonl"), "--manifest", default_artifacts,
              "--output", "/dev/full")
    _assert_refused(res, "--output /dev/full: writing failed (No space left on device) after 0 of 3", "--resume")


# ---- item 4: --resume ------------------------------------------------------------------------

def test_resume_after_a_complete_last_line_without_newline_does_not_glue_lines(default_artifacts, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "out.jsonl"
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out)
    assert res.exit_code == 0, res.output
    full = out.read_text(encoding="utf-8").splitlines()
    out.write_text(full[0], encoding="utf-8")  # one complete result, its newline lost
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["id"] for r in rows) == ["r0", "r1", "r2"]
    assert {r["id"]: r["token_ids"] for r in rows} == {r["id"]: r["token_ids"] for r in map(json.loads, full)}


@pytest.mark.parametrize("content,line", [
    ('{"id": "r0", "prompt": "hello"}\n', 1),  # a prompts file
    ('{"id": "x", "text": "", "token_ids": [], "finish_reason": "length"}\n{"id": "y"}\n', 2),
    ('{"id": "x", "text": "", "token_ids": [], "finish_reason": "length"}\n[1, 2]', 2),  # no newline
])
def test_resume_refuses_an_output_whose_lines_are_not_results(content, line, default_artifacts, tmp_path, no_model):
    out = tmp_path / "notes.jsonl"
    out.write_text(content, encoding="utf-8")
    res = cli("run", "--prompts", write_prompts(tmp_path / "p.jsonl"), "--manifest", default_artifacts,
              "--output", out, "--resume")
    _assert_refused(res, f"{out} line {line}: not a result line")
    assert out.read_text(encoding="utf-8") == content


# ---- item 10: errors switch, capture leftovers, manifest permissions --------------------------------

@pytest.mark.parametrize("value", ["0", "false", "FALSE", "False", "off", "no", ""])
def test_raise_errors_off_values_still_give_the_one_line_message(value, tmp_path):
    res = cli("capture", "--config", tmp_path / "missing.yaml", env={"TRTGRAPH_RAISE_ERRORS": value})
    _assert_refused(res, "missing.yaml")


def test_raise_errors_on_shows_the_exception(tmp_path):
    from trtgraph.errors import ConfigError

    res = cli("capture", "--config", tmp_path / "missing.yaml", env={"TRTGRAPH_RAISE_ERRORS": "1"})
    assert isinstance(res.exception, ConfigError)


@pytest.mark.parametrize("failure", ["parity", "interrupt"])
def test_a_failed_capture_leaves_nothing_behind(failure, tmp_path, monkeypatch):
    """Replaces the `all_parity_ok is True` assertion that could not fail: a key whose replay
    differs from eager stops the capture, and nothing (no manifest, no Triton cache, no
    directory) is left."""
    from trtgraph.compiler import pipeline
    from trtgraph.compiler.verify import Parity
    from trtgraph.runtime.step.executor import Executor

    if failure == "parity":
        failing = types.SimpleNamespace(parity=lambda: Parity(0.5, False, False), ready=lambda: False)
        monkeypatch.setattr(pipeline, "launch_verify", lambda ex, key, seed, reference=None: failing)
        expected = pytest.raises(CaptureError, match="replay differs from eager")
    else:
        def warmup(self, key, eager=False):  # the capture's warm-up runs each key eagerly first
            raise KeyboardInterrupt

        monkeypatch.setattr(Executor, "execute", warmup)
        expected = pytest.raises(KeyboardInterrupt)
    out = tmp_path / "new" / "art"
    with expected:
        pipeline.capture(tiny_config(), out)
    assert not out.exists()
    keep = tmp_path / "kept"  # a directory that existed before stays, empty as it was
    keep.mkdir()
    with pytest.raises((CaptureError, KeyboardInterrupt)):
        pipeline.capture(tiny_config(), keep)
    assert keep.is_dir() and list(keep.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_manifest_gets_the_permissions_of_a_new_file(umask, tmp_path):
    from trtgraph.compiler import pipeline

    old = os.umask(umask)
    try:
        pipeline.capture(tiny_config(), tmp_path / "art")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "art" / MANIFEST_NAME).stat().st_mode) == 0o666 & ~umask


# ---- item 11: numpy numbers through the Python API -----------------------------------------------

def test_numpy_numbers_are_accepted_or_refused_with_a_prompt_error():
    from trtgraph.runtime.serving.requests import parse_request

    req = parse_request({"id": np.int64(7), "prompt_token_ids": [np.int64(3), np.int32(4)], "max_tokens": np.int64(2),
                         "temperature": np.float32(0.5), "top_k": np.int16(5), "seed": np.uint32(9),
                         "stop": [np.int64(1)]}, "request 0")
    assert (req.id, req.prompt_token_ids, req.max_tokens, req.temperature, req.top_k, req.seed, req.stop_token_ids) \
        == ("7", (3, 4), 2, 0.5, 5, 9, (1,))
    assert all(type(t) is int for t in req.prompt_token_ids)
    assert parse_request({"id": "a", "prompt_token_ids": np.arange(3)}, "r").prompt_token_ids == (0, 1, 2)
    for bad, field in [({"prompt_token_ids": [np.bool_(True)]}, "prompt_token_ids"),
                       ({"prompt_token_ids": [np.int64(-1)]}, "prompt_token_ids"),
                       ({"prompt": "x", "max_tokens": np.float64(2.0)}, "max_tokens"),
                       ({"prompt": "x", "max_tokens": object()}, "max_tokens"),
                       ({"prompt": "x", "temperature": {1, 2}}, "temperature")]:
        with pytest.raises(PromptError, match=f"field `{field}`"):
            parse_request({"id": "a", **bad}, "request 0")


# ---- also: rows are checked where they enter the step buffers -------------------------------------

@pytest.fixture(scope="module")
def executor():
    from trtgraph.buckets import BucketPlan
    from trtgraph.runtime.step.executor import Executor

    cfg = tiny_config(kv_cache={"num_blocks": 40})
    return Executor.build(cfg, BucketPlan.from_config(cfg), torch.device("cpu"))


def _row(**changes):
    from trtgraph.runtime.step.executor import StepRow

    base = dict(token_ids=[5], start_pos=20, block_table=[3, 4])
    return StepRow(**{**base, **changes})


BAD_ROWS = [
    ("null-block-in-table", dict(block_table=[0, 4]), "block_table holds 0"),
    ("block-past-the-cache", dict(block_table=[3, 40]), "block_table holds 40"),
    ("negative-block", dict(block_table=[3, -2]), "block_table holds -2"),
    ("table-longer-than-a-sequence", dict(block_table=list(range(1, 19))), "block_table has 18 blocks"),
    ("table-too-short", dict(block_table=[3]), "block_table has 1 blocks"),
    ("negative-position", dict(start_pos=-1), "start_pos = -1"),
    ("position-past-max-seq-len", dict(start_pos=256, block_table=list(range(1, 17))), "start_pos = 256"),
    ("token-past-the-vocabulary", dict(token_ids=[320]), "token_ids holds 320"),
    ("negative-token", dict(token_ids=[-3]), "token_ids holds -3"),
]


@pytest.mark.parametrize("changes,needle", [c[1:] for c in BAD_ROWS], ids=[c[0] for c in BAD_ROWS])
def test_a_bad_row_is_refused_where_it_enters_the_step_buffers(executor, changes, needle):
    from trtgraph.buckets import GraphKey

    key = GraphKey(4, 0, 0, "greedy")
    with pytest.raises(ReplayMismatchError, match=r"row 1: " + needle.replace("(", r"\(")):
        executor.prepare(key, [_row(), _row(**changes)])
    executor.prepare(key, [_row(), _row()])  # the control: good rows pass


@pytest.mark.parametrize("entry,what", [((0, 2, 0), "block id"), ((0, 2, 40), "block id"), ((0, 16, 5), "column"),
                                        ((2, 2, 5), "row")])
def test_the_decode_fast_path_refuses_a_bad_new_block(executor, entry, what):
    from trtgraph.buckets import GraphKey

    key = GraphKey(4, 0, 0, "greedy")
    executor.prepare(key, [_row(), _row(block_table=[5, 6])])
    before = executor.buffers.ints.clone()
    with pytest.raises(ReplayMismatchError, match=f"its {what} outside"):
        executor.advance_decode(2, [entry])
    assert torch.equal(executor.buffers.ints, before)  # nothing was written


# ---- items 8 and 10 through real processes: signals, broken pipes, encodings ------------------------

def _cli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "trtgraph", *map(str, args)]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _default_sigint():  # a test run in a background job would otherwise pass SIGINT on ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _handles_sigterm(pid: int) -> bool:
    """True once the process has a SIGTERM handler installed (SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_exits_130(sig, default_artifacts, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_cli_cmd("run", "--prompts", write_prompts(tmp_path / "p.jsonl"), "--manifest",
                                     default_artifacts, "--output", out),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), preexec_fn=_default_sigint)
    try:
        # the command installs its handler first thing; the wait ends as soon as it has (5 s was once too
        # short on a loaded 2-core machine, most likely: one SIGINT case failed in session 17's full run)
        deadline = time.time() + 60
        while time.time() < deadline and not _handles_sigterm(proc.pid) and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Aborted!" not in err and "Traceback" not in err and "interrupted" in err


def test_a_closed_stdout_ends_the_run_quietly(default_artifacts, tmp_path):
    """`trtgraph run ... | head -1`: the reader goes away after one line."""
    proc = subprocess.Popen(_cli_cmd("run", "--prompts", write_prompts(tmp_path / "p.jsonl", n=32), "--manifest",
                                     default_artifacts), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert json.loads(first)["id"].startswith("r")
    assert proc.returncode == 141, (proc.returncode, err)
    assert "Traceback" not in err and "Exception ignored" not in err and "internal error" not in err


def test_a_closed_stderr_keeps_every_written_result_whole(default_artifacts, tmp_path):
    """`trtgraph run --output o.jsonl 2>&1 | head -1`: the reader of the progress and the
    summary goes away; the results file still holds every result, whole."""
    out = tmp_path / "o.jsonl"
    proc = subprocess.Popen(_cli_cmd("run", "--prompts", write_prompts(tmp_path / "p.jsonl", n=12), "--manifest",
                                     default_artifacts, "--output", out),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    try:
        proc.stderr.read(1)
        proc.stderr.close()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 141
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted(r["id"] for r in rows) == [f"r{i:03d}" for i in range(12)]


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_terminal_that_is_not_utf8_gets_valid_json_and_messages(encoding, default_artifacts, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    env = _env(PYTHONIOENCODING=encoding, LANG="C", LC_ALL="C")
    done = subprocess.run(_cli_cmd("run", "--prompts", prompts, "--manifest", default_artifacts),
                          capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    got = {r["id"]: (r["text"], r["token_ids"]) for r in map(json.loads, done.stdout.decode("ascii").splitlines())}
    want = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(default_artifacts)])
    assert got == {r["id"]: (r["text"], r["token_ids"]) for r in map(json.loads, want.stdout.splitlines())}
    assert any(ord(c) > 127 for text, _ in got.values() for c in text)  # the case is really exercised
    bad = tmp_path / "bad.jsonl"  # a message with characters the terminal cannot show
    bad.write_text('{"id": "a", "prompt": "x", "max_tokens": "ü✓"}\n', encoding="utf-8")
    done = subprocess.run(_cli_cmd("run", "--prompts", bad, "--manifest", default_artifacts),
                          capture_output=True, env=env, timeout=120)
    err = done.stderr.decode(encoding, errors="replace")
    assert done.returncode == 2 and "Traceback" not in err and "field `max_tokens`" in err, err


# ---- item 3: tensor-parallel ranks end with their launcher; only rank 0 writes ---------------------

@pytest.fixture(scope="module")
def tp_artifacts(tmp_path_factory):
    """A small plan (6 greedy keys) at tensor_parallel_size 2, captured with gloo on the CPU."""
    tmp = tmp_path_factory.mktemp("tp-artifacts")
    cfg = tiny_config(parallel={"tensor_parallel_size": 2}, kv_cache={"num_blocks": 40},
                      limits={"max_batch_size": 4, "max_seq_len": 128, "max_num_tokens": 64},
                      buckets={"context_batch_sizes": [1, 2, 4], "chunk_sizes": [16], "sampling": ["greedy"]})
    (tmp / "tp.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    res = CliRunner().invoke(main, ["capture", "--config", str(tmp / "tp.yaml"), "--out", str(tmp / "art")])
    assert res.exit_code == 0, res.output
    return tmp / "art"


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _holds_open(pid: int, path: Path) -> bool:
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    return any(os.path.realpath(fd) == str(path.resolve()) for fd in fds)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_tensor_parallel_ranks_end_with_their_launcher(sig, tp_artifacts, tmp_path):
    # max_seq_len is 128: prompts of up to 78 tokens + 48 new ones fit (none is refused)
    prompts, out = write_prompts(tmp_path / "p.jsonl", n=24, max_tokens=48), tmp_path / "out.jsonl"
    run = _cli_cmd("run", "--prompts", prompts, "--manifest", tp_artifacts, "--output", out)
    proc = subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    ranks: list[int] = []
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None and not (out.exists() and out.stat().st_size):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be stopped"
        ranks = [p for p in _children(proc.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(ranks) == 2
        assert not _holds_open(proc.pid, out)  # the launcher never writes results
        proc.send_signal(sig)
        proc.wait(timeout=120)
        err = proc.stderr.read().decode()
        deadline = time.time() + 30
        while time.time() < deadline and any(map(_running, ranks)):
            time.sleep(0.1)
        assert not any(map(_running, ranks)), "a rank outlived its launcher"
    finally:
        proc.kill()
        for p in ranks:
            if _running(p):
                os.kill(p, signal.SIGKILL)
    size = out.stat().st_size
    time.sleep(1)
    assert out.stat().st_size == size  # nobody writes any more
    if sig == signal.SIGTERM:
        assert proc.returncode == 130, err
        assert "interrupted: " in err and "Continue with --resume --output" in err and "Traceback" not in err
        return
    res = subprocess.run(run + ["--resume"], capture_output=True, env=_env(), timeout=500)
    assert res.returncode == 0, res.stderr.decode()
    ids = [json.loads(line)["id"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted(ids) == [f"r{i:03d}" for i in range(24)]
