"""The eighteenth session's adversarial pass over the command line and its files (`capture`,
`run`, the config YAML, output paths). CPU, static backend, tiny configs. Each test failed
before its fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import tiny_config
from trtgraph.cli import main
from trtgraph.config import Config
from trtgraph.errors import ConfigError

ASSETS = Path(__file__).parents[1] / "trtgraph" / "assets"
REQUEST = {"id": "a", "prompt": "hi", "max_tokens": 4}


def invoke(*args, **kwargs):
    return CliRunner().invoke(main, [*map(str, args)], **kwargs)


def write_lines(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def default_yaml(path, edit=None) -> str:
    """The embedded default config (on the CPU) as a YAML file, `edit(dict)` applied first."""
    d = tiny_config().to_dict()
    if edit:
        edit(d)
    path.write_text(yaml.safe_dump(d, sort_keys=False), encoding="utf-8")
    return str(path)


def line_of(path, text: str) -> int:
    return next(n for n, line in enumerate(open(path, encoding="utf-8"), start=1) if text in line)


# ---- run: empty path options and `--summary-json -` --------------------------------------------

@pytest.mark.parametrize("option", ["--prompts", "--output", "--summary-json"])
def test_an_empty_run_path_option_is_refused_by_name(tmp_path, default_artifacts, option):
    """`--prompts ""` said "error: : cannot read the prompts file"; `--output ""` and
    `--summary-json ""` were read as the current directory ("--output .: is a directory")."""
    prompts = write_lines(tmp_path / "p.jsonl", [REQUEST])
    args = {"--prompts": prompts, "--manifest": default_artifacts, option: ""}
    res = invoke("run", *[x for kv in args.items() for x in kv])
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"{option} is empty" in res.output, res.output
    assert "Traceback" not in res.output


def test_summary_json_dash_is_standard_output_not_a_file_named_dash(tmp_path, default_artifacts, monkeypatch):
    """`--output -` and `--prompts -` are the standard streams, but `--summary-json -` wrote a
    file named `-` in the current directory."""
    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [REQUEST])
    res = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", tmp_path / "out.jsonl",
                 "--summary-json", "-")
    assert res.exit_code == 0, (res.output, res.exception)
    assert not (tmp_path / "-").exists()
    summary = json.loads(res.stdout)
    assert summary["requests"] == 1 and summary["completion_tokens"] == 4
    assert len((tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()) == 1


def test_summary_json_and_results_both_on_standard_output_are_refused(tmp_path, default_artifacts, monkeypatch):
    """The indented summary would land in the middle of the JSONL results."""
    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [REQUEST])
    for extra in ([], ["--output", "-"]):
        res = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--summary-json", "-", *extra)
        assert res.exit_code == 2, (res.output, res.exception)
        assert "--summary-json -" in res.output and "--output" in res.output, res.output
    assert not (tmp_path / "-").exists()


# ---- run: an OpenAI batch body refused on reading counts in the summary ------------------------

def test_a_batch_body_refused_on_reading_counts_as_a_refused_request(tmp_path, default_artifacts):
    """The summary said "0 requests (0 refused)" (and the summary JSON the same) for a batch
    file whose one line got a 400 in the output; a body refused at admission was counted."""
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 4, "best_of": 3}}
    ok = {**line, "custom_id": "y", "body": {"prompt": "hi", "max_tokens": 4}}
    prompts = write_lines(tmp_path / "b.jsonl", [line, ok])
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    res = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out,
                 "--summary-json", summary)
    assert res.exit_code == 0, (res.output, res.exception)
    s = json.loads(summary.read_text(encoding="utf-8"))
    assert (s["requests"], s["refused"]) == (2, 1), s
    assert "2 requests (1 refused)" in res.stderr, res.stderr
    resumed = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume",
                     "--summary-json", summary)
    assert resumed.exit_code == 0, (resumed.output, resumed.exception)
    s = json.loads(summary.read_text(encoding="utf-8"))
    assert (s["requests"], s["refused"]) == (0, 0), s  # both were written by the first run


# ---- output paths --------------------------------------------------------------------------------

def test_a_dangling_output_link_names_the_missing_directory_it_points_into(tmp_path, default_artifacts,
                                                                        monkeypatch):
    """`--output link` (link -> /missing/dir/x.jsonl) said "the directory . does not exist"."""
    monkeypatch.chdir(tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [REQUEST])
    os.symlink(tmp_path / "missing" / "x.jsonl", tmp_path / "link")
    res = invoke("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", "link")
    assert res.exit_code == 2, (res.output, res.exception)
    assert str(tmp_path / "missing") in res.output and "directory . " not in res.output, res.output
