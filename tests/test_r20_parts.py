"""LLM.chat with OpenAI content parts: a template written for text (it never loops over a
message's content) gets a list of text parts joined into its content, as `serve` joins them and
as vLLM does for such templates; transformers hands it the list, which such a template writes
into the prompt as a Python list (or, like the shipped checkpoint's, fails on). A template that
loops over content gets the parts as given, as transformers renders it."""

from __future__ import annotations

import pytest

from test_r19_files import artifacts  # noqa: F401  (the shipped checkpoint, captured)
from test_r20_api import GREEDY, TOKENS, _hf_render
from trtgraph.models.chat import ChatTemplate

PARTS = [{"role": "user", "content": [{"type": "text", "text": "Write a "}, {"type": "text", "text": "function."}]}]
JOINED = [{"role": "user", "content": "Write a function."}]
TEXT_ONLY = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}"
LOOPS = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
         "{% for p in m.content | selectattr('type', 'equalto', 'text') %}[{{ p.text }}]{% endfor %}{% endif %}"
         "{% endfor %}")


def test_the_shipped_template_serves_text_parts_as_their_joined_text(artifacts):  # noqa: F811
    """The shipped template adds content to a string: with parts it failed (a Completion with
    finish_reason "error"), where serve answered the same messages."""
    import trtgraph

    with trtgraph.LLM(artifacts) as llm:
        [parts] = llm.chat(PARTS, GREEDY)
        [joined] = llm.chat(JOINED, GREEDY)
    assert parts.finish_reason != "error", parts
    assert (parts.token_ids, parts.usage.prompt_tokens) == (joined.token_ids, joined.usage.prompt_tokens)


@pytest.mark.parametrize("source, takes_parts", [(TEXT_ONLY, False), (LOOPS, True)], ids=["text-only", "loops"])
def test_a_template_gets_parts_as_its_content_format_takes_them(source, takes_parts):
    template = ChatTemplate(source, "t", TOKENS)
    assert template.takes_parts is takes_parts
    got = template.render(PARTS, add_generation_prompt=False)
    if takes_parts:
        assert got == _hf_render(source, PARTS, add_generation_prompt=False) == "<user>[Write a ][function.]"
    else:
        assert got == _hf_render(source, JOINED, add_generation_prompt=False) == "<user>Write a function."


def test_parts_that_are_not_all_text_are_left_as_given():
    template = ChatTemplate(TEXT_ONLY, "t", TOKENS)
    mixed = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]
    assert template.render(mixed, add_generation_prompt=False) == _hf_render(TEXT_ONLY, mixed,
                                                                             add_generation_prompt=False)
