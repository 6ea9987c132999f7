"""Review of the twelfth session's changes: a greedy step's LM head stores no logits
(`Executor.logits` recomputes them for verification), and the server renders and encodes
prompts in the request's worker thread (`Admission.prepare`)."""

from __future__ import annotations

import pytest

from trtgraph.compiler import pipeline
from trtgraph.models.llama import CausalLM
from trtgraph.runtime import warmup
from trtgraph.runtime.serving.engine import Engine

from conftest import tiny_config


def test_the_warm_up_judges_a_key_by_its_step_not_by_its_verifications_logits(tmp_path, monkeypatch):
    """A greedy key's reference logits are its head run again (`Executor.logits`: the plain head,
    which a sampled step of as many rows runs too). A kernel that recompute first loads is not one
    the greedy step loads: counted as the greedy key's, the start warmed the greedy key (which does
    not load it) and not the sampled key (which does), and recording the sampled key's graph
    loaded it: the start was refused. Fake kernels: one per head kind and row count."""
    loads = set()
    compute_logits, greedy_tokens = CausalLM.compute_logits, CausalLM.greedy_tokens

    def plain_head(self, hidden, normed=None, tokens=None):
        loads.add(("plain head", hidden.shape[0]))
        return compute_logits(self, hidden, normed, tokens)

    def argmax_head(self, hidden, normed, tokens):
        loads.add(("argmax head", hidden.shape[0]))
        return greedy_tokens(self, hidden, normed, tokens)

    monkeypatch.setattr(CausalLM, "compute_logits", plain_head)
    monkeypatch.setattr(CausalLM, "greedy_tokens", argmax_head)
    monkeypatch.setattr(pipeline, "loaded_kernels", lambda: len(loads))
    monkeypatch.setattr(warmup, "loaded_kernels", lambda: len(loads))
    pipeline.capture(tiny_config(), tmp_path)
    loads.clear()  # a fresh process: nothing loaded
    engine = Engine(tmp_path)  # warms totals.warmup_keys, then re-records every key watching for first loads
    [result] = engine.generate([{"id": "a", "prompt": "warm", "max_tokens": 3, "temperature": 0.5}])
    assert len(result.token_ids) == 3
