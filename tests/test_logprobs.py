"""logprobs: computed in the graph from the raw model logits, against transformers."""

from __future__ import annotations

import pytest
import torch

try:
    from tests.test_processors import PROMPT, capture_checkpoint
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from test_processors import PROMPT, capture_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one intra-op thread (see conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf, engine, _ = capture_checkpoint(tmp_path_factory, "logprobs")
    return hf, engine


@torch.no_grad()
@pytest.mark.parametrize("request_fields", [
    {"logprobs": 5},  # greedy otherwise: runs on the sampled key
    {"logprobs": 20, "temperature": 0.9, "seed": 4, "repetition_penalty": 1.3},  # raw logits, not processed
    {"logprobs": 0, "temperature": 1.1, "top_k": 30, "seed": 9},
])
def test_logprobs_equal_log_softmax_of_transformers_logits(setup, request_fields):
    hf, engine = setup
    reqs = [{"id": "lp", "prompt_token_ids": PROMPT, "max_tokens": 10, **request_fields},
            {"id": "other", "prompt_token_ids": PROMPT[:9], "max_tokens": 6, "temperature": 0.7}]
    out = {r.id: r for r in engine.generate(reqs)}
    res, n = out["lp"], request_fields["logprobs"]
    assert out["other"].logprobs is None and "logprobs" not in out["other"].to_json()
    assert len(res.logprobs) == len(res.token_ids) == 10
    ids = list(PROMPT)
    for tok, entry in zip(res.token_ids, res.logprobs):
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        assert entry["token_id"] == tok
        assert abs(entry["logprob"] - float(ref[tok])) < 1e-4
        top = ref.topk(n)
        assert [a["token_id"] for a in entry["top_logprobs"]] == top.indices.tolist()
        for alt, want in zip(entry["top_logprobs"], top.values.tolist()):
            assert abs(alt["logprob"] - want) < 1e-4 and alt["token"] == engine.tokenizer.decode([alt["token_id"]])
        ids.append(tok)
    assert res.to_json()["logprobs"] == res.logprobs


def test_logprobs_field_is_validated():
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.requests import parse_request

    for bad in (21, -1, 2.5, True):
        with pytest.raises(PromptError, match="`logprobs`"):
            parse_request({"id": "x", "prompt": "hi", "logprobs": bad}, "line 1")
