"""Adversarial checkpoints (eleventh session, R11d): damaged safetensors, shard indexes and
tokenizer_config.json. Every case is refused with WeightLoadError naming the file and the
tensor or field, never a traceback or a silently different model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

try:
    from tests.hf_models import save_tiny
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from hf_models import save_tiny
from test_weights import ckpt, pristine  # noqa: F401  (fixtures: a tiny Llama checkpoint and a private copy)

from trtgraph.errors import WeightLoadError
from trtgraph.kernels import get_kernels
from trtgraph.models.chat import load_chat_template
from trtgraph.models.loader import load_checkpoint

pytest.importorskip("transformers")

CPU = torch.device("cpu")
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one intra-op thread (see conftest.one_torch_thread)."""


def load(path: Path):
    return load_checkpoint(path, "float32", CPU, 64, get_kernels())


def test_a_tensor_in_two_files_is_refused_not_picked_silently(ckpt):
    """A stray shard holding a copy of a tensor (zeros here) was loaded over the real one:
    the last file in name order won, silently serving other weights."""
    real = load_file(ckpt / WEIGHTS)[DOWN]
    save_file({DOWN: torch.zeros_like(real)}, str(ckpt / "zz-stray.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=rf"zz-stray.safetensors: tensor {DOWN} is also in .*model.safetensors"):
        load(ckpt)


def test_a_shard_index_listing_two_files_with_one_tensor_is_refused(ckpt):
    sd = load_file(ckpt / WEIGHTS)
    save_file({DOWN: torch.zeros_like(sd[DOWN])}, str(ckpt / "extra.safetensors"), metadata={"format": "pt"})
    weight_map = {n: WEIGHTS for n in sd}
    weight_map[DOWN] = "extra.safetensors"
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(WeightLoadError, match=rf"tensor {DOWN} is also in"):
        load(ckpt)
    # the index names the stray file for nothing: it is not read, the model loads
    weight_map[DOWN] = WEIGHTS
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    load(ckpt)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(ckpt, value):
    """A NaN or inf in a weight loaded, and every token after it was garbage (argmax of NaN)."""
    sd = load_file(ckpt / WEIGHTS)
    sd[DOWN][3, 5] = value
    save_file(sd, str(ckpt / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=rf"NaN or infinite values in {DOWN} \(in model.safetensors\); "
                                              r"the checkpoint is corrupt"):
        load(ckpt)


def test_a_chat_template_list_with_an_unhashable_name_is_a_weight_load_error(ckpt):
    """[{"name": ["x"], ...}] in tokenizer_config.json raised TypeError (unhashable type)."""
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": ["x"], "template": "a"}]}))
    with pytest.raises(WeightLoadError, match=r"tokenizer_config.json: chat_template lists templates .* none named "
                                              r"'default'"):
        load_chat_template(ckpt)


def test_a_generation_config_top_k_past_the_request_bound_names_generation_config(ckpt):
    """top_k 10**30 in generation_config.json was accepted at capture; every request that
    omitted top_k then failed at run with `SamplingParams: field top_k`, blaming the request."""
    from trtgraph.models.loader import read_generation_config

    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 10**30}))
    with pytest.raises(WeightLoadError, match=r"generation_config.json: `top_k` = 10{30}; expected an integer in "
                                              r"\[0, 16777216\]"):
        read_generation_config(ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 1 << 24}))
    assert read_generation_config(ckpt).top_k == 1 << 24


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
@pytest.mark.parametrize("body", ["[" * 100_000, '{"bos_token": ' + "9" * 5000 + ', "chat_template": "x"'],
                         ids=["nested", "huge-int"])
def test_hostile_tokenizer_json_files_are_weight_load_errors(ckpt, name, body):
    """Nesting past Python's recursion limit raised RecursionError, and a 5000-digit integer
    (when the file is otherwise invalid) ValueError: tracebacks, not a message naming the file."""
    from trtgraph.models.tokenizer import load_tokenizer

    if name == "special_tokens_map.json":
        (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x"}))
    (ckpt / name).write_text(body)
    with pytest.raises(WeightLoadError, match=rf"{name}: not valid JSON"):
        load_chat_template(ckpt)
    if name == "tokenizer_config.json":  # the tokenizer reads it too
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(ckpt / "tokenizer.json"))
        with pytest.raises(WeightLoadError, match=rf"{name}: not valid JSON"):
            load_tokenizer(ckpt, 300, None)


@pytest.mark.parametrize("archs", [5, True, {"LlamaForCausalLM": 1}], ids=["int", "bool", "object"])
def test_architectures_of_a_wrong_type_is_exit_2_naming_config_json(ckpt, tmp_path, archs):
    """`architectures: 5` (or true, or an object) in config.json, max_seq_len auto: position_limit
    indexed it before the config was checked (TypeError / KeyError: `internal error`, exit 1)."""
    import yaml
    from click.testing import CliRunner

    from trtgraph.cli import main

    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": archs}))
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(yaml.safe_dump({"model": {"path": str(ckpt)}, "device": "cpu", "dtype": "float32",
                                          "limits": {"max_batch_size": 1, "max_seq_len": "auto", "max_num_tokens": 64},
                                          "buckets": {"batch_sizes": [1], "context_batch_sizes": [1],
                                                      "chunk_sizes": [32], "sampling": ["greedy"]}}))
    res = CliRunner().invoke(main, ["capture", "--config", str(model_yaml), "--out", str(tmp_path / "art")])
    assert res.exit_code == 2, res.output
    assert "config.json" in res.output and "architectures" in res.output, res.output


@pytest.mark.parametrize("cls", [["LlamaTokenizer"], {"name": "x"}], ids=["list", "object"])
def test_a_tokenizer_class_that_is_not_a_string_is_a_weight_load_error(ckpt, cls):
    """tokenizer_config.json `tokenizer_class: [...]` raised TypeError (unhashable type)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from trtgraph.models.tokenizer import load_tokenizer

    Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    with pytest.raises(WeightLoadError, match=r"tokenizer_config.json: tokenizer_class = .*; expected a tokenizer "
                                              r"class name \(a string\)"):
        load_tokenizer(ckpt, 300, None)


def test_weights_past_float16s_range_are_refused_at_dtype_float16(ckpt):
    """A finite 1e5 in an fp32 checkpoint became inf when loaded as float16: inf logits, garbage
    tokens. Refused naming the tensor and the dtypes that hold it."""
    sd = load_file(ckpt / WEIGHTS)
    sd[DOWN][1, 2] = 1e5
    save_file(sd, str(ckpt / WEIGHTS), metadata={"format": "pt"})
    load(ckpt)  # float32 holds it
    with pytest.raises(WeightLoadError, match=rf"{DOWN} hold values too large for torch.float16 .*; load this "
                                              r"checkpoint with dtype bfloat16 or float32"):
        load_checkpoint(ckpt, "float16", CPU, 64, get_kernels())


def test_a_sharded_hub_snapshot_whose_files_link_into_blobs_loads(tmp_path, monkeypatch, one_torch_thread):
    """huggingface_hub's cache holds a snapshot's files as symlinks to ../../blobs/<hash>. The
    shard index check resolved them and refused every sharded snapshot: "shard ... lies outside
    the checkpoint directory"."""
    import hashlib
    import os

    import yaml
    from click.testing import CliRunner

    from trtgraph.cli import main

    repo = tmp_path / "cache" / "models--org--sharded"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    save_tiny("LlamaForCausalLM", snapshot, max_shard_size="20KB")
    blobs.mkdir()
    for f in list(snapshot.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, blobs / digest)
        os.symlink(Path("../../blobs") / digest, f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert (snapshot / INDEX).is_symlink()
    loaded = load(snapshot)  # by path
    assert [w["name"] for w in loaded.fingerprint["weight_files"]][0] == "model-00001-of-00014.safetensors"

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(yaml.safe_dump({"model": {"hub": "org/sharded"}, "device": "cpu", "dtype": "float32",
                                          "limits": {"max_batch_size": 1, "max_seq_len": 64, "max_num_tokens": 64},
                                          "buckets": {"batch_sizes": [1], "context_batch_sizes": [1],
                                                      "chunk_sizes": [32], "sampling": ["greedy"]}}))
    res = CliRunner().invoke(main, ["capture", "--config", str(model_yaml), "--out", str(tmp_path / "art")])
    assert res.exit_code == 0, res.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 3}) + "\n")
    res = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(tmp_path / "art"),
                                    "--output", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 0, res.output
    assert len(json.loads((tmp_path / "out.jsonl").read_text())["token_ids"]) == 3
