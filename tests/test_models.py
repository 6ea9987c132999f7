"""Hugging Face parity of the trtgraph decoder: CPU, fp32, tiny random checkpoints.

For each architecture the same save_pretrained checkpoint is run by HF transformers and by
trtgraph (load_checkpoint + the eager paged oracle): prefill logits (chunked and whole),
paged decode logits, and greedy generations must agree.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

try:
    from tests.hf_models import ARCHITECTURES, save_tiny
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from hf_models import ARCHITECTURES, save_tiny

from trtgraph.kernels import get_kernels
from trtgraph.models.loader import load_checkpoint
from oracle import EagerSequence, generate

pytest.importorskip("transformers")

CPU = torch.device("cpu")
TOL = 1e-4
MAX_SEQ_LEN = 128
PROMPT_LEN = 37  # crosses 2 block boundaries at block_size 16 and 4 at block_size 8
DECODE_STEPS = 16
GEN_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one intra-op thread (see conftest.one_torch_thread)."""


def _load(path, max_seq_len=MAX_SEQ_LEN):
    return load_checkpoint(path, "float32", CPU, max_seq_len, get_kernels())


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request, tmp_path_factory):
    """(arch, HF model, trtgraph LoadedModel, checkpoint dir) for one architecture."""
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    hf = save_tiny(arch, path, seed=0)
    return arch, hf, _load(path), path


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, 300, (PROMPT_LEN,), generator=gen).tolist()


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("chunk_size", [10, None], ids=["chunk10", "whole"])
def test_prefill_logits_match_hf(pair, prompt, block_size, chunk_size):
    arch, hf, loaded, _ = pair
    ref = _hf_logits(hf, prompt)
    seq = EagerSequence(loaded, PROMPT_LEN + DECODE_STEPS, block_size)
    ours = seq.prefill(prompt, chunk_size)
    assert ours.shape == (PROMPT_LEN, loaded.config.vocab_size)
    assert seq.length == PROMPT_LEN
    err = _max_abs(ours, ref)
    assert err < TOL, f"{arch}: prefill max-abs {err:.3g} (block_size={block_size}, chunk={chunk_size})"
    # The logits are not degenerate: a comparison of near-zero tensors would prove nothing.
    assert ref.std().item() > 1e-2


@torch.no_grad()
def _hf_step(hf, ids: list[int], cache):
    """One incremental HF forward: (last-position logits [1, V], the updated KV cache).
    Transformers 5 names the cache `cache`; 4.x named it `past_key_values`."""
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(torch.tensor([ids]), use_cache=True, **({key: cache} if cache is not None else {}))
    return out.logits[0, -1:].float(), out[key]


@pytest.mark.parametrize("block_size", [16, 8])
def test_decode_logits_match_hf(pair, prompt, block_size):
    """Chunked prefill then 16 single-token paged decode steps, each fed HF's greedy token,
    against HF's own incremental decode with past_key_values."""
    arch, hf, loaded, _ = pair
    seq = EagerSequence(loaded, PROMPT_LEN + DECODE_STEPS, block_size)
    ours = seq.prefill(prompt, chunk_size=10)[-1:]
    ref, past = _hf_step(hf, prompt, None)
    fed = []
    for step in range(DECODE_STEPS):
        err = _max_abs(ours, ref)
        assert err < TOL, f"{arch}: logits at position {PROMPT_LEN + step} differ by {err:.3g}"
        token = int(ref.argmax(-1))
        fed.append(token)
        ours = seq.forward([token])
        ref, past = _hf_step(hf, [token], past)
    assert seq.length == PROMPT_LEN + DECODE_STEPS
    # The last HF step ran with a cache; cross-check it against a full re-run of the sequence.
    full = _hf_logits(hf, prompt + fed)
    assert _max_abs(full[-1:], ref) < TOL
    assert _max_abs(ours, full[-1:]) < TOL


@pytest.mark.parametrize("chunk_size,block_size", [(None, 16), (10, 8)])
def test_greedy_generate_matches_hf(pair, prompt, chunk_size, block_size):
    arch, hf, loaded, _ = pair
    assert hf.generation_config.eos_token_id is None  # else HF could stop early
    ours = generate(loaded, prompt, GEN_TOKENS, chunk_size=chunk_size, block_size=block_size)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.int64),
                          do_sample=False, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS)
    theirs = out[0, PROMPT_LEN:].tolist()
    assert len(ours) == GEN_TOKENS
    assert ours == theirs, f"{arch}: greedy tokens diverge"


# What each architecture's ModelConfig must carry, per tests/hf_models.py.
_EXPECTED = {
    "LlamaForCausalLM": dict(rope_scaling=True, qk_norm=False, qkv_bias=False, tie_word_embeddings=False),
    "MistralForCausalLM": dict(rope_scaling=False, qk_norm=False, qkv_bias=False, tie_word_embeddings=False),
    "Qwen2ForCausalLM": dict(rope_scaling=False, qk_norm=False, qkv_bias=True, tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(rope_scaling=False, qk_norm=True, qkv_bias=False, tie_word_embeddings=False),
}


def test_loaded_config_reflects_architecture(pair):
    arch, hf, loaded, _ = pair
    cfg = loaded.config
    want = _EXPECTED[arch]
    assert cfg.architecture == arch
    assert (cfg.rope_scaling is not None) == want["rope_scaling"]
    assert cfg.qk_norm == want["qk_norm"]
    assert cfg.qkv_bias == want["qkv_bias"]
    assert cfg.tie_word_embeddings == want["tie_word_embeddings"]
    # The structure the flags imply is really there.
    attn = loaded.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") == want["qk_norm"]
    assert (attn.qkv_proj.bias is not None) == want["qkv_bias"]
    assert hasattr(loaded.model, "lm_head") != want["tie_word_embeddings"]
    assert cfg.head_dim == (getattr(hf.config, "head_dim", None) or hf.config.hidden_size // 4)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)  # GQA is exercised


def test_llama_fixture_uses_llama3_rope_scaling(tmp_path):
    """hf_models' Llama must keep llama3 rope scaling, else the scaling path goes untested."""
    save_tiny("LlamaForCausalLM", tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    rope = hf_cfg.get("rope_scaling") or hf_cfg.get("rope_parameters") or {}
    assert rope.get("rope_type", rope.get("type")) == "llama3"
    cfg = _load(tmp_path).config
    assert cfg.rope_scaling_dict == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64.0}
    assert cfg.rope_theta == 50000.0


def test_llama3_rope_scaling_changes_the_logits(tmp_path, prompt):
    """Negative control: the same Llama weights with the scaling dropped from config.json
    must fail the parity tolerance, so the parity tests really see rope scaling."""
    hf = save_tiny("LlamaForCausalLM", tmp_path)
    ref = _hf_logits(hf, prompt)
    cfg_path = tmp_path / "config.json"
    hf_cfg = json.loads(cfg_path.read_text())
    hf_cfg.pop("rope_scaling", None)
    hf_cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    cfg_path.write_text(json.dumps(hf_cfg))
    loaded = _load(tmp_path)
    assert loaded.config.rope_scaling is None
    ours = EagerSequence(loaded, PROMPT_LEN).prefill(prompt)
    assert _max_abs(ours, ref) > 10 * TOL  # measured ~3.7e-3 on this tiny model


def test_mistral_window_equal_to_max_seq_len_is_exact(tmp_path):
    """sliding_window == max_seq_len is accepted, and is then exactly full attention."""
    window = 40
    hf = save_tiny("MistralForCausalLM", tmp_path, sliding_window=window)
    loaded = _load(tmp_path, max_seq_len=window)
    ids = torch.randint(0, 300, (window,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = EagerSequence(loaded, window, block_size=8).prefill(ids, chunk_size=16)
    assert _max_abs(ours, _hf_logits(hf, ids)) < TOL
