"""Issue 11, inputs: YAML, model configs, JSON and forged manifests that used to exhaust
memory or the stack, end in a traceback (exit 1), die mid-run, or be accepted silently.

Each table row feeds one hostile input through the public entry point (Config.from_text,
ModelConfig.from_hf, read_prompts, load_manifest) and asserts the typed error and the
culprit named in its message; a few rows go through the real CLI for the exit code.
docs/reliability.md lists every row with its exit code and message.

The alias bombs are sized to trip the guard (more than 10,000 nodes once expanded) while
an unguarded load still finishes in well under a second, so a regression fails the test
instead of eating the machine's memory.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtgraph.artifacts import _digest, load_manifest
from trtgraph.cli import main
from trtgraph.config import Config
from trtgraph.errors import ConfigError, ManifestError, PromptError
from trtgraph.models.config import ModelConfig
from trtgraph.runtime.serving.requests import parse_request, read_prompts

REPO = Path(__file__).resolve().parent.parent
DEFAULT_YAML = (REPO / "trtgraph" / "default.yaml").read_text()


def yaml_with(old: str, new: str) -> str:
    assert DEFAULT_YAML.count(old) == 1, old
    return DEFAULT_YAML.replace(old, new)


def config_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        Config.from_text(text, source="model.yaml")
    return str(info.value)


def line_of(text: str, needle: str, nth: int = 0) -> int:
    return [i + 1 for i, ln in enumerate(text.splitlines()) if needle in ln][nth]


def bomb(levels: int, width: int = 10) -> str:
    """A billion-laughs document: `levels` anchors, each a list of `width` aliases to the last."""
    out = ["l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, levels):
        out.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- YAML

YAML_CASES = [
    # (id, text, fragments the message must hold, the line it must name)
    pytest.param(bomb(5) + DEFAULT_YAML, ["expands to more than 10000 nodes", "aliases"], 4, id="alias-bomb"),
    pytest.param("big: &big {" + ", ".join(f"k{i}: [{', '.join(['x'] * 40)}]" for i in range(30)) + "}\n"
                 "copies: [" + ", ".join(["{<<: *big}"] * 20) + "]\n" + DEFAULT_YAML,
                 ["expands to more than 10000 nodes"], 2, id="merge-bomb"),
    pytest.param("loop: &loop [1, *loop]\n" + DEFAULT_YAML, ["recursive alias"], 1, id="recursive-alias"),
    pytest.param("loop: &loop {a: 1, <<: *loop}\n" + DEFAULT_YAML, ["recursive alias"], 1, id="recursive-merge"),
    pytest.param("deep: " + "[" * 3000 + "]" * 3000 + "\n", ["nested deeper than 64 levels"], 1, id="deep-nesting"),
    pytest.param("a: &a [x]\n" + "".join(f"a{i}: &a{i} [*{'a' if i == 0 else f'a{i - 1}'}]\n" for i in range(80))
                 + DEFAULT_YAML, ["nests deeper than 64 levels through aliases"], 64, id="deep-through-aliases"),
    pytest.param(yaml_with("dtype: float32", "dtype: float32\ndtype: float16"),
                 ["duplicate key dtype", f"first on line {line_of(DEFAULT_YAML, 'dtype: float32')}"],
                 line_of(DEFAULT_YAML, "dtype: float32") + 1, id="duplicate-top-level-key"),
    pytest.param(yaml_with("    seed: 0", "    seed: 0\n    seed: 1"),
                 ["duplicate key model.synthetic.seed", f"first on line {line_of(DEFAULT_YAML, 'seed: 0')}"],
                 line_of(DEFAULT_YAML, "seed: 0") + 1, id="duplicate-nested-key"),
    pytest.param(yaml_with("limits: {max_batch_size: 8,", "limits: {max_batch_size: 8, max_batch_size: 4,"),
                 ["duplicate key limits.max_batch_size"], line_of(DEFAULT_YAML, "limits:"), id="duplicate-flow-key"),
    pytest.param(yaml_with("    vocab_size: 320", "    vocab_size: 320\n    vocab_size: 0x140"),
                 ["duplicate key model.synthetic.vocab_size"], line_of(DEFAULT_YAML, "vocab_size") + 1,
                 id="duplicate-key-spelled-differently"),
    pytest.param(yaml_with("    seed: 0", "    seed: " + "9" * 5000), ["an integer with 5000 digits"],
                 line_of(DEFAULT_YAML, "seed: 0"), id="integer-past-digit-limit"),
    pytest.param(yaml_with("output: trtgraph-artifacts", 'output: "out\\0put"'),
                 ["output = 'out\\x00put'", "without NUL"], line_of(DEFAULT_YAML, "output:"), id="nul-in-output"),
    pytest.param(yaml_with("output: trtgraph-artifacts", 'output: "\\ud800"'),
                 ["output = '\\ud800'", "lone surrogate"], line_of(DEFAULT_YAML, "output:"),
                 id="lone-surrogate-in-output"),
]


@pytest.mark.parametrize("text,fragments,line", YAML_CASES)
def test_hostile_yaml_is_refused_with_its_line(text, fragments, line):
    msg = config_error(text)
    assert all(f in msg for f in fragments), msg
    assert re.search(rf"model\.yaml line {line}\b", msg), msg


def test_a_document_of_too_many_values_is_refused_while_composing():
    text = "values: [" + ", ".join(["1"] * 20_000) + "]\n" + DEFAULT_YAML
    msg = config_error(text)
    assert "more than 10000 values in one document" in msg and "model.yaml line 1" in msg, msg


def test_a_config_file_past_one_mib_is_refused_before_parsing(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(DEFAULT_YAML + ("# padding\n" * 120_000))
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    assert str(path) in str(info.value) and "more than the 1048576" in str(info.value)


def test_merge_keys_and_small_aliases_still_work():
    """Control: a merge key and an alias that expand to little are ordinary YAML."""
    text = ("_limits: &limits {max_batch_size: 8, max_seq_len: 256}\n" + DEFAULT_YAML).replace(
        "limits: {max_batch_size: 8, max_seq_len: 256, max_num_tokens: 256}",
        "limits: {<<: *limits, max_num_tokens: 256}")
    msg = config_error(text)  # the anchor's own key is unknown; the merge itself is fine
    assert "unknown key _limits" in msg
    cfg = Config.from_text(text.split("\n", 1)[1].replace("<<: *limits, ", "max_batch_size: 8, max_seq_len: 256, "),
                           source="model.yaml")
    assert cfg.limits.max_seq_len == 256


def test_alias_bomb_through_the_cli_exits_2_quickly(tmp_path):
    cfg = tmp_path / "model.yaml"
    cfg.write_text(bomb(6) + DEFAULT_YAML)
    result = CliRunner().invoke(main, ["capture", "--config", str(cfg), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "model.yaml line 4" in result.output and "expands to more than" in result.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- model config values

MODEL_CASES = [
    # (id, old line of default.yaml, new text, key path, value as printed, fragment of the allowed range)
    ("rope-theta-nan", "    rope_theta: 10000.0", "    rope_theta: .nan", "rope_theta", "nan", "[1, 1e+12]"),
    ("rope-theta-inf", "    rope_theta: 10000.0", "    rope_theta: .inf", "rope_theta", "inf", "finite"),
    ("rope-theta-zero", "    rope_theta: 10000.0", "    rope_theta: 0", "rope_theta", "0", "[1, 1e+12]"),
    ("rms-norm-eps-nan", "    seed: 0", "    seed: 0\n    rms_norm_eps: .nan", "rms_norm_eps", "nan", "(0, 1]"),
    ("rms-norm-eps-negative", "    seed: 0", "    seed: 0\n    rms_norm_eps: -1.0e-6", "rms_norm_eps", "-1e-06",
     "(0, 1]"),
    ("head-dim-odd", "    head_dim: 16", "    head_dim: 15", "head_dim", "15", "even"),
    ("head-dim-absurd", "    head_dim: 16", "    head_dim: 1000000", "head_dim", "1000000", "[2, 1024]"),
    ("max-position-inf", "    max_position_embeddings: 4096", "    max_position_embeddings: .inf",
     "max_position_embeddings", "inf", "an integer in [1, 16777216]"),
    ("max-position-float", "    max_position_embeddings: 4096", "    max_position_embeddings: 4096.5",
     "max_position_embeddings", "4096.5", "an integer"),
    ("seed-past-64-bits", "    seed: 0", "    seed: 18446744073709551616", "seed", "18446744073709551616",
     "below 2**64"),
    ("vocab-below-byte-tokenizer", "    vocab_size: 320", "    vocab_size: 200", "vocab_size", "200",
     "at least 256"),
    ("vocab-absurd", "    vocab_size: 320", "    vocab_size: 10000000000", "vocab_size", "10000000000",
     "[1, 4194304]"),
    ("hidden-size-zero", "    hidden_size: 64", "    hidden_size: 0", "hidden_size", "0", "[1, 131072]"),
    ("layers-absurd", "    num_hidden_layers: 2", "    num_hidden_layers: 100000", "num_hidden_layers", "100000",
     "[1, 1024]"),
    ("kv-heads-not-dividing", "    num_key_value_heads: 2", "    num_key_value_heads: 3", "num_key_value_heads", "3",
     "a divisor of num_attention_heads (4)"),
    ("heads-not-dividing-hidden", "    head_dim: 16\n", "", "num_attention_heads", "4", None),
    ("rope-scaling-not-a-mapping", "    seed: 0", "    seed: 0\n    rope_scaling: [1, 2]", "rope_scaling", "[1, 2]",
     "a mapping"),
    ("llama3-factor-nan", "    seed: 0", "    seed: 0\n    rope_scaling: {rope_type: llama3, factor: .nan, "
     "low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 512}",
     "rope_scaling.factor", "nan", "finite"),
    ("llama3-equal-freq-factors", "    seed: 0", "    seed: 0\n    rope_scaling: {rope_type: llama3, factor: 8.0, "
     "low_freq_factor: 2.0, high_freq_factor: 2.0, original_max_position_embeddings: 512}",
     "rope_scaling.high_freq_factor", "2.0", "(2, 1000]"),
    ("llama3-original-positions-float", "    seed: 0", "    seed: 0\n    rope_scaling: {rope_type: llama3, "
     "factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: .inf}",
     "rope_scaling.original_max_position_embeddings", "inf", "an integer"),
    ("tie-embeddings-string", "    seed: 0", "    seed: 0\n    tie_word_embeddings: 'false'", "tie_word_embeddings",
     "'false'", "true, false or null"),
    ("eos-token-string", "    seed: 0", "    seed: 0\n    eos_token_id: '2'", "eos_token_id", "'2'", "token id"),
    ("date-in-an-ignored-field", "    seed: 0", "    seed: 0\n    rope_scaling: {rope_type: default, when: 2001-01-01}",
     "rope_scaling.when", "datetime.date(2001, 1, 1)", "a JSON value"),
    ("nan-in-an-ignored-field", "    seed: 0", "    seed: 0\n    rope_scaling: {rope_type: default, factor: .nan}",
     "rope_scaling.factor", "nan", "a finite number"),
    ("misspelled-field", "    seed: 0", "    seed: 0\n    rope_thetta: 500000.0", "rope_thetta", None,
     "unknown key"),
]


@pytest.mark.parametrize("old,new,key,value,allowed", [pytest.param(*c[1:], id=c[0]) for c in MODEL_CASES])
def test_synthetic_model_values_are_refused_with_field_and_range(old, new, key, value, allowed):
    text = yaml_with(old, new)
    if key == "num_attention_heads":  # no head_dim: hidden_size 66 cannot split into 4 heads
        text = text.replace("hidden_size: 64", "hidden_size: 66")
    msg = config_error(text)
    needle = new.strip().splitlines()[-1].split(":")[0] if new.strip() else "num_attention_heads"
    assert f"model.yaml line {line_of(text, needle)}" in msg, msg
    assert f"model.synthetic.{key}" in msg, msg
    if value is not None:
        assert f"= {value} is not allowed" in msg, msg
    if allowed is not None:
        assert allowed in msg, msg


def test_synthetic_vocab_too_small_fails_at_capture_not_at_run(tmp_path):
    cfg = tmp_path / "model.yaml"
    cfg.write_text(yaml_with("    vocab_size: 320", "    vocab_size: 200"))
    result = CliRunner().invoke(main, ["capture", "--config", str(cfg), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "model.synthetic.vocab_size = 200" in result.output and "256" in result.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_checkpoint_without_tokenizer_json_and_a_vocab_below_256_fails_at_capture(tmp_path):
    """Such a checkpoint gets the byte-level tokenizer at run; before, capture succeeded and
    every run failed."""
    try:
        from tests.hf_models import save_tiny
    except ImportError:
        from hf_models import save_tiny
    save_tiny("LlamaForCausalLM", tmp_path / "ckpt", vocab_size=200)
    result = _capture_ckpt(tmp_path, "dtype: float32\n"
                                     "limits: {max_batch_size: 2, max_seq_len: 64, max_num_tokens: 64}\n"
                                     "buckets: {batch_sizes: [1, 2], context_batch_sizes: [1], "
                                     "chunk_sizes: [16], sampling: [greedy]}\n")
    assert result.exit_code == 2, result.output
    assert "ckpt/config.json: vocab_size = 200 is not allowed" in result.output
    assert "no tokenizer.json" in result.output and "256" in result.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def _capture_ckpt(tmp_path, rest: str):
    """`trtgraph capture` of tmp_path/ckpt on the CPU, `rest` the remaining model.yaml lines."""
    (tmp_path / "model.yaml").write_text("model: {path: ./ckpt}\ndevice: cpu\n" + rest)
    return CliRunner().invoke(main, ["capture", "--config", str(tmp_path / "model.yaml"),
                                     "--out", str(tmp_path / "out")])


HF_BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 112,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 300, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}

HF_CASES = [
    ("rope_theta", float("nan"), "rope_theta = nan"),
    ("rope_theta", 1e400, "rope_theta = inf"),
    ("rope_theta", 10 ** 400, "rope_theta = <an integer of 1329 bits>"),
    ("rope_parameters", {"rope_theta": float("inf"), "rope_type": "default"}, "rope_parameters.rope_theta = inf"),
    ("rope_parameters", "default", "rope_parameters = 'default'"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps = nan"),
    ("max_position_embeddings", float("inf"), "max_position_embeddings = inf"),
    ("max_position_embeddings", float("nan"), "max_position_embeddings = nan"),
    ("num_key_value_heads", 3, "num_key_value_heads = 3"),
    ("head_dim", 0, "head_dim = 0"),
    ("vocab_size", 1 << 40, "vocab_size = 1099511627776"),
    ("tie_word_embeddings", "no", "tie_word_embeddings = 'no'"),
    ("eos_token_id", [2, "3"], "eos_token_id = [2, '3']"),
    ("bos_token_id", -1, "bos_token_id = -1"),
    ("sliding_window", "4k", "sliding_window = '4k'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 64}, "rope_scaling.high_freq_factor = 1.0"),
]


@pytest.mark.parametrize("field,value,fragment", HF_CASES, ids=[f"{c[0]}={c[1]!r}"[:40] for c in HF_CASES])
def test_checkpoint_config_json_values_are_refused(field, value, fragment):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf({**HF_BASE, field: value}, source="ckpt/config.json", max_seq_len=64)
    msg = str(info.value)
    assert msg.startswith("ckpt/config.json: ") and fragment in msg and "expected" in msg, msg


def test_checkpoint_config_json_base_is_valid():
    """Control for the table above."""
    cfg = ModelConfig.from_hf(dict(HF_BASE), source="ckpt/config.json", max_seq_len=64)
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_kv_heads) == (10000.0, 16, 2)


def test_nan_in_a_checkpoint_config_json_exits_2_through_the_cli(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(HF_BASE).replace("10000.0", "NaN"))
    result = _capture_ckpt(tmp_path, "limits: {max_batch_size: 4, max_seq_len: 64, max_num_tokens: 64}\n"
                                     "buckets: {chunk_sizes: [16], sampling: [greedy]}\n")
    assert result.exit_code == 2, result.output
    assert "ckpt/config.json: rope_theta = nan is not allowed" in result.output


# ---------------------------------------------------------------------------- JSON requests

PROMPT_CASES = [
    # (id, the bad line, field named, fragment)
    ("nesting-past-recursion-limit", '{"id": "b", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None,
     "nested too deeply"),
    ("integer-past-digit-limit", '{"id": "b", "prompt": "x", "seed": ' + "9" * 5000 + "}", "seed",
     "<an integer of 5000 digits>"),
    ("integer-id-past-digit-limit", '{"id": ' + "7" * 4500 + ', "prompt": "x"}', "id", "4500 digits"),
    ("integer-id-past-64-bits", '{"id": ' + "7" * 30 + ', "prompt": "x"}', "id", "[-2**63, 2**63)"),
    ("lone-surrogate-in-prompt", '{"id": "b", "prompt": "hi \\ud800"}', "prompt", "lone surrogate"),
    ("lone-surrogate-in-id", '{"id": "b\\udc00", "prompt": "x"}', "id", "lone surrogate"),
    ("lone-surrogate-in-stop", '{"id": "b", "prompt": "x", "stop": ["\\ud800"]}', "stop", "lone surrogate"),
    ("lone-surrogate-in-a-field-name", '{"id": "b", "prompt": "x", "\\ud800": 1}', None, "unknown field '\\ud800'"),
    ("float-overflowing-to-inf", '{"id": "b", "prompt": "x", "temperature": 1e400}', "temperature", "= inf"),
    ("nan-literal", '{"id": "b", "prompt": "x", "top_p": NaN}', "top_p", "= nan"),
    ("deeply-nested-id", '{"id": ' + "[" * 500 + "]" * 500 + ', "prompt": "x"}', "id", "[[[[...]]]]"),
]


@pytest.mark.parametrize("line,field,fragment", [pytest.param(*c[1:], id=c[0]) for c in PROMPT_CASES])
def test_hostile_prompt_lines_are_refused_up_front(tmp_path, line, field, fragment):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(PromptError) as info:
        read_prompts(path)
    msg = str(info.value)
    msg.encode("utf-8")  # the message itself can be printed
    assert f"prompts.jsonl line 2: " in msg and fragment in msg, msg
    if field is not None:
        assert f"field `{field}`" in msg, msg


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_prompts_that_are_not_a_regular_file_fail_at_once(tmp_path, kind):
    """Before: a FIFO blocked open() for ever, /dev/zero was read until memory ran out.
    In a subprocess with a timeout, so a regression cannot hang or starve the test run."""
    path = Path("/dev/zero") if kind == "device" else tmp_path / "prompts.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    code = ("from trtgraph.runtime.serving.requests import read_prompts\n"
            "from trtgraph.errors import PromptError\n"
            f"try:\n    read_prompts({str(path)!r})\nexcept PromptError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=_limit_memory)
    assert f"{path}: cannot read the prompts file (not a regular file)" in done.stdout, done.stdout + done.stderr


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_surrogate_pair_is_one_valid_character(tmp_path):
    """Control: an escaped pair (😀) is valid text, only a lone half is refused."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "x\\ud83d\\ude00"}\n')
    assert read_prompts(path)[0].prompt == "x\U0001F600"


@pytest.mark.parametrize("raw,field", [
    ({"id": 10 ** 5000, "prompt": "x"}, "id"),
    ({"id": "a", "prompt": "x", "seed": 10 ** 5000}, "seed"),
    ({"id": "a", "prompt": "x", "stop": "\udfff"}, "stop"),
], ids=["huge-int-id", "huge-int-seed", "surrogate-stop"])
def test_python_api_requests_with_huge_ints_or_surrogates(raw, field):
    with pytest.raises(PromptError) as info:
        parse_request(raw, "request 0")
    assert f"field `{field}`" in str(info.value)


def test_surrogate_prompt_fails_before_any_request_runs(tmp_path, default_artifacts):
    """Before: the run served line 1, then died writing line 2's result (exit 1), and
    never served line 3."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x", "max_tokens": 2}\n{"id": "b", "prompt": "\\ud800"}\n'
                       '{"id": "c", "prompt": "y", "max_tokens": 2}\n')
    result = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(default_artifacts),
                                       "--output", str(out)])
    assert result.exit_code == 2, result.output
    assert "prompts.jsonl line 2: field `prompt`" in result.output
    assert not out.exists()


# ---------------------------------------------------------------------------- forged manifests

def forge(src: Path, dst: Path, edit) -> Path:
    """A copy of the artifacts whose manifest `edit(body)` changed, digest recomputed as a forger would."""
    shutil.copytree(src, dst)
    path = dst / "manifest.json"
    body = json.loads(path.read_text())
    edit(body)
    body["digest"] = _digest(body)
    path.write_text(json.dumps(body))
    return dst


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(body):
        d = body
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value
    return edit


def _moved_checkpoint(body):
    body["config"]["model"] = {"path": "/nonexistent/trtgraph-test/ckpt"}


def _first_key_pool(body):
    body["keys"][0]["pool_bytes"] += 4096


MANIFEST_CASES = [
    # (id, edit, fragments of the message)
    ("format-version-true", _set("format_version", True), ["format_version true"]),
    ("unknown-top-level-key", _set("extra", 1), ["its top level has unknown key(s) 'extra'"]),
    ("created-not-a-time", _set("created", "yesterday"), ["created = 'yesterday'", "ISO 8601"]),
    ("version-with-surrogate", _set("trtgraph_version", "0.1\ud800"), ["trtgraph_version", "lone surrogate"]),
    ("version-huge", _set("trtgraph_version", "9" * 100_000), ["trtgraph_version", "1 to 256 characters"]),
    ("environment-backend", _set("environment", "backend", "gpu"), ["environment.backend = 'gpu'", "cuda, static"]),
    ("terminal-escape-in-device-name", _set("environment", "device_name", "cpu\x1b[2J"),
     ["environment.device_name = 'cpu\\x1b[2J'", "control characters"]),
    ("environment-torch-number", _set("environment", "torch", 2.13), ["environment.torch = 2.13"]),
    ("model-dtype", _set("model", "dtype", "fp8"), ["model.dtype = 'fp8'", "float32"]),
    ("model-dtype-disagrees", _set("model", "dtype", "bfloat16"), ["model.dtype = 'bfloat16'", "config's dtype"]),
    ("model-architecture", _set("model", "architecture", "GPT2"), ["model.architecture = 'GPT2'"]),
    ("model-config-hash", _set("model", "config_hash", "zz"), ["model.config_hash", "16 lowercase hex"]),
    ("model-parameter-count", _set("model", "parameter_count", -1), ["model.parameter_count = -1"]),
    ("weight-file-escapes", _set("model", "weight_files", [{"name": "../x", "bytes": 1, "sha256": "0" * 64}]),
     ["model.weight_files[0].name = '../x'"]),
    ("weight-file-sha", _set("model", "weight_files", [{"name": "m.safetensors", "bytes": 1, "sha256": 5}]),
     ["model.weight_files[0].sha256 = 5"]),
    ("limits-disagree", _set("limits", "max_seq_len", 4096), ["limits = ", "config.limits"]),
    ("kv-block-size-disagrees", _set("kv_cache", "block_size", 32), ["kv_cache.block_size = 32"]),
    ("kv-bytes-bool", _set("kv_cache", "bytes", True), ["kv_cache.bytes = true"]),
    ("buffer-dtype", lambda b: b["buffers"][0].update(dtype="complex128"), ["buffers[0].dtype = 'complex128'"]),
    ("buffer-shape", lambda b: b["buffers"][0].update(shape=[-1]), ["buffers[0].shape = [-1]"]),
    ("buffers-empty", _set("buffers", []), ["buffers = []"]),
    ("key-unknown-field", lambda b: b["keys"][0].update(note="x"), ["keys[0] has unknown key(s) 'note'"]),
    ("totals-pool-disagrees", _first_key_pool, ["totals.pool_bytes", "sum of the keys' pool_bytes"]),
    ("totals-fused-ops-value", _set("totals", "fused_ops", {"norm_linear:72x48": "fast"}),
     ["totals.fused_ops", '"fused" | "fused<=ROWS" | "composed"']),
    ("parallel-ranks-missing", _set("parallel", "ranks", []), ["parallel.ranks = []", "1 rank records"]),
    ("parallel-rank-number", lambda b: b["parallel"]["ranks"][0].update(rank=3), ["parallel.ranks[0].rank = 3"]),
    ("paths-extra", _set("paths", "weights", "w"), ["paths = "]),
    ("nul-in-triton-cache-path", _set("paths", "triton_cache", "a\0b"), ["paths.triton_cache = 'a\\x00b'", "NUL"]),
    ("config-model-path-relative", _set("config", "model", {"path": "ckpt"}),
     ["config.model.path = 'ckpt'", "absolute"]),
    ("synthetic-seed-disagrees", _set("model", "seed", 7), ["model.seed = 7", "expected 0, from the synthetic spec"]),
    ("synthetic-spec-incomplete", lambda b: b["config"]["model"]["synthetic"].pop("hidden_size"),
     ["its config section is invalid", "model.synthetic has no `hidden_size`"]),
    ("config-synthetic-rope-theta", _set("config", "model", "synthetic", "rope_theta", 0.5),
     ["its config section is invalid", "model.synthetic.rope_theta = 0.5"]),
]


@pytest.mark.parametrize("edit,fragments", [pytest.param(*c[1:], id=c[0]) for c in MANIFEST_CASES])
def test_forged_manifest_fields_are_refused(tmp_path, default_artifacts, edit, fragments):
    art = forge(default_artifacts, tmp_path / "art", edit)
    with pytest.raises(ManifestError) as info:
        load_manifest(art)
    msg = str(info.value)
    msg.encode("utf-8")
    assert str(art / "manifest.json") in msg and all(f in msg for f in fragments), msg


def test_a_manifest_past_its_size_bound_is_refused_before_parsing(tmp_path, default_artifacts, monkeypatch):
    import trtgraph.artifacts as artifacts

    monkeypatch.setattr(artifacts, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(ManifestError) as info:
        load_manifest(default_artifacts)
    assert "more than the 1000" in str(info.value)


def test_nan_literal_in_a_manifest_is_refused(tmp_path, default_artifacts):
    art = forge(default_artifacts, tmp_path / "art", lambda b: None)
    path = art / "manifest.json"
    text = path.read_text()
    path.write_text(re.sub(r'"max_abs_logit_diff": [0-9.e+-]+', '"max_abs_logit_diff": NaN', text, count=1))
    result = CliRunner().invoke(main, ["inspect", str(art)])
    assert result.exit_code == 2, result.output
    assert "NaN is not a JSON number" in result.output


def test_a_moved_checkpoint_is_shown_by_inspect_and_refused_by_run_naming_the_field(tmp_path, default_artifacts):
    """A checkpoint that moved after capture: `inspect` still shows the manifest (artifacts can
    move), `run` refuses it (exit 2) naming config.model.path and `--model PATH`."""
    art = forge(default_artifacts, tmp_path / "art", _moved_checkpoint)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    shown = CliRunner().invoke(main, ["inspect", str(art)])
    assert shown.exit_code == 0, shown.output
    result = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(art)])
    assert result.exit_code == 2, result.output
    for fragment in ("config.model.path", "moved or deleted", "--model PATH"):
        assert fragment in result.output, result.output


def test_unedited_copy_loads(tmp_path, default_artifacts):
    """Control for the table: the same copy with no edit (digest recomputed) loads."""
    art = forge(default_artifacts, tmp_path / "art", lambda b: None)
    assert load_manifest(art).totals["num_keys"] == len(load_manifest(default_artifacts).keys)
