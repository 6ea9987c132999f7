"""The bench's Hugging Face baseline: transformers' eager `generate` on the bench's prompts,
with random weights of the manifest's model shapes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from .bench_sync import free, sync
from .models import DTYPES

if TYPE_CHECKING:
    from .bench import BenchOptions
    from .runtime.step.executor import Executor

Log = Callable[[str], None]


def hf_baseline(ex: Executor, prompts: list[dict], opts: BenchOptions, log: Log) -> dict | None:
    """transformers eager `generate` on the same prompts (random weights of the same shapes)."""
    try:
        import transformers
    except ImportError:
        log("transformers is not installed: no Hugging Face baseline")
        return None
    cfg = ex.loaded.config
    hf_cls = getattr(transformers, cfg.architecture)
    conf_cls = getattr(transformers, cfg.architecture.replace("ForCausalLM", "Config"))
    conf = conf_cls(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                    num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                    num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                    max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
                    rms_norm_eps=cfg.rms_norm_eps, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    with torch.device(ex.device):
        model = hf_cls(conf).to(DTYPES[ex.config.dtype]).eval()
    batch = ex.config.limits.max_batch_size
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        # one short warm-up
        ids = torch.tensor([prompts[0]["prompt_token_ids"]], device=ex.device)
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        sync(ex.device)
        step_t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=opts.run_max_tokens, min_new_tokens=opts.run_max_tokens, do_sample=False)
        sync(ex.device)
        bs1_step_ms = (time.perf_counter() - step_t0) * 1e3 / opts.run_max_tokens
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            ids = torch.tensor([p["prompt_token_ids"] for p in chunk], device=ex.device)
            out = model.generate(ids, max_new_tokens=opts.run_max_tokens, min_new_tokens=opts.run_max_tokens,
                                 do_sample=False, attention_mask=torch.ones_like(ids))
            tokens += (out.shape[1] - ids.shape[1]) * len(chunk)
            log(f"transformers generate: {i + len(chunk)}/{len(prompts)} prompts")
        sync(ex.device)
    seconds = time.perf_counter() - t0
    del model
    free(ex.device)
    return {"version": transformers.__version__, "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds, "batch_size": batch, "bs1_step_ms": bs1_step_ms}
