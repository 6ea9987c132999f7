"""The logits processors inside the graph against transformers' processors and OpenAI's
formula, through the captured engine (CPU, fp32, a tiny Hugging Face Llama checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch

try:
    from tests.conftest import tiny_config
    from tests.hf_models import save_tiny
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    from conftest import tiny_config
    from hf_models import save_tiny

from trtgraph.config import Config
from trtgraph.kernels import sampler_reference as sampler

PROMPT = [(7 * i + 3) % 300 for i in range(23)]
EOS_AT = 3  # the greedy continuation's token at this index is made the checkpoint's EOS


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one intra-op thread (see conftest.one_torch_thread)."""


def capture_checkpoint(tmp_path_factory, name: str, eos_from: list[int] | None = None):
    """(HF model, engine, eos id or None): a tiny Llama saved with save_pretrained and captured."""
    from trtgraph.compiler.pipeline import capture
    from trtgraph.runtime.serving.engine import Engine

    ck, art = tmp_path_factory.mktemp(name + "-ckpt"), tmp_path_factory.mktemp(name + "-art")
    hf = save_tiny("LlamaForCausalLM", ck, seed=3)
    eos = None
    if eos_from is not None:
        eos = hf_generate(hf, eos_from, 8)[EOS_AT]
        cfg = json.loads((ck / "config.json").read_text())
        cfg["eos_token_id"] = eos
        (ck / "config.json").write_text(json.dumps(cfg))
    d = tiny_config(limits={"max_batch_size": 4, "max_seq_len": 128, "max_num_tokens": 128},
                    buckets={"context_batch_sizes": [1, 2], "chunk_sizes": [16]}).to_dict()
    d["model"] = {"path": str(ck)}
    capture(Config.from_dict(d, source="test_processors"), art)
    return hf, Engine(art), eos


@torch.no_grad()
def hf_generate(hf, prompt, n, **kwargs) -> list[int]:
    kwargs.setdefault("eos_token_id", None)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return capture_checkpoint(tmp_path_factory, "processors", eos_from=PROMPT)


def run(engine, *requests):
    return {r.id: r for r in engine.generate([{"prompt_token_ids": PROMPT, **r} for r in requests])}


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(setup, penalty):
    hf, engine, eos = setup
    # the slot's last occupant leaves a bias table, stop ids and counts behind
    run(engine, {"id": "before", "max_tokens": 3, "logit_bias": {"5": 100}, "min_tokens": 2, "presence_penalty": 2})
    got = run(engine, {"id": "r", "max_tokens": 20, "repetition_penalty": penalty, "ignore_eos": True})["r"]
    want = hf_generate(hf, PROMPT, 20, repetition_penalty=penalty)
    assert got.token_ids == want
    assert want != hf_generate(hf, PROMPT, 20), "the penalty changed nothing: the test would show nothing"


def test_eos_min_tokens_and_ignore_eos_equal_transformers(setup):
    hf, engine, eos = setup
    out = run(engine, {"id": "plain", "max_tokens": 12}, {"id": "min", "max_tokens": 12, "min_tokens": 6},
              {"id": "ignore", "max_tokens": 12, "ignore_eos": True})
    plain = hf_generate(hf, PROMPT, 12, eos_token_id=eos)
    assert out["plain"].token_ids == plain and plain[-1] == eos and len(plain) == EOS_AT + 1
    assert out["plain"].finish_reason == "stop"
    assert out["min"].token_ids == hf_generate(hf, PROMPT, 12, eos_token_id=eos, min_new_tokens=6)
    assert eos not in out["min"].token_ids[:6]
    ignore = hf_generate(hf, PROMPT, 12)  # no EOS: runs to max_new_tokens, EOS included
    assert out["ignore"].token_ids == ignore and ignore[EOS_AT] == eos and out["ignore"].finish_reason == "length"


@torch.no_grad()
def openai_reference(hf, prompt, n, presence, frequency, bias) -> list[int]:
    """Greedy with OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]
    over the generated tokens' counts c."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0]).float()
        logits = logits - counts * frequency - (counts > 0).float() * presence
        for t, b in bias.items():
            logits[t] += b
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.2), (-0.5, 0.8)])
def test_presence_and_frequency_penalties_equal_openai_formula(setup, presence, frequency):
    hf, engine, _ = setup
    bias = {11: 4.0, 250: -100.0}
    got = run(engine, {"id": "p", "max_tokens": 16, "presence_penalty": presence, "frequency_penalty": frequency,
                       "logit_bias": {str(k): v for k, v in bias.items()}, "ignore_eos": True})["p"]
    assert got.token_ids == openai_reference(hf, PROMPT, 16, presence, frequency, bias)
    assert got.token_ids != openai_reference(hf, PROMPT, 16, 0.0, 0.0, {}), "penalties changed nothing"


@torch.no_grad()
def test_sampled_draws_equal_transformers_warpers_with_our_noise(setup):
    """Sampled rows: at each position, transformers' processors (repetition penalty,
    temperature, top-k, min-p) over its own logits, then the Gumbel argmax with the
    request's noise, give the engine's token."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper)

    hf, engine, _ = setup
    req = {"id": "s", "max_tokens": 16, "temperature": 1.3, "top_k": 60, "min_p": 0.05,
           "repetition_penalty": 1.2, "seed": 77, "ignore_eos": True}
    got = run(engine, req)["s"].token_ids
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(1.3),
                                 TopKLogitsWarper(60), MinPLogitsWarper(0.05)])
    ids = list(PROMPT)
    for tok in got:
        scores = procs(torch.tensor([ids]), hf(torch.tensor([ids])).logits[:, -1].float())
        noise = -torch.log(-torch.log(sampler.uniform_noise(torch.tensor([77]), torch.tensor([len(ids)]),
                                                            scores.shape[1])))
        assert tok == int((scores + noise).argmax()), f"position {len(ids)}"
        ids.append(tok)
    assert got != hf_generate(hf, PROMPT, 16), "the draws were greedy: the test would show little"


def test_processed_rows_do_not_depend_on_their_batch(setup):
    """Slots and per-row buffers: a penalised seeded request draws the same tokens alone and
    among other requests (with and without processors), and a plain request is unchanged."""
    _, engine, _ = setup
    pen = {"id": "x", "max_tokens": 14, "temperature": 0.9, "seed": 5, "repetition_penalty": 1.4,
           "frequency_penalty": 0.5, "logit_bias": {"20": 3.0}, "ignore_eos": True}
    plain = {"id": "y", "max_tokens": 14, "temperature": 0.9, "seed": 6, "ignore_eos": True}
    alone = run(engine, pen)["x"].token_ids
    plain_alone = run(engine, plain)["y"].token_ids
    others = [{"id": f"o{i}", "max_tokens": 5 + i, "presence_penalty": 1.0, "ignore_eos": True} for i in range(3)]
    mixed = run(engine, *others, pen, plain)
    assert mixed["x"].token_ids == alone and mixed["y"].token_ids == plain_alone


def test_penalties_are_refused_with_speculative_decoding(setup):
    _, engine, _ = setup
    from trtgraph.runtime.serving.drafter import NgramDrafter

    engine.drafter, before = NgramDrafter(2, 1, 2), engine.drafter
    try:
        out = run(engine, {"id": "p", "max_tokens": 4, "presence_penalty": 1.0})["p"]
    finally:
        engine.drafter = before
    assert out.finish_reason == "error" and "speculative" in out.error


def test_greedy_key_stays_a_pure_argmax():
    """Rows with a processor or logprobs run on sampled keys even at temperature 0."""
    from trtgraph.runtime.serving.requests import Request

    assert Request(id="a", prompt="x").is_greedy
    assert Request(id="a", prompt="x", min_p=0.3).is_greedy  # min_p never drops the argmax
    for extra in ({"repetition_penalty": 1.1}, {"presence_penalty": 0.1}, {"frequency_penalty": -0.1},
                  {"min_tokens": 2}, {"logit_bias": {3: 1.0}}, {"logprobs": 0}, {"temperature": 0.5}):
        assert not Request(id="a", prompt="x", **extra).is_greedy, extra


@pytest.mark.parametrize("field,value", [
    ("min_p", 1.5), ("repetition_penalty", 0), ("repetition_penalty", 3.0), ("presence_penalty", 2.5),
    ("frequency_penalty", "1"), ("min_tokens", 17), ("min_tokens", -1), ("ignore_eos", 1),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [1, 2]),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("stop", list(range(17))),
])
def test_sampling_fields_are_validated(field, value):
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.requests import SamplingParams, parse_request

    with pytest.raises(PromptError, match=f"prompts.jsonl line 4: field `{field}`"):
        parse_request({"id": "x", "prompt": "hi", "max_tokens": 16, field: value}, "prompts.jsonl line 4")
    with pytest.raises(PromptError, match=f"SamplingParams: field `{field}`"):
        SamplingParams(max_tokens=16, **{field: value})


def test_logit_bias_outside_the_vocabulary_is_refused(setup):
    _, engine, _ = setup
    from trtgraph.errors import PromptError

    with pytest.raises(PromptError, match="logit_bias"):
        run(engine, {"id": "b", "max_tokens": 2, "logit_bias": {"300": 1.0}})


def test_sampling_params_distinguish_omitted_from_given():
    from trtgraph.runtime.serving.requests import Request, SamplingParams

    s = SamplingParams()
    assert (s.temperature, s.top_p, s.top_k) == (None, None, None)
    assert SamplingParams(temperature=0.0).temperature == 0.0
    r = s.resolved({"temperature": 0.6, "top_p": 0.9})
    assert (r.temperature, r.top_p, r.top_k) == (0.6, 0.9, 0)
    assert SamplingParams(temperature=0.2).resolved({"temperature": 0.6}).temperature == 0.2
    req = Request(id="a", prompt="x", sampling=SamplingParams(logit_bias={"7": -3}, stop=["ab", 4]))
    assert req.logit_bias == ((7, -3.0),) and req.stop_strings == ("ab",) and req.stop_token_ids == (4,)
    assert (req.temperature, req.top_p, req.top_k) == (0.0, 1.0, 0)
