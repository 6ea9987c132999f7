"""The capture's verification of a key that is not a verify key ignores the accepted-counts
buffer, which such a key leaves as the last verify key wrote it (compiler/verify.py): with
verifications read LAG_KEYS keys after their capture, a prefill key's replay could otherwise
follow another verify key's run and differ from its eager reference there (a plan of 64 rows
failed to capture on the CPU that way: "max |logit diff| = 0, tokens equal: False")."""

from __future__ import annotations

import pytest
import torch

from trtgraph.compiler.verify import eager_reference, launch_verify

from conftest import tiny_config

K = 3


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    from trtgraph.compiler.pipeline import capture
    from trtgraph.runtime.serving.engine import Engine

    out = tmp_path_factory.mktemp("spec-capture")
    capture(tiny_config(speculative={"draft_len": K, "ngram_min": 1, "ngram_max": 3}), out)
    return Engine(out)


def test_a_key_that_is_not_a_verify_key_passes_whatever_the_accepted_buffer_holds(spec_engine):
    ex = spec_engine.executor
    keys = [k for k in spec_engine.manifest.graph_keys if not k.draft_len]
    assert any(k.is_prefill for k in keys) and any(not k.is_prefill for k in keys)
    with torch.inference_mode():
        for i, key in enumerate(keys):
            ref = eager_reference(ex, key, seed=100 + i)
            ex.buffers.accepted.copy_(torch.arange(ex.buffers.accepted.numel()) % (K + 1) + 1)  # another key's
            parity = launch_verify(ex, key, 100 + i, ref).parity()
            assert parity.ok, (key, parity)


def test_a_verify_key_still_compares_its_accepted_counts(spec_engine, monkeypatch):
    ex = spec_engine.executor
    key = next(k for k in spec_engine.manifest.graph_keys if k.draft_len)
    with torch.inference_mode():
        ref = eager_reference(ex, key, seed=7)
        assert launch_verify(ex, key, 7, ref).parity().ok
        ref.accepted += 1  # a replay whose accepted counts differ from the reference's
        parity = launch_verify(ex, key, 7, ref).parity()
    assert not parity.ok and not parity.tokens_equal
