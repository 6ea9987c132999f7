"""Tiny random Hugging Face models saved with save_pretrained, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_COMMON = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(arch: str, **overrides):
    import transformers

    extra = {}
    if arch == "LlamaForCausalLM":
        extra = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                     rope_theta=50000.0, head_dim=16)
    elif arch == "MistralForCausalLM":
        extra = dict(sliding_window=None, head_dim=16, tie_word_embeddings=False)
    elif arch == "Qwen2ForCausalLM":
        extra = dict(tie_word_embeddings=True)
    elif arch == "Qwen3ForCausalLM":
        extra = dict(head_dim=32, tie_word_embeddings=False)
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return cls(**{**_COMMON, **extra, **overrides})


def save_tiny(arch: str, path: Path, seed: int = 0, max_shard_size=None, **overrides):
    """Build a random fp32 model of `arch`, save it to `path`, and return it (eval mode)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_config(arch, **overrides)).eval()
    with torch.no_grad():  # untrained norms are all ones; perturb them so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model
