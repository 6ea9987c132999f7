"""ModelConfig: the architecture facts trtgraph needs, read from an HF config.json.

Only what the decoder implements is accepted; anything that would change the math and
is not implemented (an unknown architecture, a sliding window shorter than the context,
an unknown rope type, a non-SiLU activation) is refused with WeightLoadError, never run
wrongly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ..errors import WeightLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


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
    def from_hf(cls, hf: dict, source: str, max_seq_len: int | None = None) -> "ModelConfig":
        """Build from a config.json dict. `source` names the file for error messages."""

        def need(key, kind=int):
            if key not in hf:
                raise WeightLoadError(f"{source}: config.json has no `{key}`; it is required for "
                                      f"{arch}. Is this a complete Hugging Face checkpoint?")
            val = hf[key]
            if kind is int and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
                raise WeightLoadError(f"{source}: config.json `{key}` = {val!r}; expected a positive integer.")
            return val

        archs = hf.get("architectures") or ([hf["architecture"]] if "architecture" in hf else [])
        if not archs or not isinstance(archs, list):
            raise WeightLoadError(f"{source}: config.json names no `architectures`; supported are "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise WeightLoadError(f"{source}: architecture {arch!r} is not supported; supported are "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
        def number(key, default):
            val = hf.get(key, default)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or val <= 0:
                raise WeightLoadError(f"{source}: config.json `{key}` = {val!r}; expected a positive number.")
            return val

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = need("num_key_value_heads") if "num_key_value_heads" in hf else heads
        head_dim = need("head_dim") if hf.get("head_dim") is not None else hidden // heads
        if heads % kv_heads:
            raise WeightLoadError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={kv_heads}.")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise WeightLoadError(f"{source}: hidden_act={act!r} is not supported (only 'silu').")
        if hf.get("mlp_bias") or (arch in ("LlamaForCausalLM", "MistralForCausalLM") and hf.get("attention_bias")):
            raise WeightLoadError(f"{source}: mlp_bias/attention_bias on {arch} is not supported.")

        theta, rope_scaling = _rope(hf, source)

        max_pos = int(number("max_position_embeddings", 4096))
        if max_seq_len is not None and max_seq_len > max_pos:
            raise WeightLoadError(f"{source}: limits.max_seq_len={max_seq_len} exceeds the model's "
                                  f"max_position_embeddings={max_pos}; lower limits.max_seq_len.")
        window = hf.get("sliding_window")
        uses_window = window is not None and (arch == "MistralForCausalLM" or hf.get("use_sliding_window"))
        if uses_window and (max_seq_len is None or window < max_seq_len):
            raise WeightLoadError(f"{source}: sliding_window={window} is shorter than limits.max_seq_len="
                                  f"{max_seq_len}; sliding-window attention is not implemented, so this "
                                  f"model would run wrongly. Set limits.max_seq_len <= {window}.")

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(number("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope(hf: dict, source: str) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling as sorted pairs or None). Transformers 5 writes
    `rope_parameters`; older versions `rope_theta` + `rope_scaling`."""
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise WeightLoadError(f"{source}: config.json rope_theta = {theta!r}; expected a positive number.")
    scaling = hf.get("rope_scaling") or rope
    scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise WeightLoadError(f"{source}: rope type {rope_type!r} is not supported; supported are "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
    if rope_type != "llama3":
        return float(theta), None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise WeightLoadError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}.")
    return float(theta), tuple(sorted((k, float(scaling[k])) for k in keys))


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

        def bad(key, expected):
            raise WeightLoadError(f"{source}: `{key}` = {gen.get(key)!r}; expected {expected}. Fix or remove "
                                  f"the field in generation_config.json.")

        eos = gen.get("eos_token_id")
        items = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
            bad("eos_token_id", "a token id or a list of token ids")
        do_sample = gen.get("do_sample", False)
        if not isinstance(do_sample, bool):
            bad("do_sample", "true or false")
        temperature, top_p, top_k = gen.get("temperature"), gen.get("top_p"), gen.get("top_k")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or not 0 <= temperature <= 100):
            bad("temperature", "a number in [0, 100]")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                                  or not 0 < top_p <= 1):
            bad("top_p", "a number in (0, 1]")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            bad("top_k", "an integer >= 0")
        return cls(eos_token_ids=tuple(items), do_sample=do_sample,
                   temperature=None if temperature is None else float(temperature),
                   top_p=None if top_p is None else float(top_p), top_k=top_k)
