"""Checkpoint loading: sharded checkpoints, every WeightLoadError case, and tokenizers.

Every error test checks the type (WeightLoadError) and that the message names the
culprit: the file, the tensor, or the config field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

try:
    from tests.hf_models import ARCHITECTURES, save_tiny
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from hf_models import ARCHITECTURES, save_tiny

from trtgraph.errors import WeightLoadError
from trtgraph.kernels import get_kernels
from trtgraph.models.loader import load_checkpoint
from trtgraph.models.tokenizer import ByteTokenizer, load_tokenizer
from oracle import EagerSequence

pytest.importorskip("transformers")

CPU = torch.device("cpu")
MAX_SEQ_LEN = 64
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PROMPT = [5, 17, 250, 3, 99, 42, 7, 123, 64, 1, 200, 8, 31, 77, 150, 299, 0, 12, 56, 88]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one intra-op thread (see conftest.one_torch_thread)."""


def load(path: Path, max_seq_len: int = MAX_SEQ_LEN):
    return load_checkpoint(path, "float32", CPU, max_seq_len, get_kernels())


def logits(loaded) -> torch.Tensor:
    return EagerSequence(loaded, len(PROMPT), block_size=8).prefill(PROMPT, chunk_size=7)


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A tiny unsharded Llama checkpoint that loads; never modified (tests copy it)."""
    path = tmp_path_factory.mktemp("pristine")
    save_tiny("LlamaForCausalLM", path)
    load(path)  # sanity: the baseline itself is fine
    return path


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    """A private, writable copy of the pristine checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


@pytest.fixture(scope="module")
def pristine_sharded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pristine_sharded")
    save_tiny("LlamaForCausalLM", path, max_shard_size="20KB")
    return path


@pytest.fixture
def sharded(pristine_sharded, tmp_path) -> Path:
    dst = tmp_path / "sharded"
    shutil.copytree(pristine_sharded, dst)
    return dst


def shard_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def edit_config(path: Path, **changes) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def resave(path: Path, edit) -> None:
    """Load the single-file state dict, let `edit(sd)` change it in place, write it back."""
    sd = load_file(str(path / WEIGHTS))
    edit(sd)
    save_file(sd, str(path / WEIGHTS), metadata={"format": "pt"})


def load_error(path: Path, max_seq_len: int = MAX_SEQ_LEN) -> str:
    with pytest.raises(WeightLoadError) as info:
        load(path, max_seq_len)
    return str(info.value)


# --------------------------------------------------------------------------- sharding

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sharded_checkpoint_matches_unsharded(arch, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    save_tiny(arch, single, seed=3)
    save_tiny(arch, multi, seed=3, max_shard_size="20KB")
    shards = shard_files(multi)
    assert len(shards) > 1
    assert (multi / INDEX).is_file() and not (multi / WEIGHTS).exists()
    index = json.loads((multi / INDEX).read_text())
    assert {p.name for p in shards} == set(index["weight_map"].values())

    a, b = load(single), load(multi)
    sd_a, sd_b = a.model.state_dict(), b.model.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for name in sd_a:
        assert torch.equal(sd_a[name], sd_b[name]), name
    assert torch.equal(logits(a), logits(b))
    assert [f["name"] for f in b.fingerprint["weight_files"]] == [p.name for p in shards]


def test_sharded_load_really_reads_every_shard(sharded):
    """Control for the test above: a different seed in one shard changes the logits."""
    base = logits(load(sharded))
    victim = next(p for p in shard_files(sharded) if "mlp.down_proj" in " ".join(load_file(str(p))))
    sd = load_file(str(victim))
    save_file({k: torch.randn_like(v) for k, v in sd.items()}, str(victim), metadata={"format": "pt"})
    assert not torch.allclose(logits(load(sharded)), base, atol=1e-3)


# --------------------------------------------------------------------------- files

def test_missing_directory(tmp_path):
    msg = load_error(tmp_path / "nowhere")
    assert "nowhere" in msg


def test_no_config_json(ckpt):
    (ckpt / "config.json").unlink()
    msg = load_error(ckpt)
    assert str(ckpt) in msg and "config.json" in msg


def test_config_json_not_json(ckpt):
    (ckpt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    msg = load_error(ckpt)
    assert str(ckpt / "config.json") in msg and "JSON" in msg


def test_config_json_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    msg = load_error(ckpt)
    assert str(ckpt / "config.json") in msg


def test_no_safetensors(ckpt):
    (ckpt / WEIGHTS).unlink()
    msg = load_error(ckpt)
    assert str(ckpt) in msg and "safetensors" in msg
    assert "pickle" not in msg  # no pickle hint when there is no pickle


def test_only_pytorch_bin_is_refused_not_unpickled(ckpt):
    sd = load_file(str(ckpt / WEIGHTS))
    (ckpt / WEIGHTS).unlink()
    torch.save(sd, ckpt / "pytorch_model.bin")
    msg = load_error(ckpt)
    assert "pytorch_model.bin" in msg
    assert "pickle" in msg and "safetensors" in msg


def test_truncated_safetensors(ckpt):
    f = ckpt / WEIGHTS
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = load_error(ckpt)
    assert str(f) in msg and "truncated" in msg


@pytest.mark.parametrize("where", ["header_length", "header_json"])
def test_corrupt_safetensors(ckpt, where):
    f = ckpt / WEIGHTS
    data = bytearray(f.read_bytes())
    if where == "header_length":  # the u64 header size now points past the end of the file
        data[0:8] = (1 << 40).to_bytes(8, "little")
    else:  # garbage inside the JSON header
        data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))
    msg = load_error(ckpt)
    assert str(f) in msg


def test_corrupt_shard_is_named(sharded):
    victim = shard_files(sharded)[1]
    victim.write_bytes(b"\x00" * 7)
    msg = load_error(sharded)
    assert str(victim) in msg
    assert all(str(p) not in msg for p in shard_files(sharded) if p != victim)


# --------------------------------------------------------------------------- tensors

def test_missing_tensor(ckpt):
    name = "model.layers.0.mlp.up_proj.weight"
    resave(ckpt, lambda sd: sd.pop(name))
    msg = load_error(ckpt)
    assert "missing" in msg and name in msg
    assert "unexpected" not in msg


def test_every_missing_tensor_is_listed(ckpt):
    names = ["model.layers.1.self_attn.v_proj.weight", "model.norm.weight", "lm_head.weight"]

    def drop(sd):
        for n in names:
            del sd[n]
    resave(ckpt, drop)
    msg = load_error(ckpt)
    assert all(n in msg for n in names)


def test_unexpected_tensor(ckpt):
    name = "model.layers.0.mlp.extra_proj.weight"
    resave(ckpt, lambda sd: sd.__setitem__(name, torch.zeros(4, 4)))
    msg = load_error(ckpt)
    assert "unexpected" in msg and name in msg
    assert "missing" not in msg


def test_tensor_of_a_layer_beyond_num_layers_is_unexpected(ckpt):
    name = "model.layers.2.input_layernorm.weight"
    resave(ckpt, lambda sd: sd.__setitem__(name, torch.ones(64)))
    msg = load_error(ckpt)
    assert name in msg


def test_rotary_inv_freq_is_ignored(ckpt, pristine):
    """Some checkpoints carry rotary_emb.inv_freq buffers; they are not weights."""
    resave(ckpt, lambda sd: sd.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    assert torch.equal(logits(load(ckpt)), logits(load(pristine)))


@pytest.mark.parametrize("name,shape", [
    ("model.layers.1.self_attn.k_proj.weight", (16, 64)),  # kv_size is 32
    ("model.layers.0.mlp.gate_proj.weight", (112, 63)),
    ("model.norm.weight", (65,)),
])
def test_misshaped_tensor(ckpt, name, shape):
    resave(ckpt, lambda sd: sd.__setitem__(name, torch.zeros(shape)))
    msg = load_error(ckpt)
    assert name in msg and str(tuple(shape)) in msg


@pytest.mark.parametrize("names,shapes", [
    (("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"), ((113, 64), (111, 64))),
    (("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"), ((80, 64), (16, 64))),
], ids=["gate_up", "q_k"])
def test_misshaped_fused_parts_with_right_total(ckpt, names, shapes):
    resave(ckpt, lambda sd: sd.update({n: torch.zeros(s) for n, s in zip(names, shapes)}))
    msg = load_error(ckpt)
    assert names[0] in msg


def test_integer_dtype_tensor(ckpt):
    name = "model.layers.0.input_layernorm.weight"
    resave(ckpt, lambda sd: sd.__setitem__(name, torch.ones(64, dtype=torch.int32)))
    msg = load_error(ckpt)
    assert name in msg and "int32" in msg


def test_half_precision_checkpoint_loads_into_fp32(ckpt, pristine):
    """A float dtype other than the target is converted, not refused."""
    resave(ckpt, lambda sd: sd.update({k: v.half() for k, v in sd.items()}))
    ours, ref = logits(load(ckpt)), logits(load(pristine))
    assert 0 < (ours - ref).abs().max().item() < 1e-2


# --------------------------------------------------------------------------- config

def test_unsupported_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    msg = load_error(ckpt)
    assert "GPT2LMHeadModel" in msg and "config.json" in msg


def test_no_architectures_field(ckpt):
    edit_config(ckpt, architectures=[])
    msg = load_error(ckpt)
    assert "architectures" in msg


def test_missing_required_field(ckpt):
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["intermediate_size"]
    cfg_path.write_text(json.dumps(cfg))
    msg = load_error(ckpt)
    assert "intermediate_size" in msg


def test_unsupported_rope_type(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    msg = load_error(ckpt)
    assert "yarn" in msg


def test_mistral_sliding_window_shorter_than_max_seq_len(tmp_path):
    save_tiny("MistralForCausalLM", tmp_path, sliding_window=32)
    msg = load_error(tmp_path, max_seq_len=64)
    assert "sliding_window=32" in msg and "64" in msg
    assert load(tmp_path, max_seq_len=32).config.architecture == "MistralForCausalLM"  # boundary accepted


def test_max_seq_len_above_max_position_embeddings(ckpt):
    # hf_models' tiny configs have max_position_embeddings=512
    msg = load_error(ckpt, max_seq_len=513)
    assert "max_position_embeddings=512" in msg and "513" in msg
    assert load(ckpt, max_seq_len=512).model.cos_sin.shape[0] == 512  # boundary accepted


# --------------------------------------------------------------------------- shard index

def test_shard_listed_but_missing(sharded):
    victim = shard_files(sharded)[2]
    victim.unlink()
    msg = load_error(sharded)
    assert victim.name in msg and "missing" in msg


def test_shard_outside_checkpoint_dir(sharded):
    index_path = sharded / INDEX
    index = json.loads(index_path.read_text())
    name, original = next(iter(index["weight_map"].items()))
    index["weight_map"][name] = "../x.safetensors"
    index_path.write_text(json.dumps(index))
    # The escapee exists and is a valid shard, so only the path check can refuse it.
    shutil.copy(sharded / original, sharded.parent / "x.safetensors")
    msg = load_error(sharded)
    assert "../x.safetensors" in msg and "outside" in msg


def test_shard_index_not_json(sharded):
    (sharded / INDEX).write_text("{not json")
    msg = load_error(sharded)
    assert INDEX in msg


def test_shard_index_without_weight_map(sharded):
    (sharded / INDEX).write_text(json.dumps({"metadata": {}}))
    msg = load_error(sharded)
    assert INDEX in msg and "weight_map" in msg


# --------------------------------------------------------------------------- tokenizer

TEXT = "Hello, wörld! ½ — 日本語 🚀\nnew line\ttab"


def test_byte_tokenizer_round_trips_utf8():
    tok = load_tokenizer(None, 320, None)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert len(ids) > len(TEXT)  # non-ASCII characters took several bytes
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == TEXT


def test_byte_tokenizer_bos_and_specials():
    tok = load_tokenizer(None, 320, 300)
    ids = tok.encode("añ")
    assert ids == [300, 97, 0xC3, 0xB1]
    assert tok.decode(ids + [310]) == "añ"  # ids >= 256 are skipped
    # a bos that is a byte, or outside the vocabulary, is not prepended
    assert load_tokenizer(None, 320, 65).encode("a") == [97]
    assert load_tokenizer(None, 320, 320).encode("a") == [97]


def test_byte_tokenizer_needs_256_ids():
    with pytest.raises(WeightLoadError, match="vocab_size"):
        load_tokenizer(None, 200, None)


def test_checkpoint_without_tokenizer_json_falls_back_to_bytes(pristine):
    assert not (pristine / "tokenizer.json").exists()
    tok = load_tokenizer(pristine, 300, None)
    assert isinstance(tok, ByteTokenizer)
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_checkpoint_tokenizer_json_is_used(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path, 300, None)
    assert not isinstance(tok, ByteTokenizer)
    assert tok.encode("hello world") == [1, 2]


def test_unreadable_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(WeightLoadError) as info:
        load_tokenizer(tmp_path, 300, None)
    assert "tokenizer.json" in str(info.value)
