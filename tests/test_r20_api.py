"""The twentieth session's pass over the Python API and chat handling (trtgraph.LLM,
SamplingParams, chat templates): LLM.chat's template options as vLLM's (chat_template,
add_generation_prompt, continue_final_message, tools, chat_template_kwargs) rendering as
transformers' apply_chat_template, and what a template may not do. Each test failed on the code
before its fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import trtgraph
from trtgraph.errors import PromptError
from trtgraph.models.chat import ChatTemplate, load_chat_template

SHIPPED = Path(trtgraph.__file__).parent / "assets" / "stdlib-llama"
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

LLAMA31 = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] | trim %}
{%- set messages = messages[1:] %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}{{- ns.system }}{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | tojson + '<|eot_id|>' }}
    {%- elif message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.function.name + '", '
            + '"parameters": ' + call.function.arguments | tojson + '}<|eot_id|>' }}
        {%- endfor %}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}
        {%- if not loop.last or not continue_final_message is defined %}{{- '<|eot_id|>' }}{%- endif %}
    {%- endif %}
    {%- if loop.last and tools %}{{- '\\n' + tools | map(attribute='function.name') | join(',') }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
QWEN_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}
        {%- for tc in message.tool_calls %}
            {{- '\\n<tool_call>\\n' + {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson
                + '\\n</tool_call>' }}
        {%- endfor %}{{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.reasoning_content and not enable_thinking is false %}
            {{- '<think>' + message.reasoning_content + '</think>' }}{%- endif %}
        {{- message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
         "{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "time_now", "parameters": {"type": "object", "properties": {}}}}
TOOL_TURN = [{"role": "system", "content": "Be brief. ünï 🦙"},
             {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "{\"temp\": 21}"},
             {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "read the tool"},
             {"role": "user", "content": "Thanks <b>&</b>"}]
ALTERNATING = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
               {"role": "user", "content": "2+2?"}]
PARTIAL = ALTERNATING + [{"role": "assistant", "content": "It is "}]


def _hf_render(source, messages, tokens=TOKENS, **options):
    from transformers.utils.chat_template_utils import render_jinja_template

    [text], _ = render_jinja_template(conversations=[messages], chat_template=source, **tokens, **options)
    return text


CASES = [  # (template, messages, options)
    (LLAMA31, TOOL_TURN, {"tools": [WEATHER, CLOCK]}),
    (LLAMA31, TOOL_TURN[1:2], {"add_generation_prompt": False}),
    (QWEN_TOOLS, TOOL_TURN, {"tools": [WEATHER], "add_generation_prompt": True}),
    (QWEN_TOOLS, TOOL_TURN, {"enable_thinking": False, "add_generation_prompt": True}),
    (QWEN_TOOLS, PARTIAL, {"continue_final_message": True}),
    (MISTRAL, ALTERNATING, {}),
    (MISTRAL, PARTIAL, {"continue_final_message": True}),
    (GEMMA, ALTERNATING, {"add_generation_prompt": True}),
    (GEMMA, PARTIAL, {"continue_final_message": True}),
]


@pytest.mark.parametrize("source,messages,options", CASES, ids=[
    "llama31-tools", "llama31-no-prompt", "qwen-tools", "qwen-no-thinking", "qwen-continue", "mistral",
    "mistral-continue", "gemma", "gemma-continue"])
def test_templates_render_as_transformers_with_tools_continuation_and_variables(source, messages, options):
    """Real template styles (Llama-3.1 with tools, namespace(), strftime_now and loop.last; Qwen with
    tool calls, tool results, reasoning and enable_thinking; Mistral; Gemma) with every option of
    apply_chat_template render as transformers renders them."""
    template = ChatTemplate(source, "t", TOKENS)
    options = {"add_generation_prompt": False, **options}
    assert template.render(messages, **options) == _hf_render(source, messages, **options)


def test_the_shipped_checkpoint_renders_options_as_transformers():
    from transformers import AutoTokenizer

    from trtgraph.models.tokenizer import HFTokenizer

    hf, ours = AutoTokenizer.from_pretrained(str(SHIPPED)), HFTokenizer(SHIPPED / "tokenizer.json")
    template = load_chat_template(SHIPPED)
    for options in ({"add_generation_prompt": False}, {"continue_final_message": True}):
        want = hf.apply_chat_template(PARTIAL, tokenize=True, return_dict=False, **options)
        got = ours.encode(template.render(PARTIAL, **{"add_generation_prompt": False, **options}),
                          add_special_tokens=False)
        assert got == want, options


def test_a_template_cannot_change_the_callers_messages():
    """`dict` in a template was the type itself: dict.update(messages[0], ...) rewrote the caller's
    message (the immutable sandbox guards a dict's own methods, not the type's). As transformers,
    `dict` only builds dicts now, and the template sees a copy."""
    messages = [{"role": "user", "content": "hi"}]
    sneaky = ChatTemplate("{{ dict.update(messages[0], {'content': 'PWNED'}) }}{{ messages[0].content }}", "t", {})
    with pytest.raises(PromptError, match="chat template of t refused"):
        sneaky.render(messages)
    assert messages == [{"role": "user", "content": "hi"}]
    built = ChatTemplate("{{ dict(a=1) | tojson }}{{ dict.fromkeys(['b']) | tojson }}", "t", {})
    assert built.render(messages) == '{"a": 1}{"b": null}'


@pytest.mark.parametrize("source", ["{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
                                    "{% set ns = namespace(__class__=1) %}{{ ns }}"], ids=["set", "built"])
def test_a_namespace_takes_no_underscore_attributes_as_in_transformers(source):
    with pytest.raises(Exception):
        _hf_render(source, ALTERNATING)
    with pytest.raises(PromptError, match="underscore-prefixed"):
        ChatTemplate(source, "t", {}).render(ALTERNATING)


# ---- LLM.chat on the embedded default (byte-level tokens: a prompt's ids are its UTF-8 bytes) ----

@pytest.fixture(scope="module")
def llm(default_artifacts, one_torch_thread):
    with trtgraph.LLM(default_artifacts) as llm:
        yield llm


GREEDY = {"max_tokens": 4, "temperature": 0}
MISTRAL_PLAIN = MISTRAL.replace("bos_token", "'<s>'").replace("eos_token", "'</s>'")  # (the model has no specials)


def _bytes_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_chat_takes_vllms_template_options(llm):
    """llm.chat(chat_template=, add_generation_prompt=, continue_final_message=, tools=,
    chat_template_kwargs=): each conversation served on the ids of transformers' render."""
    calls = [(LLAMA31.replace("bos_token", "'<s>'"), TOOL_TURN[1:2], {"tools": [CLOCK]}),
             (QWEN_TOOLS, TOOL_TURN[3:], {"chat_template_kwargs": {"enable_thinking": False}}),
             (QWEN_TOOLS, PARTIAL, {"add_generation_prompt": False, "continue_final_message": True}),
             (GEMMA, ALTERNATING, {"add_generation_prompt": False})]
    for source, messages, options in calls:
        hf = {k: v for k, v in options.items() if k != "chat_template_kwargs"}
        hf = {"add_generation_prompt": True, **hf, **options.get("chat_template_kwargs", {})}
        want = llm.generate([_bytes_of(_hf_render(source, messages, {}, **hf))], GREEDY)[0]
        [got] = llm.chat(messages, GREEDY, chat_template=source, **options)
        assert got.error is None and got.usage.prompt_tokens == want.usage.prompt_tokens, options
        assert got.token_ids == want.token_ids


def test_a_template_refusing_one_conversation_refuses_that_one_only(llm):
    """raise_exception() in the template: that conversation's Completion is an error naming the
    template and its message, never a jinja traceback; the others are served, in order."""
    convs = [ALTERNATING, [{"role": "assistant", "content": "first"}], ALTERNATING[:1]]
    out = llm.chat(convs, GREEDY, chat_template=MISTRAL_PLAIN)
    assert [c.finish_reason for c in out] == ["length", "error", "length"]
    assert "chat_template given to LLM.chat" in out[1].error and "roles must alternate" in out[1].error
    want = _bytes_of(_hf_render(MISTRAL_PLAIN, ALTERNATING, {}))
    assert out[0].token_ids == llm.generate([want], GREEDY)[0].token_ids
    assert len({c.id for c in out}) == 3


def test_a_chat_template_trying_to_escape_the_sandbox_is_refused(llm):
    """Escapes end in that conversation's error naming the template (the first four) or render
    nothing of Python's objects (str.format's fields are read by the sandbox's formatter); the
    caller's conversation is left as it was."""
    conversation = [{"role": "user", "content": "hi"}]
    refused = ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ lipsum.__globals__['os'].popen('id').read() }}",
               "{{ cycler.__init__.__globals__ }}", "{{ dict.update(messages[0], {'content': 'x'}) }}"]
    for source in refused:
        [c] = llm.chat(conversation, GREEDY, chat_template=source)
        assert c.finish_reason == "error" and "chat_template given to LLM.chat" in c.error, source
    for source in ["x{% set f = 'x'.format %}{{ f('{0.__class__.__base__}', 1) }}", "x{{ '{0.__class__}'.format(1) }}"]:
        assert "class" not in ChatTemplate(source, "t", {}).render(conversation)
        assert llm.chat(conversation, GREEDY, chat_template=source)[0].error is None
    assert conversation == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("options,match", [
    ({"continue_final_message": True}, "add_generation_prompt=False"),
    ({"add_generation_prompt": "no"}, "`add_generation_prompt` = 'no'"),
    ({"chat_template": "{% for %}"}, "does not compile"),
    ({"chat_template": ""}, "`chat_template`"),
    ({"chat_template_kwargs": {"messages": []}}, "`chat_template_kwargs` key 'messages'"),
    ({"chat_template_kwargs": ["x"]}, "`chat_template_kwargs`"),
    ({"tools": [print]}, "`tools`"),
    ({"tools": ["get_weather"]}, "`tools` holds 'get_weather'"),
    ({"tools": [{"name": "bad\ud800"}]}, "lone surrogate"),
])
def test_bad_chat_options_are_refused_naming_them(llm, options, match):
    with pytest.raises(PromptError, match=match):
        llm.chat(ALTERNATING, GREEDY, **{"chat_template": MISTRAL, **options})


def test_messages_beyond_role_and_content_reach_the_template(llm):
    """tool messages, tool_calls, name, content parts: the template sees them (the plain path
    refused them); a message without a role is refused naming it."""
    source = ("{% for m in messages %}{{ m.role }}:{{ m.name }}:{% for p in m.content %}{{ p | tojson }}{% endfor %};"
              "{% endfor %}")  # (a template that loops over content takes the parts as given: test_r20_parts)
    conv = [{"role": "user", "name": "ann", "content": [{"type": "text", "text": "hé"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    [c] = llm.chat(conv, GREEDY, chat_template=source)
    assert c.usage.prompt_tokens == len(_bytes_of(_hf_render(source, conv, {}, add_generation_prompt=True)))
    with pytest.raises(PromptError, match=r"conversations\[0\]\[1\]"):
        llm.chat([{"role": "user", "content": "x"}, {"content": "no role"}], GREEDY, chat_template=source)


@pytest.mark.parametrize("prompts", [{"hello", "world"}, frozenset({"a", "b"}), {(1, 2), (3, 4)}])
def test_prompts_in_a_set_are_refused_for_their_order(llm, prompts):
    """Completions come back in the prompts' order and name no prompt: from a set (whose order is
    the hash's, not the caller's) nobody could tell which completion is whose."""
    with pytest.raises(PromptError, match="prompts: a set has no order"):
        llm.generate(prompts, GREEDY)
    with pytest.raises(PromptError, match="prompts: a set has no order"):
        llm.stream(prompts, GREEDY)


def test_a_stream_of_n_completions_streams_each_of_them(llm):
    """stream() of a request with n > 1 yielded nothing until all n had finished (one delta, no
    text); now each completion's deltas come as they are drawn, naming it by `index` (with their
    logprob entries when asked), and joined per index they are the completions' tokens and text."""
    sampling = {"max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 5, "logprobs": 1}
    [whole] = llm.generate("stream me", sampling)
    deltas = list(llm.stream("stream me", sampling))
    assert deltas[-1].finished and deltas[-1].completion.choices is not None
    assert len(deltas) > 3 and not any(d.finished for d in deltas[:-1])
    for i, choice in enumerate(whole.choices):
        mine = [d for d in deltas if d.index == i]
        assert [t for d in mine for t in d.token_ids] == choice.token_ids
        assert "".join(d.text for d in mine) == choice.text
        assert [e for d in mine for e in (d.logprobs or [])] == choice.logprobs
        assert any(d.finish_reason == choice.finish_reason for d in mine)
    one = list(llm.stream("stream me", {**sampling, "n": 1}))
    assert {d.index for d in one} == {0} and one[-1].completion.token_ids == [t for d in one for t in d.token_ids]
    [alone] = llm.generate("stream me", {**sampling, "n": 1})
    assert one[-1].completion.logprobs == alone.logprobs == [e for d in one for e in (d.logprobs or [])]


def _nested(depth):
    x = []
    for _ in range(depth):
        x = [x]
    return x


def _holding_itself():
    x = []
    x.append(x)
    return x


@pytest.mark.parametrize("where", ["message", "tools", "chat_template_kwargs"])
@pytest.mark.parametrize("value", [_nested(5000), _holding_itself()], ids=["deep", "cycle"])
def test_values_nested_without_end_are_refused_naming_them(llm, where, value):
    """Data nested thousands deep or holding itself: a PromptError naming the argument, never a
    RecursionError."""
    conv, options = [{"role": "user", "content": "a"}], {}
    if where == "message":
        conv[0]["extra"] = value
    elif where == "tools":
        options["tools"] = [{"a": value}]
    else:
        options["chat_template_kwargs"] = {"a": value}
    name = "conversations[0][0]" if where == "message" else where
    with pytest.raises(PromptError, match=re.escape(f"`{name}`") + ".*nested deeper than"):
        llm.chat(conv, GREEDY, chat_template="{{ messages[0].content }}", **options)


def test_a_chat_template_given_as_a_file_is_read_and_a_path_that_is_none_refused(llm, tmp_path):
    """chat_template="template.jinja" rendered the file's name as the whole prompt (text with no
    `{{` or `{%` is a template that writes itself); a path (str or Path) of a file is read, a str
    that is neither a template nor a file is refused naming it, as vLLM's loader does."""
    path = tmp_path / "gemma.jinja"
    path.write_text(GEMMA)
    want = llm.chat(ALTERNATING, GREEDY, chat_template=GEMMA.replace("bos_token", "''"))[0]
    path.write_text(GEMMA.replace("bos_token", "''"))
    for given in (str(path), path):
        got = llm.chat(ALTERNATING, GREEDY, chat_template=given)[0]
        assert got.error is None and got.token_ids == want.token_ids and \
            got.usage.prompt_tokens == want.usage.prompt_tokens, given
    for missing in ("template.jinja", str(tmp_path / "none.jinja"), tmp_path / "none.jinja"):
        with pytest.raises(PromptError, match="`chat_template`.*neither .*nor a file"):
            llm.chat(ALTERNATING, GREEDY, chat_template=missing)
    (tmp_path / "bad.jinja").write_bytes(b"{{ '\xff' }}")
    with pytest.raises(PromptError, match="bad.jinja.*UTF-8"):
        llm.chat(ALTERNATING, GREEDY, chat_template=tmp_path / "bad.jinja")
    with pytest.raises(PromptError, match="`chat_template`.*directory"):
        llm.chat(ALTERNATING, GREEDY, chat_template=tmp_path)


GENERATION_TAG = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ '<a>' }}{% generation %}{{ m.content }}"
                  "{% endgeneration %}{{ '</a>' }}{% else %}{{ m.content }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<a>{% endif %}")


def test_a_template_with_generation_blocks_renders_as_transformers(tmp_path):
    """`{% generation %}` (transformers' assistant-mask tag, in templates made for training) did not
    compile: the checkpoint's template refused at load, so the engine did not start at all."""
    import json

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": GENERATION_TAG}))
    template = load_chat_template(tmp_path)
    for gen in (True, False):
        assert template.render(ALTERNATING[:2], add_generation_prompt=gen) == \
            _hf_render(GENERATION_TAG, ALTERNATING[:2], add_generation_prompt=gen)


TOOL_USE = ("{{ bos_token }}{% for t in tools or [] %}<tool>{{ t.function.name }}</tool>{% endfor %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
            "{% endif %}")
PLAIN_DEFAULT = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"


def _named_templates_checkpoint(path, layout):
    """A byte-level tokenizer whose checkpoint holds a default and a `tool_use` template: listed in
    tokenizer_config.json, or as chat_template.jinja plus additional_chat_templates/tool_use.jinja."""
    import json

    from test_tokenizer import byte_level_tokenizer

    byte_level_tokenizer(path)
    if layout == "config":
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = [{"name": "default", "template": PLAIN_DEFAULT},
                                {"name": "tool_use", "template": TOOL_USE}]
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    else:
        (path / "chat_template.jinja").write_text(PLAIN_DEFAULT)
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    return path


@pytest.mark.parametrize("layout", ["config", "files"])
def test_tools_pick_the_checkpoints_tool_use_template_as_transformers(tmp_path, layout):
    """A checkpoint with a `tool_use` template (Hermes, Command-R): with `tools`, transformers renders
    that one; trtgraph rendered the default, which never lists the tools (a silently wrong prompt).
    A template's name as `chat_template` picks it too."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from trtgraph.models.chat import load_chat_template
    from trtgraph.runtime.serving.llm_chat import ChatOptions

    path = _named_templates_checkpoint(tmp_path, layout)
    hf = AutoTokenizer.from_pretrained(str(path))
    engine = SimpleNamespace(chat_template=load_chat_template(path),
                             admission=SimpleNamespace(checkpoint_dir=path))
    for options in ({"tools": [WEATHER]}, {}, {"chat_template": "tool_use"},
                    {"tools": [WEATHER], "chat_template": "default"}):
        want = hf.apply_chat_template(ALTERNATING, tokenize=False, add_generation_prompt=True, **options)
        chosen = ChatOptions(engine, options.get("chat_template"), True, False, options.get("tools"), None)
        assert chosen.render(ALTERNATING) == want, options


RAG = ("{% for d in documents %}<doc title={{ d.title | tojson }}>{{ d.text }}</doc>{% endfor %}"
       "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_documents_reach_a_rag_template_through_chat_template_kwargs(llm):
    """`documents` (transformers' apply_chat_template argument for RAG templates, which vLLM passes
    on from chat_template_kwargs) was refused as a reserved name; a list of non-dicts is refused
    as transformers refuses it."""
    docs = [{"title": "Paris", "text": "Capital of France."}, {"title": "Lyon", "text": "Silk."}]
    [got] = llm.chat(ALTERNATING, GREEDY, chat_template=RAG, chat_template_kwargs={"documents": docs})
    want = _hf_render(RAG, ALTERNATING, {}, documents=docs, add_generation_prompt=True)
    assert got.error is None and got.usage.prompt_tokens == len(_bytes_of(want))
    assert got.token_ids == llm.generate([_bytes_of(want)], GREEDY)[0].token_ids
    with pytest.raises(PromptError, match="documents.*dicts"):
        llm.chat(ALTERNATING, GREEDY, chat_template=RAG, chat_template_kwargs={"documents": ["Paris"]})


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_0_d_array_of_prompts_is_refused_naming_prompts(llm, kind):
    """np.array(5) / torch.tensor(5) as the prompts raised Python's TypeError ("iteration over a
    0-d array") from inside generate."""
    import numpy as np
    import torch

    value = np.array(5) if kind == "numpy" else torch.tensor(5)
    for call in (llm.generate, llm.stream):
        with pytest.raises(PromptError, match="prompts: .*0-d"):
            call(value, GREEDY)


@pytest.mark.parametrize("files", [("tokenizer.model",), ("vocab.json", "merges.txt")])
def test_a_tokenizer_only_in_slow_files_is_refused_not_replaced_by_bytes(tmp_path, files):
    """A checkpoint whose tokenizer is only in files `tokenizers` cannot read (SentencePiece's
    tokenizer.model, GPT-2's vocab.json + merges.txt) was served with the byte-level tokenizer:
    every prompt silently became UTF-8 bytes the model never saw. Refused, naming the file and how
    to write tokenizer.json."""
    from trtgraph.errors import TrtgraphError
    from trtgraph.models.tokenizer import check_vocab_covers_tokenizer, load_tokenizer

    for name in files:
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(TrtgraphError, match=f"{files[0]}.*tokenizer.json.*save_pretrained"):
        check_vocab_covers_tokenizer(tmp_path, 32000, str(tmp_path / "config.json"), "vocab_size")
    with pytest.raises(TrtgraphError, match=f"{files[0]}.*tokenizer.json.*save_pretrained"):
        load_tokenizer(tmp_path, 32000, None)
    check_vocab_covers_tokenizer(None, 32000, "default", "vocab_size")  # (a synthetic model: bytes, as before)
    assert load_tokenizer(None, 320, None).encode("é", False) == [0xC3, 0xA9]


def test_chat_with_options_after_close_is_refused_naming_close(default_artifacts):
    from trtgraph.runtime.serving.engine import EngineClosedError

    llm = trtgraph.LLM(default_artifacts)
    llm.close()
    for options in ({"tools": []}, {"chat_template": "x{{ 1 }}"}, {"chat_template": "default"},
                    {"add_generation_prompt": False}):
        with pytest.raises(EngineClosedError, match="closed"):
            llm.chat(ALTERNATING, GREEDY, **options)


def test_an_artifacts_directory_given_as_model_is_told_where_it_goes(default_artifacts):
    """LLM(model=ARTIFACTS), as vLLM's LLM(model=...) is written: `model` here is the checkpoint's
    new place, and the manifest was looked for in ./trtgraph-artifacts ("no manifest here")."""
    for given in (default_artifacts, default_artifacts / "manifest.json"):
        with pytest.raises(PromptError, match=r"`model` = .* holds manifest.json.*LLM\("):
            trtgraph.LLM(model=given)


@pytest.mark.parametrize("family,model_type,declared", [
    ("byte-level", "llama", "LlamaTokenizerFast"),  # DeepSeek-LLM / -Coder: LlamaTokenizerFast over byte-level BPE
    ("byte-level", "qwen2", "LlamaTokenizerFast"),  # DeepSeek-R1-Distill-Qwen
    ("byte-level", "qwen2", None),
    ("byte-level", "qwen3", "PreTrainedTokenizerFast"),
    ("byte-fallback", "mistral", "LlamaTokenizer"),  # Mistral-7B: LlamaTokenizer, model_type mistral
    ("byte-fallback", "llama", "CodeLlamaTokenizer"),  # CodeLlama
    ("byte-fallback", "llama", "LlamaTokenizer"),
    ("byte-level", "qwen2", "Qwen2Tokenizer"),
])
def test_the_tokenizer_transformers_picks_for_a_model_type_and_class_is_the_one_used(tmp_path, family, model_type,
                                                                                      declared):
    """transformers 5 picks a tokenizer's pipeline from tokenizer_class, config.json's model_type and
    whether tokenizer.json is byte-level: LlamaTokenizer over byte-level BPE is used as tokenizer.json
    says (its Metaspace would split every word wrongly), a qwen2 model gets Qwen2Tokenizer whatever
    it declares, a mistral model's LlamaTokenizer is tokenizer.json as is, CodeLlamaTokenizer has its
    own. trtgraph looked at tokenizer_class alone: different ids from transformers' for these."""
    import json

    from transformers import AutoTokenizer
    from transformers import logging as hf_logging

    from test_tokenizer import CORPUS, _id_sequences, byte_fallback_tokenizer, byte_level_tokenizer
    from trtgraph.models.tokenizer import HFTokenizer

    path = (byte_level_tokenizer if family == "byte-level" else byte_fallback_tokenizer)(tmp_path / "t")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("tokenizer_class", None)
    if declared:
        cfg["tokenizer_class"] = declared
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    hf_logging.set_verbosity_error()
    hf, ours = AutoTokenizer.from_pretrained(str(path)), HFTokenizer(path / "tokenizer.json")
    assert [ours.encode(t) for t in CORPUS] == [hf(t)["input_ids"] for t in CORPUS]
    sequences = _id_sequences(hf)
    assert [ours.decode(ids) for ids in sequences] == [hf.decode(ids, skip_special_tokens=True) for ids in sequences]


def test_stop_token_ids_are_taken_as_vllm_spells_them(llm):
    """vLLM's SamplingParams(stop_token_ids=[...]) (and the key in a sampling dict or a prompt dict)
    raised TypeError / "unknown field"; they join `stop`, checked by name."""
    from trtgraph import SamplingParams

    base = llm.generate("hello", {"max_tokens": 8})[0].token_ids
    stop_id = base[2]
    want = llm.generate("hello", {"max_tokens": 8, "stop": [stop_id]})[0]
    assert want.finish_reason == "stop"
    sp = SamplingParams(max_tokens=8, stop=["never"], stop_token_ids=[stop_id])
    assert sp.stop == ("never", stop_id) and sp.stop_token_ids == (stop_id,)
    for sampling, prompt in ((sp, "hello"), ({"max_tokens": 8, "stop_token_ids": [stop_id]}, "hello"),
                             (None, {"prompt": "hello", "max_tokens": 8, "stop_token_ids": [stop_id]})):
        got = llm.generate(prompt, sampling)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    for bad in ([-1], ["x"], 3.5, [True]):
        with pytest.raises(PromptError, match="`stop_token_ids`"):
            SamplingParams(stop_token_ids=bad)
        with pytest.raises(PromptError, match="`stop_token_ids`"):
            llm.generate("hello", {"stop_token_ids": bad})
