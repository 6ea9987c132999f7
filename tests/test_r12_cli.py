"""The twelfth session's adversarial pass over `capture`, `inspect` and `bench` (CPU, static
backend, tiny configs written to YAML). Each test failed before its fix."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from conftest import tiny_config
from trtgraph.cli import main
from trtgraph.config import Config


def invoke(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def write_config(path, **changes) -> str:
    path.write_text(yaml.safe_dump(tiny_config(**changes).to_dict()), encoding="utf-8")
    return str(path)


# ---- capture --out: a manifest.json that is not trtgraph's ------------------------------------

def test_capture_refuses_to_overwrite_a_manifest_json_of_another_tool(tmp_path):
    """`--out` at a browser extension's (or web app's) directory replaced its manifest.json."""
    cfg = write_config(tmp_path / "m.yaml")
    ext = tmp_path / "extension"
    ext.mkdir()
    theirs = '{"manifest_version": 3, "name": "My extension", "version": "1.0"}\n'
    (ext / "manifest.json").write_text(theirs, encoding="utf-8")
    res = invoke("capture", "--config", cfg, "--out", ext)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "manifest.json" in res.stderr and "not a trtgraph manifest" in res.stderr, res.stderr
    assert "Traceback" not in res.output
    assert (ext / "manifest.json").read_text(encoding="utf-8") == theirs
    assert not (ext / "triton-cache").exists()


def test_capture_still_replaces_a_damaged_trtgraph_manifest(tmp_path):
    """The control: a truncated trtgraph manifest is what a recapture is for."""
    cfg = write_config(tmp_path / "m.yaml")
    art = tmp_path / "art"
    assert invoke("capture", "--config", cfg, "--out", art).exit_code == 0
    text = (art / "manifest.json").read_text(encoding="utf-8")
    (art / "manifest.json").write_text(text[:200], encoding="utf-8")
    res = invoke("capture", "--config", cfg, "--out", art)
    assert res.exit_code == 0, (res.output, res.exception)
    assert json.loads((art / "manifest.json").read_text(encoding="utf-8"))["digest"]


# ---- output: ~/... ------------------------------------------------------------------------------

def test_a_config_output_under_the_home_directory_is_not_a_directory_named_tilde(tmp_path, monkeypatch):
    """`output: ~/art` made a directory named `~` in the current directory (model.path expands ~)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cfg = write_config(tmp_path / "m.yaml", output="~/art")
    assert Config.from_yaml(cfg).output == str(home / "art")


# ---- bench --attention-batch / --attention-context past memory ---------------------------------

def test_bench_attention_options_past_memory_name_the_options(default_artifacts, tmp_path, monkeypatch):
    """An --attention-context the host cannot hold blamed the capture ("capture a smaller plan
    (kv_cache.num_blocks, ...)"), not the options that sized the allocation."""
    import trtgraph.bench

    def no_memory(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 25600008192 bytes.")

    monkeypatch.setattr(trtgraph.bench, "attention_alone", no_memory)
    res = invoke("bench", "--manifest", default_artifacts, "--out", tmp_path / "b", "--context-len", 0,
                 "--prompts", 0, "--mixed", 0, "--no-hf", "--attention-batch", 1,
                 "--attention-context", 10000000)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "--attention-context 10000000" in res.stderr and "capture a smaller plan" not in res.stderr, res.stderr
    assert "Traceback" not in res.output


# ---- empty path options (an unset shell variable) -----------------------------------------------

EMPTY = [
    (["bench", "--manifest", "", "--out", "{tmp}/b"], "--manifest is empty"),  # read the current directory's manifest
    (["bench", "--manifest", "{art}", "--out", ""], "--out is empty"),  # wrote bench.* into the current directory
    (["bench", "--manifest", "{art}", "--config", "", "--out", "{tmp}/b"], "--config is empty"),  # ignored
    (["serve", "--manifest", ""], "--manifest is empty"),  # served the current directory's manifest
    (["serve", "--manifest", "{art}", "--model", ""], "--model is empty"),
    (["run", "--prompts", "{tmp}/p.jsonl", "--manifest", "{art}", "--model", ""], "--model is empty"),
]


@pytest.mark.parametrize("args,says", EMPTY, ids=[" ".join(a[:3]) + "..." + says for a, says in EMPTY])
def test_an_empty_path_option_is_refused_not_read_as_the_current_directory(args, says, default_artifacts, tmp_path,
                                                                          monkeypatch):
    import trtgraph.bench
    import trtgraph.server.app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "hi", "max_tokens": 2}\n', encoding="utf-8")
    monkeypatch.setattr(trtgraph.bench, "run_bench", lambda *a, **k: pytest.fail("bench started"))
    monkeypatch.setattr(trtgraph.server.app, "serve", lambda *a, **k: pytest.fail("serve started"))
    res = invoke(*[a.format(tmp=tmp_path, art=default_artifacts) for a in args])
    assert res.exit_code == 2, (res.output, res.exception)
    assert says in res.stderr, res.stderr


# ---- forged manifests (digest recomputed) that inspect passed ------------------------------------

def forge(default_artifacts, tmp_path, edit):
    import shutil

    from trtgraph.artifacts import _digest

    art = tmp_path / "art"
    shutil.copytree(default_artifacts, art)
    body = json.loads((art / "manifest.json").read_text(encoding="utf-8"))
    edit(body)
    body["digest"] = _digest(body)
    (art / "manifest.json").write_text(json.dumps(body), encoding="utf-8")
    return art


FORGED = {
    # inspect and inspect --check passed it ("this machine matches"); only a run's start refused it
    "warmup-key-not-a-key": (lambda b: b["totals"].__setitem__("warmup_keys", ["(bs=99, decode draft=0, greedy)"]),
                             "totals.warmup_keys"),
    # a run refused it telling the user to "move the file away": the manifest itself
    "triton-cache-is-the-manifest": (lambda b: b["paths"].__setitem__("triton_cache", "manifest.json"),
                                     "paths.triton_cache"),
    "triton-cache-is-the-directory": (lambda b: b["paths"].__setitem__("triton_cache", "."), "paths.triton_cache"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_manifest_inspect_passed_is_refused_by_inspect_and_check(case, default_artifacts, tmp_path):
    edit, field = FORGED[case]
    art = forge(default_artifacts, tmp_path, edit)
    for args in (["inspect", art], ["inspect", art, "--check"]):
        res = invoke(*args)
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert field in res.stderr and "Move the file away" not in res.stderr, res.stderr
    assert (art / "manifest.json").is_file()


# ---- a failed capture into --out a/b/c ----------------------------------------------------------------

def test_a_failed_capture_removes_the_parent_directories_it_created(tmp_path):
    """Only the innermost directory was removed: `--out a/b/c` left a/b behind."""
    cfg = write_config(tmp_path / "m.yaml", kv_cache={"block_size": 4096, "num_blocks": 2})  # fails at start-up
    res = invoke("capture", "--config", cfg, "--out", tmp_path / "a" / "b" / "c")
    assert res.exit_code == 2, (res.output, res.exception)
    assert "kv_cache.num_blocks" in res.stderr, res.stderr
    assert not (tmp_path / "a").exists()


def test_a_failed_capture_keeps_parent_directories_that_were_there(tmp_path):
    cfg = write_config(tmp_path / "m.yaml", kv_cache={"block_size": 4096, "num_blocks": 2})
    (tmp_path / "a").mkdir()
    assert invoke("capture", "--config", cfg, "--out", tmp_path / "a" / "b").exit_code == 2
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a" / "b").exists()


# ---- inspect --check on a checkpoint that moved ----------------------------------------------------

def test_inspect_check_on_a_moved_checkpoint_reports_a_difference(tmp_path):
    """It exited 2 with "ckpt: checkpoint directory does not exist." (no advice; --check's
    promise is exit 3 naming what differs), while plain `inspect` works wherever the checkpoint is."""
    from hf_models import save_tiny

    save_tiny("LlamaForCausalLM", tmp_path / "ckpt")
    cfg = tmp_path / "m.yaml"
    cfg.write_text("model: {path: ./ckpt}\ndtype: float32\ndevice: cpu\n"
                   "limits: {max_batch_size: 1, max_seq_len: 64, max_num_tokens: 16}\n"
                   "kv_cache: {block_size: 16, num_blocks: 8}\n"
                   "buckets: {batch_sizes: [1], context_batch_sizes: [1], chunk_sizes: [16], sampling: [greedy]}\n",
                   encoding="utf-8")
    art = tmp_path / "art"
    assert invoke("capture", "--config", cfg, "--out", art).exit_code == 0
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    assert invoke("inspect", art).exit_code == 0
    res = invoke("inspect", art, "--check")
    assert res.exit_code == 3, (res.output, res.exception)
    assert "config.model.path" in res.output and str(tmp_path / "ckpt") in res.output and "absent" in res.output
    res = invoke("inspect", art, "--check", "--json")
    assert res.exit_code == 3 and json.loads(res.output)["check"]["ok"] is False


# ---- bench options past any sensible bound -----------------------------------------------------------

HUGE = [("--attention-context", "4611686018427387904"),  # internal error: "Storage size calculation overflowed"
        ("--attention-batch", "100000000000"),
        ("--prompts", "1000000000000"),  # built a list of 10**12 requests before the run
        ("--mixed", "1000000000000")]


@pytest.mark.parametrize("option,value", HUGE, ids=[o for o, _ in HUGE])
def test_bench_options_past_their_bounds_exit_2_before_any_work(option, value, default_artifacts, tmp_path,
                                                                 monkeypatch):
    import trtgraph.bench

    monkeypatch.setattr(trtgraph.bench.Engine, "__init__", lambda *a, **k: pytest.fail("bench started"))
    res = invoke("bench", "--manifest", default_artifacts, "--out", tmp_path / "b", option, value)
    assert res.exit_code == 2, (res.output, res.exception)
    assert option in res.stderr and "not in the range" in res.stderr, res.stderr


# ---- --config that exists but is not a file ---------------------------------------------------------

def test_a_config_that_is_a_fifo_is_not_called_missing(tmp_path):
    """`--config <(envsubst < m.yaml)` (a pipe) was refused as "no such config file"."""
    import os

    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    res = invoke("capture", "--config", fifo, "--out", tmp_path / "art")
    assert res.exit_code == 2, (res.output, res.exception)
    assert "not a regular file" in res.stderr and "no such config file" not in res.stderr, res.stderr
