"""Tensor parallelism on the CPU: 2 ranks with gloo, fp32 (the same code runs with NCCL on GPUs).

The sharded model computes what the single-process model computes; capture and run at
tensor_parallel_size 2 give the single-process tokens; ranks that disagree on the keys stop
at once with a message instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import yaml
from click.testing import CliRunner

from trtgraph.cli import main
from trtgraph.errors import CaptureError, RankLostError, WeightLoadError
from trtgraph.runtime.distributed import agree, launch

from conftest import tiny_config
from hf_models import save_tiny

PROMPT = list(range(40, 77))


def _forward(tp, source_kind, path):
    """On every rank: prefill in chunks plus two decode steps; rank 0 returns the logits."""
    from trtgraph.config import ModelSource
    from trtgraph.kernels import get_kernels
    from trtgraph.models import load_model
    from oracle import EagerSequence

    source = Config_default_model() if source_kind == "synthetic" else ModelSource(path=path)
    lm = load_model(source, "float32", torch.device("cpu"), 256, get_kernels(), tp)
    seq = EagerSequence(lm, 64)
    logits = [seq.prefill(PROMPT, chunk_size=10)] + [seq.forward([t]) for t in (5, 6)]
    # plain lists: tensors would cross processes through shared memory that dies with the rank
    return torch.cat(logits).tolist(), sum(p.numel() for p in lm.model.parameters())


def Config_default_model():
    from trtgraph.config import Config

    return Config.default().model


@pytest.mark.parametrize("kind", ["synthetic", "checkpoint"])
def test_sharded_model_computes_the_single_process_logits(kind, tmp_path):
    path = None
    if kind == "checkpoint":
        save_tiny("Qwen2ForCausalLM", tmp_path, max_shard_size="20KB")  # tied embeddings, qkv bias, shards
        path = str(tmp_path)
    from trtgraph.models.parallel import TPGroup

    want, full_params = _forward(TPGroup(), kind, path)
    got, rank0_params = launch(2, _forward, kind, path, use_cuda=False)
    want, got = torch.tensor(want), torch.tensor(got)
    assert rank0_params < full_params  # rank 0 really holds a shard
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_size_that_does_not_divide_the_heads_is_refused():
    from trtgraph.config import Config
    from trtgraph.kernels import get_kernels
    from trtgraph.models import load_model
    from trtgraph.models.parallel import TPGroup

    with pytest.raises(WeightLoadError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        load_model(Config.default().model, "float32", torch.device("cpu"), 256, get_kernels(), TPGroup(0, 3))


def _write_config(path, tp: int):
    d = tiny_config(parallel={"tensor_parallel_size": tp}, kv_cache={"num_blocks": 30}).to_dict()
    path.write_text(yaml.safe_dump(d))
    return path


def test_capture_and_run_at_size_2_give_the_single_process_tokens(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "hello world " * (1 + i % 9),
                                           "max_tokens": 8 + 3 * i, "temperature": 0.0 if i % 2 else 0.8,
                                           "seed": i}) + "\n" for i in range(16)))
    outputs = {}
    for tp in (1, 2):
        cfg, art, out = _write_config(tmp_path / f"tp{tp}.yaml", tp), tmp_path / f"art{tp}", tmp_path / f"o{tp}.jsonl"
        res = CliRunner().invoke(main, ["capture", "--config", str(cfg), "--out", str(art)])
        assert res.exit_code == 0, res.output
        assert ("phases: not measured at tensor_parallel_size 2" in res.output) == (tp == 2), res.output
        manifest = json.loads((art / "manifest.json").read_text())
        assert manifest["parallel"]["tensor_parallel_size"] == tp and len(manifest["parallel"]["ranks"]) == tp
        res = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(art), "--output", str(out)])
        assert res.exit_code == 0, res.output
        outputs[tp] = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert outputs[2] == outputs[1]


def _disagree(tp):
    agree(tp, "graph keys", f"key list seen by rank {tp.rank}")


def test_ranks_that_disagree_stop_at_once_with_a_message():
    start = time.perf_counter()
    with pytest.raises(CaptureError, match=r"rank \d: ranks disagree on graph keys \(ranks \[0\] have .*; "
                                           r"ranks \[1\] have"):
        launch(2, _disagree, use_cuda=False)
    assert time.perf_counter() - start < 60


def _killed_on_rank1(tp):
    if tp.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)  # rank 0 waits, as at a collective, until the launcher stops it


def test_a_rank_killed_from_outside_is_named_not_an_internal_error():
    start = time.perf_counter()
    with pytest.raises(RankLostError, match=r"rank 1 was ended by SIGKILL from outside trtgraph .*--resume"):
        launch(2, _killed_on_rank1, use_cuda=False)
    assert time.perf_counter() - start < 25  # rank 0 stopped with it, not waited for


def _capture_with_rank1_plan_differing(tp, cfg_dict, out):
    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config

    if tp.rank == 1:
        cfg_dict = {**cfg_dict, "buckets": {**cfg_dict["buckets"], "batch_sizes": [1, 2, 8]}}
    capture(Config.from_dict(cfg_dict), out, tp=tp)


def test_capture_fails_fast_when_a_rank_has_another_key_list(tmp_path):
    cfg = tiny_config(parallel={"tensor_parallel_size": 2}).to_dict()
    with pytest.raises(CaptureError, match="ranks disagree on the config and its bucket plan"):
        launch(2, _capture_with_rank1_plan_differing, cfg, tmp_path, use_cuda=False)
    assert not (tmp_path / "manifest.json").exists()


def test_running_a_tp_manifest_in_one_process_is_refused(tmp_path):
    from trtgraph.errors import ManifestError
    from trtgraph.runtime.serving.engine import Engine

    art = tmp_path / "art"
    res = CliRunner().invoke(main, ["capture", "--config", str(_write_config(tmp_path / "c.yaml", 2)), "--out", str(art)])
    assert res.exit_code == 0, res.output
    with pytest.raises(ManifestError, match="captured with tensor_parallel_size 2, loaded on 1 rank"):
        Engine(art)
