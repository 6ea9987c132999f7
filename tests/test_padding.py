"""Padding rows never disturb real rows: within a key, real rows give bit-identical
outputs whether the other rows are real or padding, and garbage in what padding writes
changes nothing; across keys (the same rows in the smaller key `select()` picks for them) they agree to
rounding and give the same tokens."""

from __future__ import annotations

import pytest
import torch

from trtgraph.buckets import BatchShape, BucketPlan, GraphKey, select
from trtgraph.compiler.verify import random_rows
from trtgraph.runtime.step.executor import Executor

from conftest import tiny_config


@pytest.fixture(scope="module")
def executor():
    cfg = tiny_config()
    return Executor.build(cfg, BucketPlan.from_config(cfg), torch.device("cpu"))


def _run(ex, key, rows):
    ex.prepare(key, rows)
    out = ex.execute(key, eager=True)
    n = len(rows) if key.is_prefill else len(rows) * key.q_len
    return ex.logits(out)[:n].clone(), out.tokens[:n].clone()


@pytest.mark.parametrize("key", [GraphKey(8, 0, 0, "greedy"), GraphKey(8, 0, 0, "sampled"),
                                 GraphKey(4, 0, 16, "greedy"), GraphKey(4, 0, 64, "sampled")])
def test_real_rows_identical_with_and_without_padding(executor, key):
    rows = random_rows(executor, key, torch.Generator().manual_seed(key.batch_size + key.chunk_size))
    full_logits, full_tokens = _run(executor, key, rows)
    for n in ((1, 3) if not key.is_prefill else (1, 2)):
        real = rows[:n]
        # the same rows, padded up to the big key ...
        padded_logits, padded_tokens = _run(executor, key, real)
        # ... and in the smallest key that fits them, as the runtime would pick it
        small = select(executor.plan, BatchShape(n, key.draft_len, key.chunk_size, key.sampling))
        assert small.batch_size < key.batch_size, (small, key)
        alone_logits, alone_tokens = _run(executor, small, real)
        m = padded_logits.shape[0]
        assert torch.equal(padded_logits, full_logits[:m]), "padding rows changed real rows' logits"
        assert torch.equal(padded_tokens, full_tokens[:m])
        # A smaller key runs GEMMs with fewer rows; BLAS may round those differently,
        # so across keys the guarantee is closeness (and equal tokens), not bits.
        torch.testing.assert_close(alone_logits, padded_logits, rtol=0, atol=1e-5)
        assert torch.equal(alone_tokens, padded_tokens)


def test_garbage_in_the_null_block_does_not_reach_real_rows(executor):
    key = GraphKey(4, 0, 0, "greedy")
    rows = random_rows(executor, key, torch.Generator().manual_seed(7))[:2]
    before_logits, _ = _run(executor, key, rows)
    for cache in executor.kv_caches:  # what padding rows write: never read by real rows
        cache[:, 0].normal_()
    after_logits, _ = _run(executor, key, rows)
    assert torch.equal(before_logits, after_logits)
