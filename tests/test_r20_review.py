"""The twentieth session's review of what landed on main during it (the server's lists of
prompts, LLM.chat's template options, the engine's recovery, the OpenAI defaults): each test is
a defect the review found, and failed on the code before its fix."""

from __future__ import annotations

import pytest

import trtgraph
from test_r20_api import LLAMA31, SHIPPED
from trtgraph.models.chat import ChatTemplate

# A template that writes a message's `name` where it has one (as many tool and multi-speaker templates do).
NAMED = ("{% for m in messages %}{% if m.name is defined %}[{{ m.name }}] {% endif %}{{ m.role }}: {{ m.content }}"
         "{% if m.tool_calls is defined %} calls {{ m.tool_calls | length }}{% endif %}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
# As the OpenAI SDK's message objects dump them: the fields a message does not use are None.
WITH_NONES = [{"role": "system", "content": "Be brief.", "name": None},
              {"role": "user", "content": "What is 2+2?", "name": None, "tool_call_id": None},
              {"role": "assistant", "content": "4", "tool_calls": None, "reasoning_content": None},
              {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(SHIPPED))


@pytest.mark.parametrize("template", [NAMED, LLAMA31.replace("strftime_now('%d %b %Y')", "'1 Dec 2026'")],
                         ids=["name-is-defined", "llama-3.1-tool-calls"])
def test_a_message_field_given_as_none_is_left_out_as_transformers_leaves_it(hf_tokenizer, template):
    """transformers 5's apply_chat_template drops every message key whose value is None before
    it renders (`_normalize_chat_messages`: the OpenAI SDK's messages carry `tool_calls: None`,
    `name: None`); the chat template saw them: a template asking `name is defined` wrote
    "[None]", Llama 3.1's took `tool_calls: None` for a tool call and failed (TypeError), so
    LLM.chat refused a plain conversation that transformers and vLLM render."""
    tokens = {"bos_token": hf_tokenizer.bos_token, "eos_token": hf_tokenizer.eos_token}
    want = hf_tokenizer.apply_chat_template(WITH_NONES, chat_template=template, tokenize=False,
                                            add_generation_prompt=True)
    assert ChatTemplate(template, "test", tokens).render(WITH_NONES, add_generation_prompt=True) == want


def test_llm_chat_renders_a_conversation_with_none_fields_as_without_them(default_artifacts, one_torch_thread):
    without = [{k: v for k, v in m.items() if v is not None} for m in WITH_NONES]
    with trtgraph.LLM(default_artifacts) as llm:
        sampling = {"max_tokens": 4, "temperature": 0}
        got, want = (llm.chat(conv, sampling, chat_template=NAMED)[0] for conv in (WITH_NONES, without))
    assert got.finish_reason == "length" and got.error is None
    assert got.token_ids == want.token_ids and got.usage.prompt_tokens == want.usage.prompt_tokens
