"""Tests that need CUDA (`pytest -m gpu`); they skip cleanly without a device.

- Hugging Face parity at bf16 tolerance for the four architectures.
- Capture on the cuda backend: every key replays equal to eager; the replay checks hold.
- The runtime on CUDA graphs: greedy replay equals --eager and the oracle; nothing is
  captured after lock and nothing runs eagerly while replaying.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_models import ARCHITECTURES, save_tiny
from conftest import tiny_config

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _collect_before():
    """Collect the last test's executors first: the graph runner skips gc.collect() per
    capture, and a pinned buffer freed by the collector mid-capture invalidates the graph."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def cuda():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hf_parity_bf16(arch, tmp_path, cuda):
    from trtgraph.kernels import get_kernels
    from trtgraph.models.loader import load_checkpoint
    from oracle import EagerSequence

    hf = save_tiny(arch, tmp_path)  # fp32 reference on the CPU
    ours = load_checkpoint(tmp_path, "bfloat16", cuda, 256, get_kernels())
    ids = torch.randint(0, 300, (1, 53), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [53, V]
    seq = EagerSequence(ours, 256, block_size=16)
    prompt = ids[0, :37].tolist()
    got = [seq.prefill(prompt, chunk_size=10).cpu()]
    for t in ids[0, 37:].tolist():  # 16 paged decode steps, teacher-forced
        got.append(seq.forward([t]).cpu())
    got = torch.cat(got)  # [53, V]
    diff = (got - ref).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{arch}: bf16 max |logit diff| {diff:.4f}, argmax agreement {agree:.3f}")
    assert diff < 0.1 * ref.abs().max().item()
    assert agree >= 0.9


def test_cuda_capture_parity_and_checks(tmp_path, cuda):
    from trtgraph.artifacts import load_manifest
    from trtgraph.compiler.pipeline import capture
    from trtgraph.errors import CaptureError, ReplayMismatchError

    result = capture(tiny_config(device="cuda", dtype="bfloat16"), tmp_path)
    manifest = load_manifest(tmp_path)
    assert manifest.environment["backend"] == "cuda"
    assert all(r.tokens_equal for r in manifest.keys)
    assert manifest.totals["pool_bytes"] > 0
    ex = result.executor
    key = manifest.keys[0].key
    ex.runner.lock()
    with pytest.raises(CaptureError):
        ex.runner.capture(key, ex.step_fn(key), ex.metadata[key])
    pos = ex.buffers.dev.positions[:key.num_tokens]
    with pytest.raises(ReplayMismatchError, match="stale"):
        ex.runner.replay(key, ex.metadata[key], key.num_tokens - 1 if key.num_tokens > 1 else 2, pos)
    old = ex.buffers.ints
    ex.buffers.ints = old.clone()
    with pytest.raises(ReplayMismatchError, match="ints"):
        ex.execute(key)
    ex.buffers.ints = old


def test_cuda_runtime_replay_equals_eager_and_oracle(tmp_path):
    from trtgraph.compiler.pipeline import capture
    from trtgraph.runtime.serving.engine import Engine
    from oracle import generate

    capture(tiny_config(device="cuda", kv_cache={"num_blocks": 24}), tmp_path)
    reqs = [{"id": i, "prompt_token_ids": [(7 * i + j) % 300 for j in range(1 + (37 * i) % 120)],
             "max_tokens": 8 + (11 * i) % 40, "temperature": 0.0 if i % 3 else 0.8, "top_k": 20, "seed": i}
            for i in range(20)]
    engine = Engine(tmp_path)
    captures = engine.executor.runner.num_captures
    replay = {r.id: r.token_ids for r in engine.generate(reqs)}
    assert engine.executor.runner.num_captures == captures
    assert engine.executor.num_eager_steps == 0
    assert engine.stats.preemptions > 0 and engine.stats.fast_path_steps > 0
    del engine
    gc.collect()
    eager_engine = Engine(tmp_path, eager=True)
    eager = {r.id: r.token_ids for r in eager_engine.generate(reqs)}
    assert replay == eager
    for q in reqs:  # fp32 on the GPU: the oracle agrees token for token
        want = generate(eager_engine.executor.loaded, q["prompt_token_ids"], q["max_tokens"],
                        temperature=q["temperature"], top_k=q["top_k"], seed=q["seed"])
        assert replay[str(q["id"])] == want, q["id"]


def test_cuda_out_of_memory_during_capture_names_the_key(tmp_path, cuda):
    """A real memory cap: the batch-512 sampled key's sampler temporaries do not fit."""
    from trtgraph.artifacts import MANIFEST_NAME
    from trtgraph.compiler.pipeline import capture
    from trtgraph.errors import CaptureError

    synthetic = dict(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32000, seed=0)
    cfg = tiny_config(device="cuda", model={"synthetic": synthetic},
                      limits={"max_batch_size": 512, "max_seq_len": 256, "max_num_tokens": 512},
                      kv_cache={"num_blocks": 600},  # a full batch of 512 one-block rows fits: the sampler does not
                      buckets={"batch_sizes": [1, 512], "sampling": ["sampled"], "context_batch_sizes": [1],
                               "chunk_sizes": [16]})
    torch.cuda.empty_cache()
    _free, total = torch.cuda.mem_get_info(cuda)
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(cuda) + (160 << 20)) / total, cuda)
    try:
        with pytest.raises(CaptureError, match=r"bs=512.*out of device memory") as err:
            capture(cfg, tmp_path)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, cuda)
        torch.cuda.empty_cache()
    assert "smaller plan" in str(err.value)
    assert not (tmp_path / MANIFEST_NAME).exists()


def _1b_shapes(tmp_path, layers=2, **changes):
    """Llama-3.2-1B layer shapes (bf16, synthetic weights) with fewer layers, captured."""
    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config

    d = Config.from_yaml("examples/llama-3.2-1b-synthetic.yaml").to_dict()
    d["model"]["synthetic"]["num_hidden_layers"] = layers
    d["buckets"].update(context_batch_sizes=[1, 2, 4, 8], chunk_sizes=[64, 256])  # fewer keys: a quick capture
    d.update(deterministic=True, limits={"max_batch_size": 64, "max_seq_len": 1024, "max_num_tokens": 4096},
             kv_cache={"block_size": 16, "num_blocks": 2048}, output=str(tmp_path), **changes)
    return capture(Config.from_dict(d, source="1b-shapes"), tmp_path)


def test_one_rows_logits_are_bitwise_equal_in_every_decode_bucket(tmp_path):
    from trtgraph.bench import decode_rows

    ex = _1b_shapes(tmp_path).executor
    keys = sorted(k for k in ex.plan.keys if not k.is_prefill and k.draft_len == 0 and k.sampling == "greedy")
    seen = []
    for key in keys:
        rows = decode_rows(ex, key.batch_size, 300)
        for i, r in enumerate(rows[1:]):  # neighbours: other tokens, other context lengths
            r.token_ids, r.start_pos = [(31 * i + 7) % 1000], 40 + (13 * i) % 250
        ex.prepare(key, rows)
        with torch.inference_mode():
            seen.append((key, ex.logits(ex.execute(key))[0].clone(), ex.logits(ex.execute(key, eager=True))[0].clone()))
    for key, replay, eager in seen:
        assert torch.equal(replay, seen[0][1]), key
        assert torch.equal(eager, seen[0][1]), key


def test_32_requests_alone_in_crowds_replayed_and_eager_give_the_same_tokens(tmp_path):
    from trtgraph.runtime.serving.engine import Engine

    _1b_shapes(tmp_path)
    gc.collect()  # the capture's executor, before the engine records (see _collect_before)
    reqs = [{"id": f"r{i}", "prompt_token_ids": [(37 * i + 11 * j) % 5000 + 10 for j in range(3 + (53 * i) % 300)],
             "max_tokens": 24, **({"temperature": 0.8, "top_p": 0.95, "seed": 100 + i} if i % 2 else {})}
            for i in range(32)]
    filler = [{"id": f"f{i}", "prompt_token_ids": [(7 * i + j) % 3000 + 5 for j in range(5 + (97 * i) % 400)],
               "max_tokens": 5 + i % 30} for i in range(40)]
    engine = Engine(tmp_path)

    def tokens(batch):
        return {r.id: r.token_ids for r in engine.generate(batch) if not r.id.startswith("f")}

    alone = {}
    for r in reqs:
        alone.update(tokens([r]))
    crowds = [reqs, filler[:20] + reqs[::-1] + filler[20:], [x for pair in zip(filler, reqs) for x in pair]]
    for n, crowd in enumerate(crowds):
        got = tokens(crowd)
        same = sum(got[k] == alone[k] for k in alone)
        assert same == len(reqs), f"crowd {n}: {same}/{len(reqs)} identical to alone"
    del engine
    gc.collect()
    eager = {r.id: r.token_ids for r in Engine(tmp_path, eager=True).generate(reqs)}
    assert eager == alone
