"""One table-driven corpus of bad inputs, each run through the real CLI.

Every case builds one bad input under tmp_path (a model.yaml, a damaged checkpoint, a
prompts file, an edited manifest), runs the command through click's CliRunner and asserts
the exit code (2 for a TrtgraphError, 3 for `inspect --check`), that the output names the
culprit (file, line, key path, tensor, field, version...) and that no traceback reaches
the user. The same input then goes through the Python API, which must raise the declared
TrtgraphError subclass with the same culprits in its message. A few cases also run as
`python -m trtgraph` in a subprocess, to prove no traceback reaches a real terminal.

Controls run the undamaged input of each group and expect exit 0, so a case can only
pass because of its damage. docs/reliability.md lists every case with its observed exit
code and message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner

from trtgraph.artifacts import _digest
from trtgraph.cli import main

try:
    from tests.hf_models import save_tiny
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from hf_models import save_tiny

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- inputs

class Inputs:
    """Where a case builds its input: a private tmp directory, plus shared, read-only
    session resources fetched lazily by name (`default_artifacts`, `pristine_checkpoint`)."""

    def __init__(self, tmp: Path, resource: Callable[[str], Path]):
        self.tmp, self._resource = Path(tmp), resource

    @property
    def default_artifacts(self) -> Path:
        return self._resource("default_artifacts")

    @property
    def pristine_checkpoint(self) -> Path:
        return self._resource("pristine_checkpoint")

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path


# ---- config: a small synthetic model.yaml; the line numbers below are part of the cases
BASE_YAML = """\
model:
  synthetic: {architecture: LlamaForCausalLM, hidden_size: 64, intermediate_size: 172, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, vocab_size: 320}
dtype: float32
device: cpu
limits:
  max_batch_size: 8
  max_seq_len: 256
  max_num_tokens: 256
kv_cache:
  block_size: 16
  num_blocks: auto
buckets:
  batch_sizes: auto
  context_batch_sizes: [1, 2, 4]
  chunk_sizes: [16, 64]
  sampling: [greedy]
"""


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the base text must hold {old!r} exactly once"
    return text.replace(old, new)


def config_case(old: str | None = None, new: str | None = None, text: str | None = None):
    """model.yaml = BASE_YAML with `old` replaced by `new` (or `text` verbatim)."""

    def build(inp: Inputs) -> list[str]:
        body = text if text is not None else (BASE_YAML if old is None else _edit(BASE_YAML, old, new))
        cfg = inp.write("model.yaml", body)
        return ["capture", "--config", str(cfg), "--out", str(inp.tmp / "out")]

    return build


def missing_config(inp: Inputs) -> list[str]:
    return ["capture", "--config", str(inp.tmp / "no-such-model.yaml"), "--out", str(inp.tmp / "out")]


# ---- checkpoint: a copy of a tiny saved Llama, damaged, captured through a model.yaml
CKPT_YAML = """\
model:
  path: ./ckpt
dtype: float32
device: cpu
limits: {max_batch_size: 2, max_seq_len: 64, max_num_tokens: 64}
buckets: {batch_sizes: [1, 2], context_batch_sizes: [1], chunk_sizes: [16], sampling: [greedy]}
"""
WEIGHTS = "model.safetensors"
TENSOR = "model.layers.0.mlp.down_proj.weight"


def _checkpoint_copy(inp: Inputs) -> Path:
    ckpt = inp.tmp / "ckpt"
    shutil.copytree(inp.pristine_checkpoint, ckpt)
    inp.write("model.yaml", CKPT_YAML)
    return ckpt


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of a tensor's data inside a safetensors file."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def checkpoint_case(damage: Callable[[Path], None] | None):
    def build(inp: Inputs) -> list[str]:
        ckpt = _checkpoint_copy(inp)
        if damage is not None:
            damage(ckpt)
        return ["capture", "--config", str(inp.tmp / "model.yaml"), "--out", str(inp.tmp / "out")]

    return build


def _no_config_json(ckpt: Path):
    (ckpt / "config.json").unlink()


def _no_weights(ckpt: Path):
    (ckpt / WEIGHTS).unlink()


def _pickle_only(ckpt: Path):
    (ckpt / WEIGHTS).rename(ckpt / "pytorch_model.bin")


def _truncated(ckpt: Path):
    data = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(data[:len(data) // 2])


def _corrupt_header(ckpt: Path):
    data = bytearray((ckpt / WEIGHTS).read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header starts at byte 8
    (ckpt / WEIGHTS).write_bytes(bytes(data))


def _resave(ckpt: Path, change: Callable[[dict], None]):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / WEIGHTS))
    change(tensors)
    save_file(tensors, str(ckpt / WEIGHTS), metadata={"format": "pt"})


def _wrong_shape(ckpt: Path):
    _resave(ckpt, lambda t: t.__setitem__(TENSOR, t[TENSOR].t().contiguous()))


def _int_tensor(ckpt: Path):
    _resave(ckpt, lambda t: t.__setitem__(TENSOR, torch.ones_like(t[TENSOR], dtype=torch.int32)))


def _missing_tensor(ckpt: Path):
    _resave(ckpt, lambda t: t.pop(TENSOR))


def _architecture(ckpt: Path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))


# ---- prompts: run against the default artifacts (captured once per session)
GOOD_LINES = ['{"id": "a", "prompt": "Hello", "max_tokens": 3}',
              '{"id": "b", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}']


def prompts_case(*lines: str | bytes):
    """prompts.jsonl = the lines given (bytes pass through undecoded)."""

    def build(inp: Inputs) -> list[str]:
        data = b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines)
        p = inp.write("prompts.jsonl", data)
        return ["run", "--prompts", str(p), "--manifest", str(inp.default_artifacts)]

    return build


# ---- manifest: a copy of the default artifacts (or of a tiny checkpoint's), edited
def _find_key(body: dict, batch_size: int, chunk_size: int = 0, sampling: str = "greedy") -> dict:
    return next(k for k in body["keys"] if k["key"] == {"batch_size": batch_size, "draft_len": 0,
                                                         "chunk_size": chunk_size, "sampling": sampling})


def _rename_key(body: dict):
    rec = _find_key(body, 8)
    rec["key"]["batch_size"], rec["num_tokens"] = 6, 6


def manifest_case(command: str, edit: Callable[[dict], None] | None = None, redigest: bool = True,
                  raw: Callable[[str], str] | None = None):
    """Copy the default artifacts; apply `edit` to the parsed manifest (then recompute the
    digest unless redigest=False) or `raw` to its text; run `command` against the copy."""

    def build(inp: Inputs) -> list[str]:
        art = inp.tmp / "art"
        shutil.copytree(inp.default_artifacts, art)
        mpath = art / "manifest.json"
        text = mpath.read_text(encoding="utf-8")
        if edit is not None:
            body = json.loads(text)
            edit(body)
            if redigest:
                body["digest"] = _digest(body)
            text = json.dumps(body, indent=2)
        if raw is not None:
            text = raw(text)
        mpath.write_text(text, encoding="utf-8")
        return _command(inp, command, art)

    return build


def _command(inp: Inputs, command: str, art: Path) -> list[str]:
    if command == "inspect":
        return ["inspect", str(art)]
    if command == "inspect --check":
        return ["inspect", str(art), "--check"]
    prompts = inp.write("prompts.jsonl", "\n".join(GOOD_LINES) + "\n")
    return ["run", "--prompts", str(prompts), "--manifest", str(art)]


def stale_weights_case(command: str, flip: bool = True):
    """Capture a tiny checkpoint, then change one byte inside a weight tensor (the file
    stays a valid safetensors file with the same tensors) and run `command`."""

    def build(inp: Inputs) -> list[str]:
        from safetensors.torch import load_file

        from trtgraph.compiler.pipeline import capture
        from trtgraph.config import Config

        ckpt = _checkpoint_copy(inp)
        art = inp.tmp / "art"
        capture(Config.from_yaml(inp.tmp / "model.yaml"), art)
        if flip:
            path = ckpt / WEIGHTS
            before = load_file(str(path))[TENSOR].clone()  # load_file may map the file
            data = bytearray(path.read_bytes())
            start, _ = _tensor_span(path, TENSOR)
            data[start] ^= 0x01  # the lowest mantissa byte of the tensor's first float32
            path.write_bytes(bytes(data))
            after = load_file(str(path))[TENSOR]  # still valid, one value changed a little
            assert after.shape == before.shape and not torch.equal(after, before)
            assert torch.isfinite(after).all()
        return _command(inp, command, art)

    return build


# ------------------------------------------------------------------------------ cases

@dataclass(frozen=True)
class Case:
    group: str  # config | checkpoint | prompts | manifest
    name: str
    build: Callable[[Inputs], list[str]]  # writes the bad input; returns the CLI arguments
    exit_code: int
    error: str | None  # the TrtgraphError subclass the API raises; None: the API returns
    culprits: tuple[str, ...]  # substrings the message must contain
    rows: dict = field(default_factory=dict)  # exit-0 runs: id -> (finish_reason, error substring or None)
    terminal: bool = False  # also run `python -m trtgraph` in a subprocess
    api_culprits: tuple[str, ...] | None = None  # in the API's error or return value (default: culprits)


def case(group, name, build, exit_code, error, *culprits, rows=None, terminal=False, api_culprits=None,
         xfail=None):
    c = Case(group, name, build, exit_code, error, tuple(culprits), rows or {}, terminal, api_culprits)
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(c, id=f"{group}-{name}", marks=marks)


ADVICE = "Recapture"  # every manifest error says what to do next
LONG = "x" * 300  # the default's limits.max_seq_len is 256 (one byte = one token)

CASES = [
    # ---- config ------------------------------------------------------------------------
    case("config", "malformed-yaml", config_case("  max_seq_len: 256\n", "  max_seq_len: [256\n"), 2,
         "ConfigError", "model.yaml line 8", "not valid YAML", terminal=True),
    case("config", "tab-indent", config_case("  max_seq_len: 256", "\tmax_seq_len: 256"), 2,
         "ConfigError", "model.yaml line 7", "not valid YAML"),
    case("config", "unknown-top-level-key", config_case("dtype: float32", "dtype: float32\ndtypes: float16"), 2,
         "ConfigError", "model.yaml line 4", "unknown key dtypes", "valid keys are"),
    case("config", "unknown-nested-key", config_case("max_batch_size: 8", "max_batch_sise: 8"), 2,
         "ConfigError", "model.yaml line 6", "limits.max_batch_sise", "max_batch_size"),
    case("config", "string-for-int", config_case("max_seq_len: 256", 'max_seq_len: "256"'), 2,
         "ConfigError", "model.yaml line 7", "limits.max_seq_len = '256'", "an integer"),
    case("config", "float-for-int", config_case("block_size: 16", "block_size: 16.0"), 2,
         "ConfigError", "model.yaml line 10", "kv_cache.block_size = 16.0"),
    case("config", "scalar-for-list", config_case("chunk_sizes: [16, 64]", "chunk_sizes: 16"), 2,
         "ConfigError", "model.yaml line 15", "buckets.chunk_sizes = 16", "list"),
    case("config", "string-in-int-list", config_case("context_batch_sizes: [1, 2, 4]", "context_batch_sizes: [1, two, 4]"),
         2, "ConfigError", "model.yaml line 14", "buckets.context_batch_sizes[1] = 'two'"),
    case("config", "unknown-dtype", config_case("dtype: float32", "dtype: fp8"), 2,
         "ConfigError", "model.yaml line 3", "dtype = 'fp8'", "float32, float16, bfloat16"),
    case("config", "mapping-for-limits", config_case("limits:\n  max_batch_size: 8\n  max_seq_len: 256\n"
                                                     "  max_num_tokens: 256\n", "limits: 8\n"), 2,
         "ConfigError", "model.yaml line 5", "limits = 8", "a mapping"),
    case("config", "zero-batch-size", config_case("max_batch_size: 8", "max_batch_size: 0"), 2,
         "ConfigError", "model.yaml line 6", "limits.max_batch_size = 0"),
    case("config", "max-num-tokens-below-batch", config_case("max_num_tokens: 256", "max_num_tokens: 4"), 2,
         "ConfigError", "model.yaml line 8", "limits.max_num_tokens = 4", "at least limits.max_batch_size (8)"),
    case("config", "kv-blocks-below-one-sequence", config_case("num_blocks: auto", "num_blocks: 3"), 2,
         "ConfigError", "model.yaml line 11", "kv_cache.num_blocks = 3", "at least 17"),
    case("config", "block-size-not-power-of-two", config_case("block_size: 16", "block_size: 24"), 2,
         "ConfigError", "model.yaml line 10", "kv_cache.block_size = 24", "power of two"),
    case("config", "chunk-over-max-seq-len", config_case("chunk_sizes: [16, 64]", "chunk_sizes: [16, 512]"), 2,
         "ConfigError", "model.yaml line 15", "buckets.chunk_sizes[1] = 512", "limits.max_seq_len (256)"),
    case("config", "model-path-missing", config_case(text=_edit(BASE_YAML, BASE_YAML.splitlines()[1],
                                                                "  path: ./no-such-checkpoint")), 2,
         "ConfigError", "model.yaml line 2", "model.path = './no-such-checkpoint'", "does not exist"),
    case("config", "config-file-missing", missing_config, 2,
         "ConfigError", "no-such-model.yaml: no such config file"),
    case("config", "empty-config-file", config_case(text=""), 2,
         "ConfigError", "model.yaml: model = None"),

    # ---- checkpoint --------------------------------------------------------------------
    case("checkpoint", "no-config-json", checkpoint_case(_no_config_json), 2,
         "WeightLoadError", "ckpt: ", "no config.json"),
    case("checkpoint", "no-weights", checkpoint_case(_no_weights), 2,
         "WeightLoadError", "ckpt: ", "no *.safetensors weights"),
    case("checkpoint", "pickle-only", checkpoint_case(_pickle_only), 2,
         "WeightLoadError", "ckpt: ", "pytorch_model.bin", "never loaded"),
    case("checkpoint", "truncated-safetensors", checkpoint_case(_truncated), 2,
         "WeightLoadError", f"ckpt/{WEIGHTS}", "truncated or corrupt", terminal=True),
    case("checkpoint", "corrupt-safetensors-header", checkpoint_case(_corrupt_header), 2,
         "WeightLoadError", f"ckpt/{WEIGHTS}", "not a readable safetensors file"),
    case("checkpoint", "wrong-shape", checkpoint_case(_wrong_shape), 2,
         "WeightLoadError", "ckpt: ", TENSOR, "(112, 64)", "expected (64, 112)"),
    case("checkpoint", "int-tensor", checkpoint_case(_int_tensor), 2,
         "WeightLoadError", "ckpt: ", TENSOR, "torch.int32", "floating-point"),
    case("checkpoint", "missing-tensor", checkpoint_case(_missing_tensor), 2,
         "WeightLoadError", "ckpt: ", "missing tensors", TENSOR),
    case("checkpoint", "unsupported-architecture", checkpoint_case(_architecture), 2,
         "WeightLoadError", "ckpt/config.json", "'GPT2LMHeadModel' is not supported", "LlamaForCausalLM"),

    # ---- prompts -----------------------------------------------------------------------
    case("prompts", "invalid-json", prompts_case(GOOD_LINES[0], '{"id": "b", "prompt": }'), 2,
         "PromptError", "prompts.jsonl line 2", "not valid JSON"),
    case("prompts", "not-an-object", prompts_case(GOOD_LINES[0], '["b", "Hello"]'), 2,
         "PromptError", "prompts.jsonl line 2", "expected a JSON object"),
    case("prompts", "missing-id", prompts_case(GOOD_LINES[0], '{"prompt": "Hello"}'), 2,
         "PromptError", "prompts.jsonl line 2", "missing field `id`", "give every request a unique `id`"),
    case("prompts", "unknown-field", prompts_case('{"id": "a", "prompt": "Hi", "max_token": 3}'), 2,
         "PromptError", "prompts.jsonl line 1", "unknown field max_token"),
    case("prompts", "string-max-tokens", prompts_case('{"id": "a", "prompt": "Hi", "max_tokens": "5"}'), 2,
         "PromptError", "prompts.jsonl line 1", "field `max_tokens` = '5'"),
    case("prompts", "empty-prompt", prompts_case(GOOD_LINES[0], '{"id": "b", "prompt": ""}'), 2,
         "PromptError", "prompts.jsonl line 2", "field `prompt` = ''"),
    case("prompts", "max-tokens-zero", prompts_case('{"id": "a", "prompt": "Hi", "max_tokens": 0}'), 2,
         "PromptError", "prompts.jsonl line 1", "field `max_tokens` = 0"),
    case("prompts", "max-tokens-negative", prompts_case('{"id": "a", "prompt": "Hi", "max_tokens": -3}'), 2,
         "PromptError", "prompts.jsonl line 1", "field `max_tokens` = -3"),
    case("prompts", "max-tokens-absurd", prompts_case('{"id": "a", "prompt": "Hi", "max_tokens": %d}' % 2 ** 40),
         2, "PromptError", "prompts.jsonl line 1", f"field `max_tokens` = {2 ** 40}"),
    case("prompts", "token-id-out-of-range", prompts_case('{"id": "a", "prompt_token_ids": [1, -5]}'), 2,
         "PromptError", "prompts.jsonl line 1", "field `prompt_token_ids` = -5"),
    case("prompts", "duplicate-ids", prompts_case(GOOD_LINES[0], "", '{"id": "a", "prompt": "again"}'), 2,
         "PromptError", "prompts.jsonl line 3", "duplicate id 'a'", "first on line 1"),
    case("prompts", "invalid-utf8", prompts_case(GOOD_LINES[0], b'{"id": "b", "prompt": "caf\xe9"}'), 2,
         "PromptError", "prompts.jsonl line 2", "not valid UTF-8", terminal=True),
    case("prompts", "empty-prompts-file", prompts_case(""), 2,
         "PromptError", "prompts.jsonl: no requests"),
    case("prompts", "prompt-over-max-seq-len",
         prompts_case(GOOD_LINES[0], json.dumps({"id": "long", "prompt": LONG, "max_tokens": 4}), GOOD_LINES[1]),
         0, None, "max_seq_len (256)", "prompt (300 tokens)",
         rows={"a": ("length", None), "long": ("error", "max_seq_len"), "b": ("length", None)}),

    # ---- manifest ----------------------------------------------------------------------
    *[c for command in ("inspect", "run") for c in (
        case("manifest", f"truncated-json-{command}", manifest_case(command, raw=lambda t: t[:len(t) // 2]), 2,
             "ManifestError", "art/manifest.json", "not valid JSON", "truncated", ADVICE, terminal=command == "run"),
        case("manifest", f"unknown-format-version-{command}",
             manifest_case(command, lambda b: b.__setitem__("format_version", 99)), 2,
             "ManifestError", "art/manifest.json", "format_version 99", "known: 1", ADVICE),
        case("manifest", f"edited-keys-stale-digest-{command}", manifest_case(command, _rename_key, redigest=False),
             2, "ManifestError", "art/manifest.json", "edited after capture", ADVICE),
        case("manifest", f"edited-keys-digest-recomputed-{command}", manifest_case(command, _rename_key), 2,
             "ManifestError", "art/manifest.json", "keys do not match",
             "not in the plan: (bs=6, decode draft=0, greedy)", "missing: (bs=8, decode draft=0, greedy)", ADVICE),
        case("manifest", f"negative-key-pool-bytes-{command}",
             manifest_case(command, lambda b: b["keys"][0].__setitem__("pool_bytes", -1)), 2,
             "ManifestError", "art/manifest.json", "keys[0].pool_bytes = -1", ADVICE),
        case("manifest", f"negative-total-pool-bytes-{command}",
             manifest_case(command, lambda b: b["totals"].__setitem__("pool_bytes", -1)), 2,
             "ManifestError", "art/manifest.json", "totals.pool_bytes = -1", ADVICE),
        case("manifest", f"absurd-kv-num-blocks-{command}",
             manifest_case(command, lambda b: b["kv_cache"].__setitem__("num_blocks", 10 ** 12)), 2,
             "ManifestError", "art/manifest.json", f"kv_cache.num_blocks = {10 ** 12}", ADVICE),
        case("manifest", f"negative-replay-ms-{command}",
             manifest_case(command, lambda b: b["keys"][0].__setitem__("replay_ms", -1)), 2,
             "ManifestError", "art/manifest.json", "keys[0].replay_ms = -1", ADVICE),
    )],
    case("manifest", "stale-weights-run", stale_weights_case("run"), 2,
         "ManifestError", "art/manifest.json", f"model.weight_files[{WEIGHTS}].sha256", "does not match this machine"),
    case("manifest", "stale-weights-inspect-check", stale_weights_case("inspect --check"), 3,
         None, f"model.weight_files[{WEIGHTS}].sha256", "DIFFERS",
         api_culprits=(f"model.weight_files[{WEIGHTS}].sha256",)),
]

# The undamaged input of each group: must succeed, so every case fails only by its damage.
CONTROLS = [
    pytest.param(config_case(), id="config"),
    pytest.param(checkpoint_case(None), id="checkpoint"),
    pytest.param(prompts_case(*GOOD_LINES), id="prompts"),
    pytest.param(manifest_case("inspect"), id="manifest-inspect"),
    pytest.param(manifest_case("run", lambda b: None), id="manifest-run-redigested"),
    pytest.param(stale_weights_case("inspect --check", flip=False), id="weights-inspect-check"),
    pytest.param(stale_weights_case("run", flip=False), id="weights-run"),
]


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads; restore the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def pristine_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (save_pretrained, safetensors); cases copy it, never edit it."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("pristine-checkpoint")
    save_tiny("LlamaForCausalLM", path)
    return path


@pytest.fixture
def inputs(tmp_path, request, monkeypatch) -> Inputs:
    monkeypatch.delenv("TRTGRAPH_RAISE_ERRORS", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    return Inputs(tmp_path, request.getfixturevalue)


# ------------------------------------------------------------------------------ helpers

def call_api(args: list[str]):
    """What the CLI does for `args`, through the Python API (no click)."""
    from trtgraph.artifacts import load_manifest
    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config
    from trtgraph.runtime.step.checks import check_manifest
    from trtgraph.runtime.serving.engine import Engine
    from trtgraph.runtime.serving.requests import read_prompts

    cmd, rest = args[0], args[1:]
    opt = dict(zip(rest[::2], rest[1::2])) if cmd != "inspect" else {}
    if cmd == "capture":
        return capture(Config.from_yaml(opt["--config"]), Path(opt["--out"]))
    if cmd == "inspect":
        manifest = load_manifest(rest[0])
        return check_manifest(manifest) if "--check" in rest else manifest
    if cmd == "run":
        requests = read_prompts(opt["--prompts"])
        return list(Engine(opt["--manifest"]).generate(requests))
    raise AssertionError(f"no API equivalent for {cmd}")


def jsonl_rows(text: str) -> dict:
    rows = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    return {r["id"]: r for r in rows}


def assert_culprits(c: Case, text: str, api: bool = False):
    wanted = c.api_culprits if api and c.api_culprits is not None else c.culprits
    missing = [s for s in wanted if s not in text]
    assert not missing, f"{c.name}: the message lacks {missing}:\n{text}"


# -------------------------------------------------------------------------------- tests

def test_case_names_are_unique():
    names = [p.values[0].name for p in CASES]
    assert len(names) == len(set(names))
    assert {p.values[0].group for p in CASES} == {"config", "checkpoint", "prompts", "manifest"}


@pytest.mark.parametrize("c", CASES)
def test_bad_input(c: Case, inputs: Inputs):
    args = c.build(inputs)
    result = CliRunner().invoke(main, args)
    out = result.output
    assert "Traceback" not in out
    assert result.exit_code == c.exit_code, f"exit {result.exit_code}, expected {c.exit_code}:\n{out}"
    if c.exit_code == 2:
        assert out.lstrip().startswith("error: "), out  # one message, no stack
        assert "internal error" not in out
    assert_culprits(c, out)
    rows = jsonl_rows(result.stdout)
    for rid, (reason, error) in c.rows.items():
        assert rows[rid]["finish_reason"] == reason, rows[rid]
        assert (rows[rid]["error"] is None) if error is None else (error in rows[rid]["error"]), rows[rid]
    if c.rows:
        assert set(rows) == set(c.rows)

    # The same input through the API: the declared error class, the same culprits.
    if c.error is None:
        returned = call_api(args)
        assert_culprits(c, str(returned), api=True)
    else:
        with pytest.raises(Exception) as info:
            call_api(args)
        assert type(info.value).__name__ == c.error, repr(info.value)
        assert_culprits(c, str(info.value), api=True)
    assert not (inputs.tmp / "out" / "manifest.json").exists()  # a failed capture writes nothing


@pytest.mark.parametrize("c", [p for p in CASES if p.values[0].terminal])
def test_bad_input_in_a_real_process(c: Case, inputs: Inputs):
    args = c.build(inputs)
    env = {k: v for k, v in os.environ.items() if k != "TRTGRAPH_RAISE_ERRORS"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "trtgraph", *args], cwd=inputs.tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert proc.returncode == c.exit_code, out
    assert proc.stderr.startswith("error: ") and not proc.stdout, out
    assert_culprits(c, proc.stderr)


@pytest.mark.parametrize("build", CONTROLS)
def test_undamaged_input_is_accepted(build, inputs: Inputs):
    result = CliRunner().invoke(main, build(inputs))
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "error: " not in result.stderr, result.output
    for row in jsonl_rows(result.stdout).values():
        assert row["finish_reason"] == "length" and row["error"] is None, row


def test_every_case_is_in_the_reliability_doc():
    doc = (REPO / "docs" / "reliability.md").read_text(encoding="utf-8")
    missing = [p.values[0].name for p in CASES if f"| {p.values[0].name} |" not in doc]
    assert not missing, f"docs/reliability.md lacks rows for {missing}"
