"""Checkpoints as people run them: a Hugging Face cache snapshot through `model: {hub: ...}`
offline, `limits.max_seq_len: auto` from the model, artifacts whose checkpoint moved, and
tensor parallelism on a vocabulary the rank count does not divide."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner

from trtgraph.cli import main
from trtgraph.config import Config
from trtgraph.errors import ConfigError

from hf_models import save_tiny

PROMPTS = [{"id": f"r{i}", "prompt_token_ids": list(range(10 + i, 30 + 2 * i)), "max_tokens": 6 + i,
            "temperature": 0} for i in range(3)]
SMALL_PLAN = {"limits": {"max_batch_size": 2, "max_seq_len": 64, "max_num_tokens": 64},
              "buckets": {"batch_sizes": [1, 2], "context_batch_sizes": [1], "chunk_sizes": [32],
                          "sampling": ["greedy"]}}


def _yaml(path, model: dict, **sections) -> str:
    body = {"model": model, "device": "cpu", "dtype": "float32", **sections}
    path.write_text(yaml.safe_dump(body))
    return str(path)


def _capture(cfg_path, out) -> dict:
    res = CliRunner().invoke(main, ["capture", "--config", cfg_path, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "manifest.json").read_text())


def _run(art, tmp_path, *extra) -> tuple[int, str, dict]:
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / f"out-{art.name}.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    res = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(art), "--output", str(out),
                                    *extra])
    tokens = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
    return res.exit_code, res.output, tokens


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache laid out as huggingface_hub lays it out: one snapshot of org/tiny."""
    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    save_tiny("LlamaForCausalLM", snapshot)
    (snapshot / "generation_config.json").write_text(json.dumps({"eos_token_id": [5], "do_sample": False}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache, snapshot


def test_a_hub_snapshot_serves_offline_as_the_same_files_by_path(hub_cache, tmp_path, monkeypatch,
                                                                  one_torch_thread):
    cache, snapshot = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    by_hub = _capture(_yaml(tmp_path / "hub.yaml", {"hub": "org/tiny", "revision": "main"}, **SMALL_PLAN),
                      tmp_path / "hub-art")
    by_path = _capture(_yaml(tmp_path / "path.yaml", {"path": str(snapshot)}, **SMALL_PLAN), tmp_path / "path-art")
    assert by_hub["model"]["hub"] == {"repo": "org/tiny", "revision": "main", "snapshot": snapshot.name}
    assert by_hub["config"]["model"] == {"hub": "org/tiny", "revision": "main"}
    names = {f["name"] for f in by_hub["model"]["files"]}
    assert {"config.json", "generation_config.json"} <= names
    assert by_hub["model"]["weight_files"] == by_path["model"]["weight_files"]
    assert by_hub["model"]["generation_config"]["eos_token_ids"] == [5]
    code_hub, out_hub, tokens_hub = _run(tmp_path / "hub-art", tmp_path)
    code_path, out_path, tokens_path = _run(tmp_path / "path-art", tmp_path)
    assert code_hub == 0 and code_path == 0, out_hub + out_path
    assert tokens_hub == tokens_path and len(tokens_hub) == len(PROMPTS)


def test_a_missing_snapshot_names_the_cache_searched(tmp_path, monkeypatch):
    from trtgraph.models.loader import checkpoint_dir

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = Config.from_dict({"model": {"hub": "org/absent"}}).model
    assert source.revision == "main"
    with pytest.raises(ConfigError, match=rf"model.hub = 'org/absent' .*cache {tmp_path}.*HF_HUB_OFFLINE"):
        checkpoint_dir(source)


@pytest.mark.parametrize("model", [{"hub": "a b"}, {"hub": "org/x", "path": "y"}, {"path": "y", "revision": "v1"}])
def test_bad_hub_sections_are_config_errors(model):
    with pytest.raises(ConfigError, match="model"):
        Config.from_dict({"model": model})


def test_max_position_embeddings_512_captures_with_no_limits_section(tmp_path, one_torch_thread):
    ckpt = tmp_path / "ckpt"
    save_tiny("Qwen2ForCausalLM", ckpt, max_position_embeddings=512)
    buckets = {"batch_sizes": [1, 64], "context_batch_sizes": [1], "chunk_sizes": [64, 1024], "sampling": ["greedy"]}
    cfg = _yaml(tmp_path / "c.yaml", {"path": str(ckpt)}, buckets=buckets)
    assert "limits" not in yaml.safe_load(open(cfg))
    res = CliRunner().invoke(main, ["capture", "--config", cfg, "--out", str(tmp_path / "art")])
    assert res.exit_code == 0, res.output
    assert "limits.max_seq_len auto = 512 (the max_position_embeddings of" in res.output
    assert "chunk sizes [1024] are longer and left out of the plan" in res.output
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["limits"]["max_seq_len"] == 512 and manifest["config"]["buckets"]["chunk_sizes"] == [64]
    # the KV cache lowers it: 20 blocks hold one sequence of 19 * 16 tokens
    cfg = _yaml(tmp_path / "kv.yaml", {"path": str(ckpt)}, buckets={**buckets, "batch_sizes": [1, 8]},
                limits={"max_batch_size": 8}, kv_cache={"num_blocks": 20})
    res = CliRunner().invoke(main, ["capture", "--config", cfg, "--out", str(tmp_path / "art-kv")])
    assert res.exit_code == 0, res.output
    assert "lowered to 304: the KV cache holds 19 blocks of 16 tokens" in res.output
    assert json.loads((tmp_path / "art-kv" / "manifest.json").read_text())["limits"]["max_seq_len"] == 304


def test_artifacts_whose_checkpoint_moved_serve_with_model(tmp_path, one_torch_thread):
    ckpt = tmp_path / "ckpt"
    save_tiny("LlamaForCausalLM", ckpt)
    art = tmp_path / "art"
    _capture(_yaml(tmp_path / "c.yaml", {"path": str(ckpt)}, **SMALL_PLAN), art)
    code, out, before = _run(art, tmp_path)
    assert code == 0, out
    moved = tmp_path / "elsewhere" / "ckpt"
    shutil.move(str(ckpt), str(moved))
    res = CliRunner().invoke(main, ["inspect", str(art)])
    assert res.exit_code == 0 and "generation" in res.output, res.output
    code, out, _ = _run(art, tmp_path)
    assert code == 2 and "config.model.path" in out and "--model PATH" in out, out
    code, out, after = _run(art, tmp_path, "--model", str(moved))
    assert code == 0, out
    assert after == before
    (moved / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))  # a different checkpoint
    code, out, _ = _run(art, tmp_path, "--model", str(moved))
    assert code == 2 and "model.files[generation_config.json]" in out, out


def test_a_start_hashes_only_files_whose_size_or_time_changed(tmp_path, one_torch_thread, monkeypatch):
    """The sha256 of a checkpoint file is taken from the manifest while its size and
    modification time match; a file rewritten since is hashed (and refused if it differs);
    `inspect --check` hashes everything."""
    import os

    from trtgraph.models import loader

    ckpt = tmp_path / "ckpt"
    save_tiny("LlamaForCausalLM", ckpt)
    art = tmp_path / "art"
    body = _capture(_yaml(tmp_path / "c.yaml", {"path": str(ckpt)}, **SMALL_PLAN), art)
    assert all(isinstance(w["mtime_ns"], int) for w in body["model"]["weight_files"] + body["model"]["files"])
    hashed = []
    real = loader.file_sha256
    monkeypatch.setattr(loader, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    code, out, _ = _run(art, tmp_path)
    assert code == 0, out
    assert hashed == [], "a start re-hashed files whose size and time match the manifest"
    res = CliRunner().invoke(main, ["inspect", str(art), "--check"])
    assert res.exit_code == 0, res.output
    assert sorted(hashed) == sorted(w["name"] for w in body["model"]["weight_files"] + body["model"]["files"])
    hashed.clear()
    config = ckpt / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same bytes, a new time
    code, out, _ = _run(art, tmp_path)
    assert code == 0, out
    assert hashed == ["config.json"]


# ---- tensor parallelism on a vocabulary of 301 over 2 ranks ---------------------------------

def _logits(tp, path):
    from test_parallel import _forward

    return _forward(tp, "checkpoint", path)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])  # untied and tied LM heads
def test_an_odd_vocabulary_is_padded_per_rank(arch, tmp_path):
    from trtgraph.models.parallel import TPGroup
    from trtgraph.runtime.distributed import launch

    save_tiny(arch, tmp_path, vocab_size=301)
    want, _ = _logits(TPGroup(), str(tmp_path))
    got, _ = launch(2, _logits, str(tmp_path), use_cuda=False)
    want, got = torch.tensor(want), torch.tensor(got)
    assert got.shape == want.shape and got.shape[-1] == 301  # padded logits are cut off, never sampled
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
