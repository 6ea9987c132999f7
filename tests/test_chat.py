"""Chat requests: templates render as transformers renders them, a chat request's greedy tokens
equal transformers' `generate` on the rendered ids, generation_config.json's end-of-turn id
stops a sequence and its sampling fields are the defaults of requests that leave them out."""

from __future__ import annotations

import json

import pytest
import torch

from trtgraph.config import Config
from trtgraph.errors import PromptError
from trtgraph.models.chat import load_chat_template
from trtgraph.models.tokenizer import HFTokenizer
from trtgraph.runtime.serving.requests import parse_request

from conftest import tiny_config
from hf_models import save_tiny
from test_tokenizer import byte_fallback_tokenizer, byte_level_tokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# What other templates use: loop controls, tojson of non-ASCII, strftime_now, trimmed blocks.
FEATURES = """{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {{ m | tojson }}|{{ m.content | tojson(indent=2) }}
{% endfor %}
{{ strftime_now('%Y') }}{% if add_generation_prompt %}>{% endif %}"""

SYSTEM_MULTI_TURN = [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Hi there 🦙"},
                     {"role": "assistant", "content": "  Hello!  "},
                     {"role": "user", "content": "What is 2+2? <|eot_id|> ünïcode"}]
ALTERNATING = [m for m in SYSTEM_MULTI_TURN if m["role"] != "system"]


def _checkpoint_files(path, style: str, template_in: str = "config"):
    """Tokenizer files of one style with its chat template, in tokenizer_config.json or beside it."""
    if style == "mistral":
        byte_fallback_tokenizer(path)
        template = MISTRAL
    else:
        extra = {"llama3": ["<|start_header_id|>", "<|end_header_id|>"], "qwen25": ["<|im_start|>", "<|im_end|>"],
                 "features": []}[style]
        byte_level_tokenizer(path, extra_specials=extra, eos="<|im_end|>" if style == "qwen25" else "<|eot_id|>")
        template = {"llama3": LLAMA3, "qwen25": QWEN25, "features": FEATURES}[style]
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if template_in == "config":
        cfg["chat_template"] = template
    elif template_in == "named":
        cfg["chat_template"] = [{"name": "tool_use", "template": "{{ 'wrong' }}"}, {"name": "default", "template": template}]
    else:
        (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("style,template_in", [("llama3", "config"), ("qwen25", "config"), ("mistral", "config"),
                                               ("llama3", "jinja"), ("qwen25", "named"), ("features", "config")])
def test_prompt_ids_equal_apply_chat_template(style, template_in, tmp_path):
    from transformers import AutoTokenizer

    path = _checkpoint_files(tmp_path, style, template_in)
    hf = AutoTokenizer.from_pretrained(str(path))
    template, ours = load_chat_template(path), HFTokenizer(path / "tokenizer.json")
    chats = [ALTERNATING, ALTERNATING[:1], ALTERNATING[:2]] if style == "mistral" else \
        [SYSTEM_MULTI_TURN, SYSTEM_MULTI_TURN[1:2], SYSTEM_MULTI_TURN[:2]]
    for messages in chats:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)
            got = ours.encode(template.render(messages, add_generation_prompt=gen), add_special_tokens=False)
            assert got == want, (messages, gen)
            assert template.render(messages, gen) == hf.apply_chat_template(messages, add_generation_prompt=gen,
                                                                             tokenize=False)


def test_a_template_that_refuses_raises_a_prompt_error(tmp_path):
    template = load_chat_template(_checkpoint_files(tmp_path, "mistral"))
    with pytest.raises(PromptError, match="roles must alternate"):
        template.render(SYSTEM_MULTI_TURN)


def test_messages_are_validated_naming_the_field():
    ok = parse_request({"id": 1, "messages": ALTERNATING}, "p.jsonl line 1")
    assert ok.chat_messages == ALTERNATING and ok.prompt is None
    bad = [({"id": 1, "messages": []}, "`messages`"),
           ({"id": 1, "messages": [{"role": "tool", "content": "x"}]}, r"`messages\[0\].role`"),
           ({"id": 1, "messages": [{"role": "user", "content": 3}]}, r"`messages\[0\].content`"),
           ({"id": 1, "messages": [{"role": "user", "content": "x", "name": "a"}]}, r"`messages\[0\]`"),
           ({"id": 1, "messages": ALTERNATING, "prompt": "x"}, "exactly one of")]
    for raw, field in bad:
        with pytest.raises(PromptError, match=f"p.jsonl line 1: .*{field}"):
            parse_request(raw, "p.jsonl line 1")


# ---- end to end on a tiny Llama with a Llama-3 style tokenizer and template -------------------

def _config_for(path, **limits) -> Config:
    d = tiny_config().to_dict()
    d["model"] = {"path": str(path)}
    d["limits"] = {"max_batch_size": 2, "max_seq_len": 128, "max_num_tokens": 128, **limits}
    d["buckets"] = {"batch_sizes": [1, 2], "context_batch_sizes": [1, 2], "chunk_sizes": [32], "draft_lens": [0],
                    "sampling": ["greedy", "sampled"]}
    return Config.from_dict(d, source="test_chat")


def _hf_greedy(model, ids, n, eos):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                             max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, one_torch_thread):
    """(artifacts dir, checkpoint dir, HF model, HF tokenizer, end-of-turn id): the end-of-turn id
    is one the model emits greedily a few tokens into its answer, listed only in
    generation_config.json, with sampling defaults there too."""
    from transformers import AutoTokenizer

    from trtgraph.compiler.pipeline import capture

    path = _checkpoint_files(tmp_path_factory.mktemp("chat-ckpt"), "llama3")
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    model = save_tiny("LlamaForCausalLM", path, vocab_size=len(hf_tok))
    ids = hf_tok.apply_chat_template(SYSTEM_MULTI_TURN, add_generation_prompt=True, return_dict=False)
    out = _hf_greedy(model, ids, 12, eos=None)
    firsts = [k for k, t in enumerate(out) if out.index(t) == k]
    eot = out[next((k for k in firsts if k >= 2), firsts[-1])]
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eot], "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}))
    art = tmp_path_factory.mktemp("chat-art")
    capture(_config_for(path), art)
    return art, path, model, hf_tok, eot


def test_chat_request_greedy_tokens_equal_transformers_generate(chat_model):
    from trtgraph.runtime.serving.engine import Engine

    art, _path, model, hf_tok, eot = chat_model
    engine = Engine(art)
    for i, messages in enumerate([SYSTEM_MULTI_TURN, SYSTEM_MULTI_TURN[1:2]]):
        ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        want = _hf_greedy(model, ids, 10, eos=[eot])
        [got] = engine.generate([{"id": i, "messages": messages, "max_tokens": 10, "temperature": 0}])
        assert got.error is None and got.prompt_tokens == len(ids)
        assert got.token_ids == want
        assert got.finish_reason == ("stop" if want[-1] == eot else "length")
        assert got.text == hf_tok.decode(want, skip_special_tokens=True)


def test_the_end_of_turn_id_in_generation_config_stops_the_sequence(chat_model):
    from trtgraph.runtime.serving.engine import Engine

    art, _path, _model, _hf_tok, eot = chat_model
    engine = Engine(art)
    assert eot in engine.stop_ids and eot not in engine.executor.loaded.config.eos_token_ids
    [got] = engine.generate([{"id": "a", "messages": SYSTEM_MULTI_TURN, "max_tokens": 12, "temperature": 0}])
    assert got.finish_reason == "stop" and got.token_ids[-1] == eot and eot not in got.token_ids[:-1]
    assert len(got.token_ids) < 12


def test_requests_without_sampling_fields_get_the_generation_config_defaults(chat_model):
    from trtgraph.runtime.serving.engine import Engine

    art = chat_model[0]
    engine = Engine(art)
    base = {"messages": SYSTEM_MULTI_TURN, "max_tokens": 12, "seed": 7}
    explicit = {**base, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
    results = {r.id: r for r in engine.generate([{"id": "default", **base}, {"id": "explicit", **explicit},
                                                 {"id": "greedy", **base, "temperature": 0}])}
    assert results["default"].token_ids == results["explicit"].token_ids
    assert results["default"].token_ids != results["greedy"].token_ids  # the default really samples
    assert engine.generation.to_json() == json.loads(
        (art / "manifest.json").read_text())["model"]["generation_config"]


def test_a_checkpoint_without_a_template_refuses_chat_per_request(default_artifacts):
    from trtgraph.runtime.serving.engine import Engine

    engine = Engine(default_artifacts)
    results = {r.id: r for r in engine.generate([{"id": "chat", "messages": ALTERNATING[:1], "max_tokens": 2},
                                                 {"id": "text", "prompt": "hello", "max_tokens": 2}])}
    assert results["chat"].finish_reason == "error" and "no chat template" in results["chat"].error
    assert results["text"].finish_reason == "length" and results["text"].error is None


def test_the_shipped_model_tokenizes_and_renders_as_transformers():
    from pathlib import Path

    from transformers import AutoTokenizer

    import trtgraph
    from trtgraph.models.loader import read_generation_config

    path = Path(trtgraph.__file__).parent / "assets" / "stdlib-llama"
    assert (path / "model.safetensors").stat().st_size <= 16 << 20
    hf, ours = AutoTokenizer.from_pretrained(str(path)), HFTokenizer(path / "tokenizer.json")
    template = load_chat_template(path)
    for text in ["import os\n\ndef main():\n    return 0\n", "class Stack:\n\tpass  # 🦙 ünï"]:
        assert ours.encode(text) == hf(text)["input_ids"]
    for messages in (SYSTEM_MULTI_TURN, ALTERNATING[:1]):
        assert ours.encode(template.render(messages), add_special_tokens=False) == \
            hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    gen = read_generation_config(path)
    assert gen.do_sample and gen.eos_token_ids == (1, hf.convert_tokens_to_ids("<|end|>"))


BROKEN = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ 1 // ((messages | length) - 1) }}"


def test_a_template_that_fails_in_python_is_a_prompt_error_naming_it(tmp_path):
    """A template whose own code fails on some messages (here: a division by zero for one
    message) refuses those messages like a raise_exception() — never an internal error."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": BROKEN, "bos_token": "<s>"}))
    template = load_chat_template(tmp_path)
    assert template.render(ALTERNATING[:2]) == "<s>" + "".join(m["content"] for m in ALTERNATING[:2]) + "1"
    with pytest.raises(PromptError, match=r"tokenizer_config.json.*ZeroDivisionError"):
        template.render(ALTERNATING[:1])


def test_a_template_failing_on_one_request_refuses_that_one_only(default_artifacts, tmp_path):
    from trtgraph.runtime.serving.engine import Engine

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": BROKEN}))
    engine = Engine(default_artifacts)
    engine.admission.chat_template = load_chat_template(tmp_path)  # the synthetic model has none of its own
    results = {r.id: r for r in engine.generate([{"id": "one", "messages": ALTERNATING[:1], "max_tokens": 2},
                                                 {"id": "two", "messages": ALTERNATING[:2], "max_tokens": 2},
                                                 {"id": "text", "prompt": "hello", "max_tokens": 2}])}
    assert results["one"].finish_reason == "error" and "ZeroDivisionError" in results["one"].error
    assert results["two"].finish_reason == "length" and results["text"].finish_reason == "length"
