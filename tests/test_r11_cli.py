"""The eleventh session's adversarial pass over the command line and its files (`run`,
`capture`, `inspect`, prompts / batch files, outputs, --resume). Each test failed before its fix."""

from __future__ import annotations

import json

from click.testing import CliRunner

from trtgraph.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


# ---- --resume with another prompts file ---------------------------------------------------

def test_resume_refuses_an_output_of_another_prompts_file(default_artifacts, tmp_path):
    """It appended this file's results to the other file's, and said "2 requests already in"."""
    first = write_jsonl(tmp_path / "first.jsonl", [{"id": i, "prompt": "hi", "max_tokens": 2} for i in (1, 2)])
    out = tmp_path / "out.jsonl"
    assert invoke("run", "--prompts", first, "--manifest", default_artifacts, "--output", out).exit_code == 0
    before = out.read_bytes()
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": "a", "prompt": "hi", "max_tokens": 2}])
    r = invoke("run", "--prompts", other, "--manifest", default_artifacts, "--output", out, "--resume")
    assert r.exit_code == 2, r.output
    assert f"{out} line 1: a result for id '1', which {other} does not hold" in r.output
    assert "Traceback" not in r.output and out.read_bytes() == before
    # the same file, a line more: only the new id runs
    more = write_jsonl(tmp_path / "first.jsonl", [{"id": i, "prompt": "hi", "max_tokens": 2} for i in (1, 2, 3)])
    r = invoke("run", "--prompts", more, "--manifest", default_artifacts, "--output", out, "--resume")
    assert r.exit_code == 0, r.output
    assert [row["id"] for row in read_jsonl(out)] == ["1", "2", "3"]


# ---- two runs writing one output ------------------------------------------------------------

def test_a_second_run_on_an_output_being_written_is_refused(default_artifacts, tmp_path):
    """Two runs on one --output both truncated and appended: interleaved, cut and lost lines
    (61 lines for 64 requests, one not JSON), both exit 0."""
    import fcntl

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": "hi", "max_tokens": 2} for i in ("z", "a")])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "z", "text": "", "token_ids": [], "finish_reason": "length"}\n')
    before = out.read_bytes()
    with open(out, "ab") as holder:  # what the first run holds while it writes
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        for extra in ((), ("--resume",)):
            r = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, *extra)
            assert r.exit_code == 2, r.output
            assert f"--output {out}: another process" in r.output and "choose another path" in r.output
            assert out.read_bytes() == before
    r = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert r.exit_code == 0, r.output  # the lock goes with the run that held it
    assert [row["id"] for row in read_jsonl(out)] == ["z", "a"]


def test_a_run_that_fails_before_serving_leaves_no_output_file(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi", "max_tokens": 2}])
    r = invoke("run", "--prompts", prompts, "--manifest", tmp_path / "no-artifacts", "--output", tmp_path / "o.jsonl")
    assert r.exit_code == 2 and not (tmp_path / "o.jsonl").exists()


# ---- byte order marks and bytes that are not UTF-8 -----------------------------------------

def test_a_prompts_file_with_a_byte_order_mark_is_read(default_artifacts, tmp_path):
    """model.yaml with a BOM was read; a prompts file with one was refused as not JSON
    ("Unexpected UTF-8 BOM (decode using utf-8-sig)")."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"id": 1, "prompt": "hi", "max_tokens": 2}\r\n{"id": 2, "prompt": "yo"}\r\n')
    out = tmp_path / "out.jsonl"
    r = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out)
    assert r.exit_code == 0, r.output
    assert [row["id"] for row in read_jsonl(out)] == ["1", "2"]


def test_a_config_that_is_not_utf8_names_the_line(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_bytes(b"dtype: float32\ndevice: cpu  # \xff\n")
    r = invoke("capture", "--config", cfg, "--out", tmp_path / "art")
    assert r.exit_code == 2, r.output
    assert f"{cfg} line 2: not valid UTF-8 (byte 15 of the line); save the file as UTF-8." in r.output


# ---- a summary file that does not take the summary ------------------------------------------

def test_a_summary_json_that_cannot_be_written_exits_2_with_every_result_kept(default_artifacts, tmp_path):
    """It was an internal error (exit 1) after every result was written."""
    import os

    import pytest

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": "hi", "max_tokens": 2} for i in (1, 2)])
    out = tmp_path / "out.jsonl"
    r = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--summary-json", "/dev/full")
    assert r.exit_code == 2, r.output
    assert "--summary-json /dev/full: writing failed (No space left on device); every result was written" in r.output
    assert [row["id"] for row in read_jsonl(out)] == ["1", "2"]


# ---- the prompts file given as standard input ----------------------------------------------

def test_an_output_that_is_the_prompts_file_given_on_standard_input_is_refused(tmp_path):
    """`--prompts - --output p.jsonl < p.jsonl` read the prompts, then replaced them with the results."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "hi", "max_tokens": 2}])
    before = Path(prompts).read_bytes()
    (tmp_path / "link.jsonl").symlink_to(prompts)
    root = Path(__file__).resolve().parents[1]
    for output in (prompts, tmp_path / "link.jsonl"):
        with open(prompts, "rb") as stdin:
            p = subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", "-", "--manifest",
                                str(tmp_path / "unused"), "--output", str(output)], stdin=stdin, capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
        assert p.returncode == 2, p.stderr
        assert f"is the same file as the prompts file (--prompts -, standard input) {prompts}" in p.stderr
        assert Path(prompts).read_bytes() == before


# ---- an option given as "" (an unset shell variable) ----------------------------------------

def test_an_empty_config_or_out_or_manifest_is_refused_not_read_as_the_default(tmp_path, monkeypatch):
    """`capture --config ""` captured the embedded default into the config's default `output`
    (trtgraph-artifacts), over the manifest of the model meant; `--manifest ""` served the current
    directory's manifest."""
    monkeypatch.chdir(tmp_path)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "hi", "max_tokens": 2}])
    for args, option in ((("capture", "--config", ""), "--config"), (("capture", "--out", " "), "--out"),
                         (("bench", "--config", "", "--prompts", "0"), "--config"),
                         (("run", "--prompts", prompts, "--manifest", ""), "--manifest"), (("inspect", ""), "PATH")):
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        assert f"{option} is empty; give " in r.output, r.output
    assert list(tmp_path.iterdir()) == [tmp_path / "p.jsonl"]  # nothing captured, nothing written
