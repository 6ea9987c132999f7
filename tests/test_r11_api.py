"""The eleventh session's adversarial pass over the Python API and the engine under it
(trtgraph.LLM, SamplingParams, the engine's admission and step inputs). Each test failed on
the code before its fix."""

from __future__ import annotations

import json
import math
import re

import pytest

from conftest import tiny_config
from trtgraph.runtime.serving.requests import completion_seed


@pytest.fixture(scope="module")
def llm(default_artifacts, one_torch_thread):
    import trtgraph

    return trtgraph.LLM(default_artifacts)


@pytest.fixture(scope="module")
def gen_eos_llm(tmp_path_factory, one_torch_thread):
    """A tiny checkpoint (byte-level text) whose only EOS id, 5, is in generation_config.json."""
    import trtgraph
    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config
    from hf_models import save_tiny

    path = tmp_path_factory.mktemp("gen-eos-ckpt")
    save_tiny("LlamaForCausalLM", path, vocab_size=300)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5], "do_sample": False}))
    d = tiny_config().to_dict()
    d["model"] = {"path": str(path)}
    d["limits"] = {"max_batch_size": 2, "max_seq_len": 64, "max_num_tokens": 64}
    d["buckets"] = {"batch_sizes": [1, 2], "context_batch_sizes": [1], "chunk_sizes": [32], "draft_lens": [0],
                    "sampling": ["greedy", "sampled"]}
    art = tmp_path_factory.mktemp("gen-eos-art")
    capture(Config.from_dict(d, source="test_r11_api"), art)
    return trtgraph.LLM(art)


def test_a_stop_id_outside_the_vocabulary_never_breaks_the_engine(llm):
    """A stop token id >= the vocabulary (or past 64 bits) in a request with a logits processor
    went into the slot's min_tokens mask: the step raised (an index out of bounds; on a GPU an
    out-of-bounds write) and the request stayed live, so every later call on the engine failed.
    Such an id can never be drawn: it is left out of the mask, and the requests are served."""
    for extra in ({"logit_bias": {3: 1}}, {"repetition_penalty": 1.1}, {"min_tokens": 2}):
        for stop in (400, 1 << 70):
            [c] = llm.generate("hi", {"max_tokens": 4, "stop": [stop], "seed": 1, **extra})
            assert c.error is None and len(c.token_ids) == 4, (extra, stop)
    assert len(llm.generate("hi", {"max_tokens": 3})[0].token_ids) == 3
    assert not llm.engine.has_unfinished()


def test_min_tokens_without_any_stop_id_masks_nothing(llm):
    """A model without EOS ids and a request without stop ids: min_tokens has nothing to mask;
    it masked token 0 (the padding of the slot's empty mask list)."""
    for m in (0, 3):
        [c] = llm.generate("hi", {"max_tokens": 5, "temperature": 0, "logit_bias": {0: 100}, "min_tokens": m})
        assert c.token_ids == [0] * 5, m


def test_min_tokens_masks_the_eos_ids_of_generation_config(gen_eos_llm):
    """generation_config.json's EOS ids stop a request as config.json's do, so min_tokens must
    mask them too (README: EOS and stop ids are masked before min_tokens); only config.json's
    were, so the EOS id was drawn inside the first min_tokens tokens and the text went on past it."""
    assert 5 in gen_eos_llm.engine.stop_ids
    [c] = gen_eos_llm.generate([[1, 2, 3]], {"max_tokens": 6, "temperature": 0, "logit_bias": {5: 100},
                                             "min_tokens": 3})
    assert 5 not in c.token_ids[:3] and c.token_ids[3:] == [5] and c.finish_reason == "stop"


@pytest.mark.parametrize("key", ["²", "١٢", "9" * 5000, " 7", "-1", "1e3"],
                         ids=["superscript", "arabic-indic", "5000-digits", "space", "negative", "exponent"])
def test_a_logit_bias_key_int_cannot_read_is_refused_naming_the_field(key):
    """`"²".isdigit()` is true but int() refuses it (a ValueError, the server's 500); so were
    keys of more than 4300 digits. Every key that is not a plain decimal id is refused."""
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.requests import parse_request

    with pytest.raises(PromptError, match=r"p.jsonl line 1: field `logit_bias` = .* unique non-negative token ids"):
        parse_request({"id": 1, "prompt": "x", "logit_bias": {key: 1}}, "p.jsonl line 1", 320)
    assert parse_request({"id": 1, "prompt": "x", "logit_bias": {"007": 1}}, "w", 320).sampling.logit_bias == ((7, 1.0),)


def test_a_completion_of_n_choices_holds_them(llm):
    """n > 1 through the API: the Completion had empty text and token ids, usage.completion_tokens
    0 and no way to reach the choices but to_json(). It now carries them as Completions; each
    equals the request run alone with completion_seed(seed, i) (README)."""
    [c] = llm.generate({"prompt": "abc abc", "n": 3, "max_tokens": 5, "temperature": 0.9, "seed": 11})
    assert c.choices is not None and len(c.choices) == 3
    assert c.usage.completion_tokens == sum(len(x.token_ids) for x in c.choices) == 15
    assert c.usage.completion_tokens == c.to_json()["usage"]["completion_tokens"]
    for i, choice in enumerate(c.choices):
        [alone] = llm.generate({"prompt": "abc abc", "max_tokens": 5, "temperature": 0.9,
                                "seed": completion_seed(11, i)})
        assert (choice.token_ids, choice.text, choice.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
        assert c.to_json()["choices"][i]["token_ids"] == choice.token_ids
    assert llm.generate("abc", {"max_tokens": 2})[0].choices is None


def test_made_ids_never_collide_with_given_or_live_ids(llm):
    """A prompt without an id gets `trtgraph-N`; a call that also gave one the id `trtgraph-N`,
    or a stream still live under it, was refused as a duplicate the caller never sent."""
    import itertools

    llm._next_id = itertools.count(1000)
    out = llm.generate(["y", {"id": "trtgraph-1000", "prompt": "x"}], {"max_tokens": 2})
    assert out[1].id == "trtgraph-1000" and out[0].id not in ("trtgraph-1000",)
    stream = llm.stream({"id": "trtgraph-1002", "prompt": "abc", "max_tokens": 20})
    next(stream)
    assert len({c.id for c in llm.generate(["y", "z"], {"max_tokens": 2})} | {"trtgraph-1002"}) == 3
    stream.close()


@pytest.mark.parametrize("prompts", [None, 5, 2.5, b"abc"], ids=["none", "int", "float", "bytes"])
def test_prompts_of_no_accepted_kind_are_refused_naming_them(llm, prompts):
    """generate(None) / generate(5) raised TypeError ('int' object is not iterable); bytes were
    read as a list of ints and refused as 'got int'."""
    from trtgraph.errors import PromptError

    with pytest.raises(PromptError, match=r"^prompts: expected a string, .* got (NoneType|int|float|bytes)\.$"):
        llm.generate(prompts)


def test_a_request_object_is_still_one_prompt(llm):
    from trtgraph.runtime.serving.requests import Request

    [c] = llm.generate(Request(id="obj", prompt="abc", max_tokens=2))
    assert c.id == "obj" and len(c.token_ids) == 2


def test_a_request_object_with_negative_token_ids_is_refused_alone(llm):
    """A Request built in Python skips parse_request's id check; admission refused ids past the
    vocabulary but not negative ones, so the step raised (ReplayMismatchError) and, the request
    staying live, every later call on the engine raised too."""
    from trtgraph.runtime.serving.requests import Request

    [c] = llm.generate(Request(id="neg", prompt_token_ids=[-1, 5], max_tokens=2))
    assert c.finish_reason == "error" and "prompt token id -1 is outside the vocabulary" in c.error
    assert len(llm.generate("abc", {"max_tokens": 2})[0].token_ids) == 2


def test_a_step_that_raises_at_submit_leaves_no_request_live(llm, monkeypatch):
    """An internal error in the first step (launched by submit on an idle engine) left the
    submitted requests live: every later generate stepped them again and failed the same way."""
    launcher = llm.engine.launcher
    real = launcher.launch

    def broken(step, stats):
        monkeypatch.setattr(launcher, "launch", real)
        raise RuntimeError("injected")

    monkeypatch.setattr(launcher, "launch", broken)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["abc", "defg"], {"max_tokens": 3})
    out = llm.generate(["abc", "xyz"], {"max_tokens": 3})
    assert [len(c.token_ids) for c in out] == [3, 3]
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.allocator.num_free == llm.engine.scheduler.allocator.num_blocks - 1


def test_sampling_params_take_numpy_numbers(llm):
    """Request dicts took numpy numbers (README, docs/reliability.md); SamplingParams built in
    Python refused them ("field `temperature` = np.float32(0.5) is not allowed; expected a
    number in [0, 100]"), and so did numpy ids as logit_bias keys in a dict."""
    np = pytest.importorskip("numpy")
    from trtgraph import SamplingParams

    sp = SamplingParams(max_tokens=np.int32(4), temperature=np.float32(0.5), seed=np.int64(5), top_k=np.int64(3),
                        stop=[np.int64(3)], logit_bias={np.int64(7): np.float32(2.0)}, ignore_eos=np.bool_(False))
    assert (sp.max_tokens, sp.temperature, sp.seed, sp.top_k, sp.stop, sp.logit_bias) == (4, 0.5, 5, 3, (3,), ((7, 2.0),))
    assert type(sp.seed) is int and type(sp.temperature) is float
    assert llm.generate("abc", sp)[0].token_ids == llm.generate("abc", {**dict(max_tokens=4, temperature=0.5, seed=5,
                                                                                top_k=3, stop=[3]),
                                                                        "logit_bias": {7: 2.0}})[0].token_ids
    assert len(llm.generate("abc", {"max_tokens": 2, "logit_bias": {np.int64(7): 1.0}})[0].token_ids) == 2


def test_a_top_k_past_its_bound_is_told_the_bound():
    """top_k = 10**8 was refused with "expected an integer >= 0", which it is."""
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.requests import parse_request

    parse_request({"id": 1, "prompt": "x", "top_k": 1 << 24}, "p.jsonl line 1")
    with pytest.raises(PromptError, match=r"field `top_k` = 100000000 is not allowed; expected an integer in \[0, 16777216\]"):
        parse_request({"id": 1, "prompt": "x", "top_k": 10 ** 8}, "p.jsonl line 1")


@pytest.mark.parametrize("penalty", [1e-38, 5e-324, 0.009])
def test_a_repetition_penalty_whose_quotient_overflows_is_refused(penalty, llm):
    """A seen token's positive logit is divided by the penalty: at 1e-38 the quotient overflowed
    fp32, the probabilities turned NaN and every draw was garbage (all zeros greedy, tokens not in
    the prompt under top-p), silently. The bound is 0.01; there the draws are the prompt's tokens
    boosted, finite."""
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.requests import parse_request

    with pytest.raises(PromptError, match=r"field `repetition_penalty` = .* expected a number in \[0.01, 2\]"):
        parse_request({"id": 1, "prompt": "x", "repetition_penalty": penalty}, "p.jsonl line 1")
    out = llm.generate([[5, 9, 5, 9]], {"max_tokens": 4, "repetition_penalty": 0.01, "ignore_eos": True,
                                         "logprobs": 1})[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    values = re.findall(r'"logprob": ([^,}]+)', json.dumps(out.to_json()))
    assert values and all(math.isfinite(float(v)) for v in values), values


def test_an_empty_call_leaves_the_garbage_collector_on(llm):
    """generate([]) / stream([]) on an idle engine switched Python's cyclic collector off (the
    engine paces it while serving) and, no step ever running, never switched it back on."""
    import gc

    assert gc.isenabled()
    assert llm.generate([]) == [] and gc.isenabled()
    assert list(llm.stream([])) == [] and gc.isenabled()
    assert len(llm.generate("ab", {"max_tokens": 2})[0].token_ids) == 2 and gc.isenabled()


EDGE_MESSAGES = [
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "hi <|end|> there <|bos|><|assistant|>"}],
    [{"role": "system", "content": "  lead\tspace \r\n"}, {"role": "user", "content": "é日本語😀\u200b"}],
    [{"role": "assistant", "content": "x"}],
    [{"role": "user", "content": "{{ 7*7 }} {% raw %}"}],
    [{"role": "user", "content": "<|eos|>"}, {"role": "assistant", "content": "<|pad|> a"}],
    [{"role": "user", "content": "a\u0000b\u00ad\ufeff ﬁ ① Å Å"}],
]


def test_the_shipped_template_renders_edge_messages_as_transformers():
    """(Held.) Special-token strings, template syntax, control and composed characters inside
    message content: the rendered ids equal apply_chat_template's."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import trtgraph
    from trtgraph.models.chat import load_chat_template
    from trtgraph.models.tokenizer import HFTokenizer

    path = Path(trtgraph.__file__).parent / "assets" / "stdlib-llama"
    hf, ours, template = AutoTokenizer.from_pretrained(str(path)), HFTokenizer(path / "tokenizer.json"), \
        load_chat_template(path)
    for messages in EDGE_MESSAGES:
        assert ours.encode(template.render(messages), add_special_tokens=False) == \
            hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False), messages


def test_chat_logprobs_bytes_of_a_token_inside_a_character_are_its_own(llm):
    """A token that is part of a character decodes alone to U+FFFD, and the chat logprobs'
    `bytes` were that text's UTF-8 ([239, 191, 189]), not the token's bytes: a client joining
    `bytes` to rebuild the text got garbage. The embedded model's tokens are bytes; 0xE2 starts a
    three-byte character."""
    from trtgraph.formats import openai as oa

    result = llm.generate("abc", {"max_tokens": 3, "logit_bias": {226: 100}, "logprobs": 2})[0]._result
    tok = llm.engine.tokenizer
    body = oa.chat_completion_object(result, "m", token_bytes=tok.token_bytes)
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[t] for t in result.token_ids] and result.token_ids[0] == 226
    alternatives = [[a["token_id"] for a in e["top_logprobs"]] for e in result.logprobs]
    assert [[a["bytes"] for a in e["top_logprobs"]] for e in content] == \
        [[[t] if t < 256 else [] for t in ids] for ids in alternatives]
    old = oa.chat_completion_object(result, "m")["choices"][0]["logprobs"]["content"][0]
    assert old["token"] == "\ufffd" and old["bytes"] == [239, 191, 189]  # without the tokenizer: the text's
