"""A greedy step's LM head writes the tokens alone (no fp32 logits: at 64 rows of the 1B, 33 MB of
writes fewer); `Executor.logits` gives the logits that head would have stored, from the step's
recorded head input, for verification and tests."""

from __future__ import annotations

import os

import pytest
import torch

from trtgraph.buckets import BucketPlan, GraphKey
from trtgraph.compiler.verify import random_rows
from trtgraph.runtime.step.executor import Executor

from conftest import tiny_config

KERNELS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])  # the CPU executor's sets


@pytest.fixture(scope="module", params=KERNELS)
def executor(request):
    cfg = tiny_config(kernels=request.param)
    return Executor.build(cfg, BucketPlan.from_config(cfg), torch.device("cpu"))


@pytest.mark.parametrize("key", [GraphKey(4, 0, 0, "greedy"), GraphKey(2, 0, 16, "greedy")])
@pytest.mark.parametrize("eager", [True, False])
def test_a_greedy_step_writes_tokens_and_no_logits(executor, key, eager):
    ex = executor
    if not eager and key not in ex.runner._graphs:
        ex.capture(key)
    rows = random_rows(ex, key, torch.Generator().manual_seed(3))
    ex.prepare(key, rows)
    out = ex.execute(key, eager=eager)
    assert out.logits is None
    R = key.num_logit_rows
    assert out.hidden.shape == (R, ex.model.cfg.hidden_size)
    logits = ex.logits(out)
    assert logits.shape == (R, ex.model.cfg.vocab_size) and logits.dtype == torch.float32
    # what the head storing its logits gives (the argmax op with store on): the same values, bitwise
    tokens = torch.full((R,), -1, dtype=torch.int64)
    stored = ex.model.compute_logits(out.hidden, out.normed, tokens=tokens)
    assert torch.equal(logits, stored)
    assert torch.equal(out.tokens[:R], tokens)
    assert torch.equal(out.tokens[:R], logits.argmax(dim=-1))


def test_a_sampled_step_keeps_its_logits(executor):
    ex = executor
    key = GraphKey(4, 0, 0, "sampled")
    ex.prepare(key, random_rows(ex, key, torch.Generator().manual_seed(4)))
    out = ex.execute(key, eager=True)
    assert out.logits is not None and ex.logits(out) is out.logits


@pytest.mark.skipif("triton" not in KERNELS, reason="needs TRITON_INTERPRET=1 (the Triton set on the CPU)")
def test_the_fused_head_of_a_greedy_step_stores_no_logits(monkeypatch):
    """The Triton set's fused GEMV as the head (forced here: the tiny model's shapes run composed
    on the CPU): the argmax-only epilogue gives the tokens of the logits Executor.logits computes."""
    from trtgraph.kernels import decode_linear as dl

    cfg = tiny_config(kernels="triton")
    ex = Executor.build(cfg, BucketPlan.from_config(cfg), torch.device("cpu"))
    head = tuple(ex.model.lm_head_weight.shape)
    monkeypatch.setitem(dl._CHOICE, ("norm_linear", *head), dl.FUSED)
    launched = []
    launch = dl._launch
    monkeypatch.setattr(dl, "_launch", lambda mode, *a, **k: launched.append(mode) or launch(mode, *a, **k))
    key = GraphKey(4, 0, 0, "greedy")
    ex.prepare(key, random_rows(ex, key, torch.Generator().manual_seed(5)))
    out = ex.execute(key, eager=True)
    assert launched == [dl._ARGMAX_ONLY] and out.logits is None
    logits = ex.logits(out)
    assert launched == [dl._ARGMAX_ONLY, dl._PLAIN]
    assert torch.equal(out.tokens[:4], logits.argmax(dim=-1))
