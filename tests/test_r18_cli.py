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


# ---- config: what capture found only after loading, or after starting its ranks -----------------

def test_an_incomplete_synthetic_spec_names_the_config_file_and_line(tmp_path):
    """A synthetic spec without hidden_size was accepted on reading and refused by the capture
    as "model config: model.synthetic has no `hidden_size`", naming no file."""
    cfg = default_yaml(tmp_path / "m.yaml", lambda d: d["model"]["synthetic"].pop("hidden_size"))
    res = invoke("capture", "--config", cfg, "--out", tmp_path / "art")
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"{cfg} line {line_of(cfg, 'synthetic:')}: " in res.stderr, res.stderr
    assert "hidden_size" in res.stderr and "model config" not in res.stderr, res.stderr
    assert not (tmp_path / "art").exists()


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_a_config_error(tmp_path):
    """parallel.tensor_parallel_size 3 with 4 heads started three ranks, each failed, and the
    message named no file ("rank 2: model.synthetic: ..."), beside the tracebacks of the
    ranks the launcher stopped."""
    cfg = default_yaml(tmp_path / "m.yaml", lambda d: d.update(parallel={"tensor_parallel_size": 3}))
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(cfg, for_capture=True)
    msg = str(info.value)
    assert f"{cfg} line {line_of(cfg, 'tensor_parallel_size')}: " in msg, msg
    assert "num_attention_heads=4" in msg, msg
    res = invoke("capture", "--config", cfg, "--out", tmp_path / "art")
    assert res.exit_code == 2 and msg in res.stderr, (res.output, res.exception)
    assert not (tmp_path / "art").exists()


def test_a_checkpoint_whose_heads_the_tensor_parallel_size_does_not_divide(tmp_path):
    """The same for a checkpoint: its config.json is read with the config."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    hf = json.loads((ASSETS / "stdlib-llama" / "config.json").read_text(encoding="utf-8"))  # heads changed below
    hf.update(num_attention_heads=6, num_key_value_heads=6)
    (ckpt / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    cfg = tmp_path / "m.yaml"
    cfg.write_text("model: {path: ckpt}\ndevice: cpu\nparallel:\n  tensor_parallel_size: 4\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(cfg, for_capture=True)
    msg = str(info.value)
    assert f"{cfg} line 4: " in msg and "num_attention_heads=6" in msg, msg


@pytest.mark.parametrize("line,fragments", [
    ("speculative: false", ["speculative = False", "leave `speculative` out", "{}"]),
    ("speculative: true", ["speculative = True", "`speculative: {}`"]),
    ("model: ./ckpt", ["model = './ckpt'", "`model: {path: ./ckpt}`"]),
])
def test_a_section_given_as_a_scalar_says_what_to_write_instead(tmp_path, line, fragments):
    """`speculative: false` (meaning off) and `model: ./ckpt` (meaning a checkpoint) got
    "expected a mapping", and nothing on what to write."""
    key = line.split(":")[0]
    text = yaml.safe_dump({k: v for k, v in tiny_config().to_dict().items() if k != key}, sort_keys=False)
    cfg = tmp_path / "m.yaml"
    cfg.write_text(text + line + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(cfg)
    msg = str(info.value)
    assert f"{cfg} line {len(text.splitlines()) + 1}: " in msg and all(f in msg for f in fragments), msg


RANKS_FAIL = """
import sys
from pathlib import Path
from trtgraph.cli_ranks import capture_rank, on_ranks
from trtgraph.config import Config
from trtgraph.errors import TrtgraphError
if __name__ == "__main__":
    config = Config.from_yaml(sys.argv[1])  # not for_capture: the ranks find what the CLI would refuse first
    try:
        on_ranks(3, "cpu", capture_rank, config, Path(sys.argv[2]))
    except TrtgraphError as exc:
        print("refused:", exc)
"""


def test_ranks_stopped_after_another_rank_failed_print_no_tracebacks(tmp_path):
    """Every rank of a capture that failed on its ranks printed a KeyboardInterrupt traceback
    (the launcher's SIGTERM reached them in their exit handlers) under the one-line error."""
    import subprocess
    import sys

    cfg = default_yaml(tmp_path / "m.yaml", lambda d: d.update(parallel={"tensor_parallel_size": 3}))
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_FAIL, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, script, cfg, tmp_path / "art"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert "refused:" in proc.stdout and "does not divide" in proc.stdout, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr


@pytest.fixture
def ranks_stopped_mid_cleanup(monkeypatch):
    """The ranks' launcher replaced by one whose ranks made the output's Triton cache and were stopped
    before removing it, every time."""
    import trtgraph.cli as cli
    from trtgraph.errors import CaptureError

    def launch(world, device, fn, config, out):
        (out / "triton-cache").mkdir(parents=True)
        (out / "triton-cache" / "kernel.json").write_text("{}", encoding="utf-8")
        raise CaptureError("rank 1: failed")

    monkeypatch.setattr(cli, "on_ranks", launch)


def test_a_capture_that_fails_on_its_ranks_leaves_no_directory(tmp_path, ranks_stopped_mid_cleanup):
    """`--out a/b` of a capture whose ranks failed was at times left behind: each rank removes
    what it made, but the launcher stops the others mid-way (a rank that finds the directory
    still holding another rank's cache keeps it; that rank is stopped before it removes it).
    The ranks' launcher is replaced here by one that fails that way every time."""
    cfg = default_yaml(tmp_path / "m.yaml", lambda d: d.update(parallel={"tensor_parallel_size": 2}))
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "a" / "b", tmp_path / "kept" / "c"):
        res = invoke("capture", "--config", cfg, "--out", out)
        assert res.exit_code == 2 and "rank 1: failed" in res.stderr, (res.output, res.exception)
    assert not (tmp_path / "a").exists() and not (tmp_path / "kept" / "c").exists()
    assert (tmp_path / "kept").is_dir()


def test_an_unwritable_config_output_is_named_as_the_configs_not_as_out(tmp_path, monkeypatch):
    """Without --out, a config whose `output` is a file was refused as "the manifest (--out)
    .../manifest.json", naming an option the user never gave."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    cfg = default_yaml(tmp_path / "m.yaml", lambda d: d.update(output="afile"))
    res = invoke("capture", "--config", cfg)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "--out" not in res.stderr and f"`output` of {cfg}" in res.stderr, res.stderr


def test_summary_json_dash_redirected_into_the_results_or_prompts_is_refused(tmp_path, default_artifacts):
    """`--summary-json - > out.jsonl` with `--output out.jsonl` (or `>> prompts.jsonl`) would write
    the summary over the results (or into the prompts file): standard output is checked as an output."""
    import subprocess
    import sys

    prompts = write_lines(tmp_path / "p.jsonl", [REQUEST])
    before = (tmp_path / "p.jsonl").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    for target, mode, other in ((tmp_path / "out.jsonl", "wb", "--output"), (tmp_path / "p.jsonl", "ab", "--prompts")):
        with open(target, mode) as stdout:
            proc = subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", prompts, "--manifest",
                                   default_artifacts, "--output", tmp_path / "out.jsonl", "--summary-json", "-"],
                                  stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "--summary-json - (standard output)" in proc.stderr and other in proc.stderr, proc.stderr
    assert (tmp_path / "p.jsonl").read_bytes() == before


def test_a_config_or_prompts_file_given_as_the_manifest_says_what_it_is(tmp_path):
    """`--manifest model.yaml` said "not valid JSON ...; the file may be truncated. Recapture",
    and a prompts file "format_version null is not one this trtgraph reads": neither says the
    file is not a manifest at all, nor, for a config, to capture it first."""
    cfg = default_yaml(tmp_path / "m.yaml")
    res = invoke("inspect", cfg)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "a model config" in res.stderr and f"trtgraph capture --config {cfg}" in res.stderr, res.stderr
    assert "truncated" not in res.stderr, res.stderr
    prompts = write_lines(tmp_path / "p.jsonl", [REQUEST])
    res = invoke("run", "--prompts", prompts, "--manifest", prompts, "--output", tmp_path / "o.jsonl")
    assert res.exit_code == 2, (res.output, res.exception)
    assert "not a trtgraph manifest" in res.stderr and "format_version null" not in res.stderr, res.stderr


def test_run_with_model_on_a_synthetic_manifest_says_it_is_synthetic(default_artifacts, tmp_path):
    """`run --model DIR` on a manifest of generated weights: one sentence saying there is no checkpoint to move
    (was: a list of fingerprint differences against whatever DIR held)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x", "max_tokens": 2}\n', encoding="utf-8")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    res = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(default_artifacts),
                                    "--model", str(ckpt), "--output", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 2, res.output
    assert "synthetic" in res.output and "--model" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out.jsonl").exists()


def test_a_bench_whose_capture_fails_on_its_ranks_leaves_no_artifacts(tmp_path, ranks_stopped_mid_cleanup):
    """The same for `bench --config` (its capture goes to OUT/artifacts)."""
    cfg = default_yaml(tmp_path / "m.yaml", lambda d: d.update(parallel={"tensor_parallel_size": 2}))
    res = invoke("bench", "--config", cfg, "--out", tmp_path / "b", "--no-hf")
    assert res.exit_code == 2 and "rank 1: failed" in res.stderr, (res.output, res.exception)
    assert not (tmp_path / "b" / "artifacts").exists()
