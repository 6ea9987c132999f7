"""ModelConfig: the architecture facts trtgraph needs, read from an HF config.json.

Only what the decoder implements is accepted; anything that would change the math and
is not implemented (an unknown architecture, a sliding window shorter than the context,
an unknown rope type, a non-SiLU activation) is refused with WeightLoadError, never run
wrongly. Every value read is checked for type and range (NaN, inf, sizes past any real
model, a head count that does not divide): a ConfigError names the file (config.json, or
the YAML for `model.synthetic`), the field, the value and the allowed range.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ..errors import ConfigError, WeightLoadError
from ..fields import FieldChecker, defaults
from ..inputs import int_problem, is_int, json_problem, short
from .tokenizer import check_vocab_covers_tokenizer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Integer sizes: (lowest, highest) accepted; the highs are well past any released model.
SIZE_RANGES = {
    "hidden_size": (1, 1 << 17), "intermediate_size": (1, 1 << 20), "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024), "head_dim": (2, 1024),
    "vocab_size": (1, 1 << 22), "max_position_embeddings": (1, 1 << 24),
}
ROPE_THETA_RANGE = (1.0, 1e12)
RMS_NORM_EPS_RANGE = (0.0, 1.0)  # open below
TOKEN_ID_MAX = (1 << 31) - 1
SEED_MAX = (1 << 64) - 1  # torch.Generator.manual_seed takes 64 bits
REQUIRED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "vocab_size")
# Every config.json field from_hf reads; a synthetic spec may hold only these (plus seed).
# config.json fields that do not change inference: a synthetic spec copied from a real config.json may keep them.
INERT_HF_FIELDS = ("model_type", "torch_dtype", "dtype", "transformers_version", "initializer_range",
                   "attention_dropout", "pretraining_tp", "use_cache", "pad_token_id")
HF_FIELDS = ("architectures", *SIZE_RANGES, "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
             "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "sliding_window",
             "use_sliding_window", "bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None  # sorted (key, value) pairs of the llama3 scaling, or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def parameter_count(self) -> int:
        """Parameters of the decoder, from the shapes alone."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        attn += 2 * d if self.qk_norm else 0
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def fingerprint(self) -> str:
        """A stable hash of everything that changes the math."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf(cls, hf: dict, source: str, max_seq_len: int | None = None, prefix: str = "") -> "ModelConfig":
        """Build from a config.json dict. `source` names the file for error messages; `prefix`
        the key path of the fields in it (`model.synthetic.` for a synthetic spec in a YAML)."""
        r = _Fields(hf, source, prefix)
        arch = _architecture(r)
        hidden, heads = r.size("hidden_size", arch), r.size("num_attention_heads", arch)
        kv_heads = r.size("num_key_value_heads", arch) if "num_key_value_heads" in hf else heads
        if heads % kv_heads:
            r.fail("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})")
        if hf.get("head_dim") is not None:
            head_dim = r.size("head_dim", arch)
        elif hidden % heads:
            r.fail("num_attention_heads", heads, f"a divisor of hidden_size ({hidden}), as head_dim is not given")
        else:
            head_dim = hidden // heads
        if head_dim % 2:
            r.fail("head_dim", head_dim, "an even number (rotary embeddings rotate pairs of dimensions)")
        _refuse_unsupported(r, arch)
        theta, rope_scaling = _rope(r)
        max_pos = r.size("max_position_embeddings", arch, default=4096)
        if max_seq_len is not None and max_seq_len > max_pos:
            r.unsupported(f"limits.max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                          f"{max_pos}; lower limits.max_seq_len.")
        _check_sliding_window(r, arch, max_seq_len)
        return cls(
            architecture=arch, hidden_size=hidden, intermediate_size=r.size("intermediate_size", arch),
            num_layers=r.size("num_hidden_layers", arch), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, vocab_size=r.size("vocab_size", arch),
            rms_norm_eps=r.number_at("rms_norm_eps", 1e-6, *RMS_NORM_EPS_RANGE, lo_open=True),
            rope_theta=theta, rope_scaling=rope_scaling, max_position_embeddings=max_pos,
            tie_word_embeddings=r.flag_at("tie_word_embeddings"),
            qkv_bias=arch == "Qwen2ForCausalLM" or r.flag_at("attention_bias"),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=r.token_ids("bos_token_id", many=False),
            eos_token_ids=r.token_ids("eos_token_id", many=True),
        )


def synthetic_model_config(spec: dict, max_seq_len: int, source: str,
                           prefix: str = "model.synthetic.") -> tuple[int, ModelConfig]:
    """(seed, ModelConfig) of a `model.synthetic` spec: config.json fields (`architecture`
    may name the one architecture) plus `seed`. Synthetic models use the byte-level
    tokenizer, so vocab_size must cover its 256 ids: refused here, at capture."""
    seed, hf, r = _synthetic_fields(spec, max_seq_len, source, prefix)
    cfg = ModelConfig.from_hf(hf, source=source, max_seq_len=max_seq_len, prefix=prefix)
    check_vocab_covers_tokenizer(None, cfg.vocab_size, source, prefix + "vocab_size")
    return seed, cfg


def check_synthetic(spec: dict, max_seq_len: int, source: str, prefix: str = "model.synthetic.") -> None:
    """What a config can check of a synthetic spec when it is read: every field present
    (type and range) and, once every required field is given, the whole model config. A
    required field that is missing is reported when the model is built, at capture."""
    _seed, hf, r = _synthetic_fields(spec, max_seq_len, source, prefix)
    if all(k in hf for k in REQUIRED_FIELDS):
        synthetic_model_config(spec, max_seq_len, source, prefix)
    else:
        _check_present_fields(r)
    bad = json_problem(spec, prefix.rstrip("."))  # fields nothing reads, stored in the manifest as JSON
    if bad:
        r.fail(bad[0][len(prefix):], bad[1], bad[2])


def _check_present_fields(r: "_Fields") -> None:
    """Type and range of each field a partial spec gives."""
    hf = r.hf
    for key in SIZE_RANGES:
        if key in hf:
            r.size(key, "")
    if "rms_norm_eps" in hf:
        r.number_at("rms_norm_eps", None, *RMS_NORM_EPS_RANGE, lo_open=True)
    _rope(r)
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        r.flag_at(key)
    r.token_ids("bos_token_id", many=False)
    r.token_ids("eos_token_id", many=True)
    _sliding_window(r)


def _synthetic_fields(spec: dict, max_seq_len: int, source: str, prefix: str) -> tuple[int, dict, "_Fields"]:
    """(seed, the spec as config.json fields, their reader); unknown keys and the seed checked."""
    unknown = sorted(str(k) for k in spec if k not in HF_FIELDS + INERT_HF_FIELDS + ("seed", "architecture"))
    if unknown:
        exc = ConfigError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(prefix + k for k in unknown)}; valid keys under {prefix.rstrip('.')} are: "
                          f"seed, architecture, {', '.join(HF_FIELDS)} (and, ignored, {', '.join(INERT_HF_FIELDS)}).")
        exc.key_path = prefix + unknown[0]
        raise exc
    hf = dict(spec)
    seed = hf.pop("seed", 0)
    r = _Fields(hf, source, prefix)
    r.integer(seed, "seed", 0, SEED_MAX, expected="a non-negative integer below 2**64")
    if "architecture" in hf:
        hf["architectures"] = [hf.pop("architecture")]
    hf.setdefault("max_position_embeddings", max(max_seq_len or 0, 4096))
    return seed, hf, r


class _Fields(FieldChecker):
    """Reads fields of one config.json dict; every error names the file and the field."""

    def __init__(self, hf: dict, source: str, prefix: str):
        self.hf, self.source, self.prefix = hf, source, prefix
        # a checkpoint's config.json cannot be fixed by editing the YAML: that is a weight problem
        self.unsupported_error = ConfigError if prefix else WeightLoadError

    def fail(self, name: str, value, expected: str):
        where = (self.prefix + name).rstrip(".")
        exc = ConfigError(f"{self.source}: {where} = {short(value)} is not allowed; expected {expected}.")
        exc.key_path = where
        raise exc

    def unsupported(self, message: str):
        exc = self.unsupported_error(f"{self.source}: {message}")
        exc.key_path = self.prefix.rstrip(".")
        raise exc

    def size(self, key: str, arch: str, default: int | None = None) -> int:
        if key not in self.hf and default is None:
            where = self.prefix.rstrip(".") or "config.json"
            self.unsupported(f"{where} has no `{key}`; it is required for {arch}. Is this a complete "
                             f"Hugging Face config?")
        return self.integer(self.hf.get(key, default), key, *SIZE_RANGES[key])

    def number_at(self, key: str, default: float, lo: float, hi: float, lo_open: bool = False,
                  d: dict | None = None, name: str | None = None) -> float:
        """`key` of `d` (default: the config), named `name` in messages."""
        return self.number((self.hf if d is None else d).get(key, default), name or key, lo, hi, lo_open)

    def flag_at(self, key: str) -> bool:
        return self.flag(self.hf.get(key), key, nullable=True)

    def token_ids(self, key: str, many: bool):
        val = self.hf.get(key)
        items = val if many and isinstance(val, list) else [val]
        if val is None:
            return () if many else None
        if any(int_problem(t, 0, TOKEN_ID_MAX) for t in items):
            self.fail(key, val, f"a token id in [0, {TOKEN_ID_MAX}]{', a list of them' if many else ''} or null")
        return tuple(items) if many else val


def _architecture(r: _Fields) -> str:
    archs = r.hf.get("architectures")
    if not archs or not isinstance(archs, list):
        r.unsupported(f"{r.prefix or 'config.json '}names no `architectures`; supported are "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    arch = archs[0]
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        r.unsupported(f"architecture {short(arch)} is not supported; supported are "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    return arch


def _refuse_unsupported(r: _Fields, arch: str) -> None:
    act = r.hf.get("hidden_act", "silu")
    if act != "silu":
        r.unsupported(f"hidden_act={short(act)} is not supported (only 'silu').")
    if r.flag_at("mlp_bias") or (arch in ("LlamaForCausalLM", "MistralForCausalLM") and r.flag_at("attention_bias")):
        r.unsupported(f"mlp_bias/attention_bias on {arch} is not supported.")


def _sliding_window(r: _Fields) -> int | None:
    window = r.hf.get("sliding_window")
    if window is not None and int_problem(window, 1, 1 << 24):
        r.fail("sliding_window", window, f"null or {int_problem(window, 1, 1 << 24)}")
    return window


def _check_sliding_window(r: _Fields, arch: str, max_seq_len: int | None) -> None:
    window = _sliding_window(r)
    if window is None:
        return
    if (arch == "MistralForCausalLM" or r.flag_at("use_sliding_window")) and (max_seq_len is None or window < max_seq_len):
        r.unsupported(f"sliding_window={window} is shorter than limits.max_seq_len={max_seq_len}; sliding-window "
                      f"attention is not implemented, so this model would run wrongly. Set limits.max_seq_len "
                      f"<= {window}.")


def _rope(r: _Fields) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling as sorted pairs or None). Transformers 5 writes
    `rope_parameters`; older versions `rope_theta` + `rope_scaling`."""
    for key in ("rope_parameters", "rope_scaling"):
        if r.hf.get(key) is not None and not isinstance(r.hf[key], dict):
            r.fail(key, r.hf[key], "a mapping or null")
    rope = dict(r.hf.get("rope_parameters") or {})
    theta_name = "rope_parameters.rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = r.number_at("rope_theta", r.hf.get("rope_theta", 10000.0), *ROPE_THETA_RANGE, d=rope, name=theta_name)
    rope.pop("rope_theta", None)
    name = "rope_scaling" if r.hf.get("rope_scaling") else "rope_parameters"
    scaling = {k: v for k, v in (r.hf.get("rope_scaling") or rope).items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        r.unsupported(f"rope type {short(rope_type)} is not supported; supported are "
                      f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
    if rope_type != "llama3":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        r.unsupported(f"llama3 rope scaling lacks {', '.join(missing)}.")
    low = r.number_at("low_freq_factor", None, 0.0, 1e3, lo_open=True, d=scaling, name=f"{name}.low_freq_factor")
    values = {
        "factor": r.number_at("factor", None, 1.0, 1e3, d=scaling, name=f"{name}.factor"),
        "low_freq_factor": low,
        # the blend divides by high - low
        "high_freq_factor": r.number_at("high_freq_factor", None, low, 1e3, lo_open=True, d=scaling,
                                     name=f"{name}.high_freq_factor"),
        "original_max_position_embeddings": float(_original_max_positions(r, scaling, name)),
    }
    return theta, tuple(sorted(values.items()))


def _original_max_positions(r: _Fields, scaling: dict, name: str) -> int:
    return r.integer(scaling["original_max_position_embeddings"], f"{name}.original_max_position_embeddings",
                     *SIZE_RANGES["max_position_embeddings"])


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint's generation_config.json says about decoding: its end-of-sequence
    ids (joined to config.json's) and the sampling defaults for requests that omit them.
    As vLLM's generation_config="auto": do_sample false (or absent) makes greedy the
    default; top_p and top_k apply only where the file gives them."""
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @property
    def default_temperature(self) -> float:
        if not self.do_sample:
            return 0.0
        return 1.0 if self.temperature is None else self.temperature

    @classmethod
    def from_hf(cls, gen: dict, source: str) -> "GenerationDefaults":
        """From a generation_config.json dict; `source` names the file in errors."""
        r = _GenerationFields(source)
        eos = gen.get("eos_token_id")
        items = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(not is_int(i) or i < 0 for i in items):
            r.fail("eos_token_id", eos, "a token id or a list of token ids")
        gen = {**defaults(cls), **gen}
        do_sample = r.flag(gen["do_sample"], "do_sample")
        temperature, top_p, top_k = gen["temperature"], gen["top_p"], gen["top_k"]
        if temperature is not None:
            temperature = r.number(temperature, "temperature", 0, 100, expected="a number in [0, 100]")
        if top_p is not None:
            top_p = r.number(top_p, "top_p", 0, 1, lo_open=True, expected="a number in (0, 1]")
        if top_k is not None:
            # the bound a request's top_k has (sampling_params): a default past it failed every request
            r.integer(top_k, "top_k", 0, 1 << 24, expected=f"an integer in [0, {1 << 24}] (0 = no top-k)")
        return cls(eos_token_ids=tuple(items), do_sample=do_sample, temperature=temperature, top_p=top_p,
                   top_k=top_k)


class _GenerationFields(FieldChecker):
    """generation_config.json's checks: a WeightLoadError (the checkpoint's file is wrong)."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, name: str, value, expected: str):
        raise WeightLoadError(f"{self.source}: `{name}` = {value!r}; expected {expected}. Fix or remove "
                              f"the field in generation_config.json.")
