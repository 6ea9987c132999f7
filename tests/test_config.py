"""model.yaml parsing and validation (trtgraph/config.py).

Every ConfigError test checks the error type, the key path, the offending value and,
for YAML files, the file name and the line of the offending key.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from trtgraph.config import AUTO, BucketConfig, Config, KVCacheConfig, Limits, ModelSource
from trtgraph.errors import ConfigError, TrtgraphError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "llama-3.2-1b-synthetic.yaml"

MODEL_SYNTHETIC = """\
model:
  synthetic:
    architecture: LlamaForCausalLM
    hidden_size: 64
    num_hidden_layers: 2
    seed: 7
"""

REST = """\
dtype: float16
device: cpu
limits:
  max_batch_size: 8
  max_seq_len: 256
  max_num_tokens: 256
kv_cache:
  block_size: 16
  num_blocks: 40
buckets:
  batch_sizes: [1, 2, 4, 8]
  context_batch_sizes: [1, 2, 4]
  chunk_sizes: [16, 64]
  draft_lens: [0, 1]
  sampling: [greedy, sampled]
output: out/artifacts
"""

BASE = MODEL_SYNTHETIC + REST


# ---- helpers ---------------------------------------------------------------------------

def write(tmp_path: Path, text: str, name: str = "model.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def edit(text: str, old: str, new: str) -> str:
    """Replace one whole line (must occur exactly once) so line numbers stay meaningful."""
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if ln.rstrip("\n") == old]
    assert len(hits) == 1, f"test bug: {old!r} occurs {len(hits)} times"
    lines[hits[0]] = new + "\n"
    return "".join(lines)


def line_of(text: str, needle: str) -> int:
    """1-based line number of the only line containing `needle` (computed independently of trtgraph)."""
    hits = [i + 1 for i, ln in enumerate(text.splitlines()) if needle in ln]
    assert len(hits) == 1, f"test bug: {needle!r} on lines {hits}"
    return hits[0]


def load_error(tmp_path: Path, text: str, name: str = "model.yaml") -> tuple[Path, str]:
    path = write(tmp_path, text, name)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    assert isinstance(info.value, TrtgraphError)
    return path, str(info.value)


def assert_line(msg: str, path: Path, n: int):
    assert path.name in msg, msg
    got = re.findall(r"\bline (\d+)", msg)
    assert got == [str(n)], f"expected line {n} in: {msg}"


def without_source(cfg: Config) -> dict:
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    d.pop("source")
    return d


# ---- the shipped configs ---------------------------------------------------------------

def test_embedded_default_parses():
    cfg = Config.default()
    assert cfg.source == "<embedded default>"
    assert cfg.model.is_synthetic and cfg.model.path is None
    assert cfg.model.synthetic["architecture"] == "LlamaForCausalLM"
    assert cfg.model.synthetic["seed"] == 0
    assert cfg.dtype == "float32"
    assert cfg.device == "auto"
    assert cfg.limits == Limits(max_batch_size=8, max_seq_len=256, max_num_tokens=256)
    assert cfg.kv_cache == KVCacheConfig(block_size=16, num_blocks=AUTO)
    assert cfg.buckets == BucketConfig(batch_sizes=AUTO, context_batch_sizes=AUTO, chunk_sizes=(16, 64),
                                       draft_lens=(0,), sampling=("greedy", "sampled"))
    assert cfg.output == "trtgraph-artifacts"


def test_example_llama_parses():
    cfg = Config.from_yaml(EXAMPLE)
    assert cfg.source == str(EXAMPLE)
    assert cfg.model.is_synthetic
    syn = cfg.model.synthetic
    assert syn["hidden_size"] == 2048 and syn["num_hidden_layers"] == 16 and syn["vocab_size"] == 128256
    assert syn["rope_scaling"]["rope_type"] == "llama3"
    assert syn["tie_word_embeddings"] is True
    assert cfg.dtype == "bfloat16" and cfg.device == "cuda"
    assert cfg.limits == Limits(max_batch_size=64, max_seq_len=2048, max_num_tokens=8192)
    assert cfg.buckets.chunk_sizes == (64, 256, 512)
    assert cfg.output == "trtgraph-artifacts/llama-3.2-1b-synthetic"


@pytest.fixture
def checkpoint_config(tmp_path) -> Config:
    (tmp_path / "ckpt").mkdir()
    text = edit(BASE, "  max_num_tokens: 256", "  max_num_tokens: 300")
    text = "model:\n  path: ckpt\n" + text[len(MODEL_SYNTHETIC):]
    return Config.from_yaml(write(tmp_path, text))


@pytest.mark.parametrize("which", ["default", "example", "full", "checkpoint"])
def test_to_dict_round_trips(which, tmp_path, request):
    if which == "default":
        cfg = Config.default()
    elif which == "example":
        cfg = Config.from_yaml(EXAMPLE)
    elif which == "full":
        cfg = Config.from_yaml(write(tmp_path, BASE))
    else:
        cfg = request.getfixturevalue("checkpoint_config")
    d = cfg.to_dict()
    assert "source" not in d
    assert set(d) == {"model", "dtype", "device", "kernels", "deterministic", "limits", "kv_cache", "buckets", "output", "parallel"}
    again = Config.from_dict(d)
    assert without_source(again) == without_source(cfg)
    assert again.source == "<dict>"
    # the dict is plain data: it survives a YAML dump (the manifest stores it) and parses back
    text = yaml.safe_dump(d, sort_keys=False)
    assert without_source(Config.from_text(text, source="manifest")) == without_source(cfg)


def test_to_dict_uses_plain_lists_and_omits_unset_model_field():
    d = Config.default().to_dict()
    assert d["model"].keys() == {"synthetic"}
    assert d["buckets"]["batch_sizes"] == "auto"
    assert d["buckets"]["context_batch_sizes"] == "auto"
    for k in ("chunk_sizes", "draft_lens", "sampling"):
        assert isinstance(d["buckets"][k], list), k
    assert d["limits"] == {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 256}


# ---- a full valid file ------------------------------------------------------------------

def test_full_yaml_parses_to_expected_values(tmp_path):
    path = write(tmp_path, BASE)
    cfg = Config.from_yaml(path)
    expected = Config(
        model=ModelSource(synthetic={"architecture": "LlamaForCausalLM", "hidden_size": 64,
                                     "num_hidden_layers": 2, "seed": 7}),
        dtype="float16",
        device="cpu",
        limits=Limits(max_batch_size=8, max_seq_len=256, max_num_tokens=256),
        kv_cache=KVCacheConfig(block_size=16, num_blocks=40),
        buckets=BucketConfig(batch_sizes=(1, 2, 4, 8), context_batch_sizes=(1, 2, 4), chunk_sizes=(16, 64),
                             draft_lens=(0, 1), sampling=("greedy", "sampled")),
        output="out/artifacts",
        source=str(path),
    )
    assert cfg == expected
    assert cfg.source == str(path)


def test_omitted_keys_take_documented_defaults():
    cfg = Config.from_dict({"model": {"synthetic": {"architecture": "LlamaForCausalLM"}}})
    assert cfg.dtype == "bfloat16"
    assert cfg.device == "auto"
    assert cfg.limits == Limits(64, "auto", 8192)
    assert cfg.kv_cache == KVCacheConfig(16, "auto")
    assert cfg.buckets == BucketConfig()
    assert cfg.output == "trtgraph-artifacts"


def test_relative_model_path_resolves_against_yaml_directory(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "configs"
    (cfg_dir / "ckpt").mkdir(parents=True)
    # a decoy at the same relative path from the working directory must not be picked
    cwd = tmp_path / "cwd"
    (cwd / "ckpt").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    text = "model:\n  path: ckpt\n" + REST
    cfg = Config.from_yaml(write(cfg_dir, text))
    assert cfg.model.path == str((cfg_dir / "ckpt").resolve())
    assert not cfg.model.is_synthetic and cfg.model.synthetic is None


def test_relative_model_path_with_parent_dir(tmp_path):
    (tmp_path / "weights" / "llama").mkdir(parents=True)
    text = "model:\n  path: ../weights/llama\n" + REST
    cfg = Config.from_yaml(write(tmp_path / "configs", text))
    assert cfg.model.path == str((tmp_path / "weights" / "llama").resolve())


def test_absolute_model_path_is_kept(tmp_path):
    ckpt = tmp_path / "abs-ckpt"
    ckpt.mkdir()
    text = f"model:\n  path: {ckpt}\n" + REST
    cfg = Config.from_yaml(write(tmp_path / "elsewhere", text))
    assert cfg.model.path == str(ckpt.resolve())


def test_smallest_num_blocks_is_one_max_seq_len_sequence_plus_null_block(tmp_path):
    text = edit(BASE, "  num_blocks: 40", "  num_blocks: 17")  # 256 / 16 = 16 blocks + block 0
    assert Config.from_yaml(write(tmp_path, text)).kv_cache.num_blocks == 17


def test_max_num_tokens_may_equal_max_batch_size(tmp_path):
    text = edit(BASE, "  max_num_tokens: 256", "  max_num_tokens: 8")
    text = edit(text, "  chunk_sizes: [16, 64]", "  chunk_sizes: [2]")
    text = edit(text, "  draft_lens: [0, 1]", "  draft_lens: [0]")
    cfg = Config.from_yaml(write(tmp_path, text))
    assert cfg.limits.max_num_tokens == cfg.limits.max_batch_size == 8


def test_chunk_may_equal_max_seq_len_and_fill_max_num_tokens(tmp_path):
    text = edit(BASE, "  chunk_sizes: [16, 64]", "  chunk_sizes: [16, 256]")
    text = edit(text, "  context_batch_sizes: [1, 2, 4]", "  context_batch_sizes: [1]")
    cfg = Config.from_yaml(write(tmp_path, text))
    assert cfg.buckets.chunk_sizes == (16, 256)  # 1 * 256 == max_num_tokens


@pytest.mark.parametrize("old,new,field_path,expected", [
    ("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: auto", "buckets.batch_sizes", "auto"),
    ("  block_size: 16", "  block_size: 8", "kv_cache.block_size", 8),
    ("  block_size: 16", "  block_size: 64", "kv_cache.block_size", 64),
    ("  num_blocks: 40", "  num_blocks: auto", "kv_cache.num_blocks", "auto"),
    ("device: cpu", "device: cuda", "device", "cuda"),
    ("dtype: float16", "dtype: bfloat16", "dtype", "bfloat16"),
    ("  sampling: [greedy, sampled]", "  sampling: [sampled]", "buckets.sampling", ("sampled",)),
])
def test_other_valid_values(tmp_path, old, new, field_path, expected):
    obj = Config.from_yaml(write(tmp_path, edit(BASE, old, new)))
    for part in field_path.split("."):
        obj = getattr(obj, part)
    assert obj == expected


def test_block_size_must_cover_max_seq_len_num_blocks_rounds_up(tmp_path):
    # max_seq_len 250 with blocks of 16 needs ceil(250/16) = 16 blocks + the null block
    text = edit(BASE, "  max_seq_len: 256", "  max_seq_len: 250")
    text = edit(text, "  num_blocks: 40", "  num_blocks: 17")
    assert Config.from_yaml(write(tmp_path, text)).kv_cache.num_blocks == 17
    text = edit(text, "  num_blocks: 17", "  num_blocks: 16")
    path, msg = load_error(tmp_path, text)
    assert "kv_cache.num_blocks = 16" in msg and "at least 17" in msg


# ---- the ConfigError corpus -------------------------------------------------------------

def test_malformed_yaml_names_line_and_column(tmp_path):
    text = BASE.replace("  chunk_sizes: [16, 64]\n", "  chunk_sizes: [16, 64\n")
    path, msg = load_error(tmp_path, text, "broken.yaml")
    assert "broken.yaml" in msg
    assert "not valid YAML" in msg
    # the parser trips over the next key, on the line after the unclosed bracket
    m = re.search(r"line (\d+), column (\d+)", msg)
    assert m, msg
    assert int(m.group(1)) == line_of(text, "draft_lens:")
    assert int(m.group(2)) == len("  draft_lens") + 1


def test_malformed_yaml_bad_indentation(tmp_path):
    text = BASE.replace("    hidden_size: 64\n", "   hidden_size: 64\n")
    path, msg = load_error(tmp_path, text)
    assert path.name in msg and "not valid YAML" in msg
    m = re.search(r"line (\d+), column (\d+)", msg)
    assert m and int(m.group(1)) == line_of(text, "hidden_size")


def test_unknown_top_level_key_lists_valid_keys(tmp_path):
    text = BASE + "outptu: somewhere\n"
    path, msg = load_error(tmp_path, text)
    assert "unknown key outptu" in msg
    for key in ("model", "dtype", "device", "limits", "kv_cache", "buckets", "output"):
        assert key in msg.split("valid keys", 1)[1], key
    assert_line(msg, path, line_of(text, "outptu"))


def test_unknown_nested_key(tmp_path):
    text = edit(BASE, "  max_batch_size: 8", "  max_batchsize: 8")
    path, msg = load_error(tmp_path, text)
    assert "limits.max_batchsize" in msg
    valid = msg.split("valid keys", 1)[1]
    assert "under limits" in valid
    for key in ("max_batch_size", "max_seq_len", "max_num_tokens"):
        assert key in valid, key
    assert_line(msg, path, line_of(text, "max_batchsize"))


def test_unknown_keys_plural_under_buckets(tmp_path):
    text = edit(BASE, "  draft_lens: [0, 1]", "  draft_len: [0, 1]")
    text = edit(text, "  sampling: [greedy, sampled]", "  samplng: [greedy, sampled]")
    path, msg = load_error(tmp_path, text)
    assert "unknown keys" in msg
    assert "buckets.draft_len" in msg and "buckets.samplng" in msg
    assert "batch_sizes, chunk_sizes, context_batch_sizes, draft_lens, sampling" in msg
    assert_line(msg, path, line_of(text, "draft_len:"))  # the first one, sorted


# (old line, new line, key path, offending value as it must appear, extra fragment expected)
CORPUS = [
    pytest.param("  max_batch_size: 8", '  max_batch_size: "64"', "limits.max_batch_size", "'64'", "integer",
                 id="string-as-int"),
    pytest.param("  max_seq_len: 256", "  max_seq_len: true", "limits.max_seq_len", "True", "integer",
                 id="bool-as-int"),
    pytest.param("  max_batch_size: 8", "  max_batch_size: true", "limits.max_batch_size", "True", "integer",
                 id="bool-as-int-in-range"),  # True == 1 would pass a plain range check
    pytest.param("  max_batch_size: 8", "  max_batch_size: 8.0", "limits.max_batch_size", "8.0", "integer",
                 id="float-as-int"),
    pytest.param("dtype: float16", "dtype: fp8", "dtype", "'fp8'", "bfloat16", id="dtype-fp8"),
    pytest.param("device: cpu", "device: tpu", "device", "'tpu'", "cuda", id="device-tpu"),
    pytest.param("  sampling: [greedy, sampled]", "  sampling: greedy", "buckets.sampling", "'greedy'", "list",
                 id="sampling-not-a-list"),
    pytest.param("  sampling: [greedy, sampled]", "  sampling: [beam]", "buckets.sampling[0]", "'beam'", "sampled",
                 id="sampling-beam"),
    pytest.param("  sampling: [greedy, sampled]", "  sampling: [greedy, greedy]", "buckets.sampling",
                 "['greedy', 'greedy']", "repeated", id="sampling-repeated"),
    pytest.param("  block_size: 16", "  block_size: 12", "kv_cache.block_size", "12", "power of two",
                 id="block-size-not-pow2"),
    pytest.param("  chunk_sizes: [16, 64]", "  chunk_sizes: [16, 512]", "buckets.chunk_sizes[1]", "512",
                 "limits.max_seq_len (256)", id="chunk-above-max-seq-len"),
    pytest.param("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: [1, 2, 4, 16]", "buckets.batch_sizes[3]", "16",
                 "limits.max_batch_size (8)", id="batch-above-max-batch"),
    pytest.param("  context_batch_sizes: [1, 2, 4]", "  context_batch_sizes: [1, 9]",
                 "buckets.context_batch_sizes[1]", "9", "limits.max_batch_size (8)", id="context-above-max-batch"),
    pytest.param("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: [0, 8]", "buckets.batch_sizes[0]", "0", ">= 1",
                 id="batch-size-zero"),
    pytest.param("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: []", "buckets.batch_sizes", "[]", "non-empty",
                 id="batch-sizes-empty"),
    pytest.param("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: [1, true]", "buckets.batch_sizes[1]", "True",
                 "integer", id="batch-sizes-bool"),
    pytest.param("  max_batch_size: 8", "  max_batch_size: 0", "limits.max_batch_size", "0", "[1, 4096]",
                 id="max-batch-zero"),
    pytest.param("  num_blocks: 40", "  num_blocks: 16", "kv_cache.num_blocks", "16", "at least 17",
                 id="num-blocks-too-small"),
    pytest.param("  num_blocks: 40", "  num_blocks: 1", "kv_cache.num_blocks", "1", "'auto'",
                 id="num-blocks-one"),
    pytest.param("  num_blocks: 40", "  num_blocks: lots", "kv_cache.num_blocks", "'lots'", "'auto'",
                 id="num-blocks-word"),
    pytest.param("  max_num_tokens: 256", "  max_num_tokens: 7", "limits.max_num_tokens", "7",
                 "limits.max_batch_size (8)", id="max-num-tokens-below-max-batch"),
    pytest.param("  chunk_sizes: [16, 64]", "  chunk_sizes: [16, 128]", "buckets.chunk_sizes", "[16, 128]",
                 "= 512 tokens", id="context-times-chunk-above-max-num-tokens"),
    pytest.param("  draft_lens: [0, 1]", "  draft_lens: [1, 2]", "buckets.draft_lens", "[1, 2]", "includes 0",
                 id="draft-lens-without-zero"),
    pytest.param("  draft_lens: [0, 1]", "  draft_lens: [0, 32]", "buckets.draft_lens", "[0, 32]",
                 "= 264 tokens", id="draft-times-batch-above-max-num-tokens"),
    pytest.param("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: [1, 2, 2, 8]", "buckets.batch_sizes",
                 "[1, 2, 2, 8]", "repeated", id="duplicated-batch-sizes"),
    pytest.param("    seed: 7", "    seed: -1", "model.synthetic.seed", "-1", "non-negative",
                 id="negative-seed"),
    pytest.param("output: out/artifacts", "output: 12", "output", "12", "directory", id="output-not-a-string"),
    pytest.param("limits:", "limits: 8", "limits", "8", "mapping", id="limits-not-a-mapping"),
]


@pytest.mark.parametrize("old,new,key,value,fragment", CORPUS)
def test_config_error_corpus(tmp_path, old, new, key, value, fragment):
    text = edit(BASE, old, new)
    if new == "limits: 8":  # drop the now-orphaned children of limits
        text = text.replace("  max_batch_size: 8\n  max_seq_len: 256\n  max_num_tokens: 256\n", "")
    path, msg = load_error(tmp_path, text, "bad-model.yaml")
    assert f"{key} = {value} is not allowed" in msg, msg
    assert fragment in msg, msg
    assert "bad-model.yaml" in msg
    line = line_of(text, new.strip())
    assert_line(msg, path, line)


@pytest.mark.parametrize("old,new,key,value,fragment", CORPUS[:3])
def test_config_error_from_dict_has_source_but_no_line(old, new, key, value, fragment):
    data = yaml.safe_load(edit(BASE, old, new))
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data, source="in-memory")
    msg = str(info.value)
    assert msg.startswith("in-memory: ")
    assert f"{key} = {value}" in msg
    assert "line" not in msg


def test_error_for_default_valued_key_has_no_line(tmp_path):
    # chunk_sizes is not in the file: its default (64, 256, 512) exceeds max_seq_len=256
    text = BASE.replace("  chunk_sizes: [16, 64]\n", "")
    path, msg = load_error(tmp_path, text)
    assert "buckets.chunk_sizes[2] = 512" in msg
    assert path.name in msg
    assert not re.search(r"\bline \d+", msg), msg


# ---- the model section ------------------------------------------------------------------

def test_model_with_neither_path_nor_synthetic(tmp_path):
    text = "model: {}\n" + REST
    path, msg = load_error(tmp_path, text)
    assert "model = [] is not allowed" in msg
    assert "exactly one of `path`, `hub` or `synthetic`" in msg
    assert_line(msg, path, 1)


def test_model_with_both_path_and_synthetic(tmp_path):
    (tmp_path / "ckpt").mkdir()
    text = "# a comment first\nmodel:\n  path: ckpt\n  synthetic: {seed: 0}\n" + REST
    path, msg = load_error(tmp_path, text)
    assert "model = ['path', 'synthetic'] is not allowed" in msg
    assert "exactly one" in msg
    assert_line(msg, path, 2)


def test_model_path_that_does_not_exist(tmp_path):
    text = "model:\n  path: ./no-such-ckpt\n" + REST
    path, msg = load_error(tmp_path, text)
    assert "model.path = './no-such-ckpt' is not allowed" in msg
    assert str(tmp_path / "no-such-ckpt") in msg  # the resolved place it looked
    assert_line(msg, path, 2)


def test_model_path_that_is_a_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    text = "model:\n  path: weights.bin\n" + REST
    path, msg = load_error(tmp_path, text)
    assert "model.path = 'weights.bin'" in msg
    assert_line(msg, path, 2)


def test_model_synthetic_must_be_a_mapping(tmp_path):
    text = "model:\n  synthetic: llama\n" + REST
    path, msg = load_error(tmp_path, text)
    assert "model.synthetic = 'llama' is not allowed" in msg
    assert_line(msg, path, 2)


def test_unknown_key_under_model(tmp_path):
    text = "model:\n  synthetic: {seed: 0}\n  hub_id: meta-llama/Llama-3.2-1B\n" + REST
    path, msg = load_error(tmp_path, text)
    assert "unknown key model.hub_id" in msg and "hub, path, revision, synthetic" in msg
    assert_line(msg, path, 3)


def test_config_file_that_does_not_exist(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(missing)
    msg = str(info.value)
    assert "nowhere.yaml" in msg and "no such config file" in msg


def test_config_path_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        Config.from_yaml(tmp_path)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"], ids=["empty", "blank", "comment"])
def test_empty_file_means_model_missing(tmp_path, text):
    path, msg = load_error(tmp_path, text, "empty.yaml")
    assert "empty.yaml" in msg
    assert "model = None is not allowed" in msg
    assert "`path`" in msg and "`synthetic`" in msg
    assert not re.search(r"\bline \d+", msg), msg


def test_top_level_must_be_a_mapping(tmp_path):
    path, msg = load_error(tmp_path, "- model\n- dtype\n")
    assert "<top level> = ['model', 'dtype'] is not allowed" in msg
    assert "mapping" in msg and path.name in msg


# ---- BucketConfig `auto` batch sizes ------------------------------------------------------

@pytest.mark.parametrize("max_bs,expected", [
    (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
    (20, (1, 2, 4, 8, 16, 20)),
    (8, (1, 2, 4, 8)),
    (9, (1, 2, 4, 8, 9)),
    (4, (1, 2, 4)),
    (3, (1, 2, 3)),
    (1, (1,)),
])
def test_auto_batch_sizes(max_bs, expected):
    sizes = BucketConfig().generation_batch_sizes(max_bs)
    assert sizes == expected
    assert sizes[-1] == max_bs
    assert list(sizes) == sorted(set(sizes))
    assert all(1 <= b <= max_bs for b in sizes)


def test_auto_batch_sizes_for_max_20_include_16_and_20():
    sizes = BucketConfig().generation_batch_sizes(20)
    assert 16 in sizes and 20 in sizes and max(sizes) == 20


def test_explicit_batch_sizes_are_used_as_given():
    assert BucketConfig(batch_sizes=(1, 3, 5)).generation_batch_sizes(64) == (1, 3, 5)


def test_auto_resolves_against_limits_in_a_parsed_config(tmp_path):
    text = edit(BASE, "  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: auto")
    text = edit(text, "  max_batch_size: 8", "  max_batch_size: 20")
    cfg = Config.from_yaml(write(tmp_path, text))
    assert cfg.buckets.batch_sizes == "auto"
    assert cfg.buckets.generation_batch_sizes(cfg.limits.max_batch_size) == (1, 2, 4, 8, 16, 20)
