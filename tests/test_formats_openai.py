"""OpenAI bodies -> native requests, native results -> OpenAI objects (validated with the
`openai` package's own types), and errors -> OpenAI error objects. No model needed."""

from __future__ import annotations

import pytest
pytest.importorskip("openai")  # a test extra (pyproject); skipped where it is not installed
from openai.types import Completion
from openai.types.chat import ChatCompletion

from trtgraph.errors import PromptError
from trtgraph.formats import openai as oa
from trtgraph.models.config import GenerationDefaults
from trtgraph.runtime.serving.requests import Result, parse_request


# ---- requests -------------------------------------------------------------------------------

def test_completion_body_becomes_a_native_request():
    body = {"model": "m", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "n": 2,
            "stop": ["\n", "."], "seed": 7, "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "logit_bias": {"12": -100}, "user": "someone", "stream": False}
    native = oa.completion_request(body, "r1")
    assert native == {"id": "r1", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "n": 2,
                      "stop": ["\n", "."], "seed": 7, "logprobs": 3, "presence_penalty": 0.5,
                      "frequency_penalty": -0.5, "logit_bias": {"12": -100}}


def test_completion_defaults_follow_openai_and_parse_natively():
    native = oa.completion_request({"model": "m", "prompt": [[5, 6, 7]], "n": 3, "seed": 1}, "x")
    assert native == {"id": "x", "prompt_token_ids": [5, 6, 7], "n": 3, "seed": 1}  # temperature: the model's
    req = oa.model_temperature(parse_request(native, "line 1"), GenerationDefaults())  # none given: OpenAI's 1
    assert (req.prompt_token_ids, req.temperature, req.n, req.seed, req.max_tokens) == ((5, 6, 7), 1.0, 3, 1, 16)
    assert oa.completion_request({"prompt": ["one"]}, "y")["prompt"] == "one"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "best_of": 2, "suffix": "z"}, "best_of"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "a", "stream": True}, "stream"),
])
def test_completion_body_refusals_name_the_field(body, param):
    with pytest.raises(oa.OpenAIRequestError) as e:
        oa.completion_request(body, "r", "batch.jsonl line 4")
    assert e.value.param == param and "batch.jsonl line 4" in str(e.value) and param in str(e.value)
    assert isinstance(e.value, PromptError)
    err = oa.error_from_exception(e.value)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_stream_is_left_to_the_caller_when_allowed():
    assert "stream" not in oa.completion_request({"prompt": "a", "stream": True}, "r", allow_stream=True)


def test_chat_body_becomes_native_request_with_messages():
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                    {"type": "text", "text": "there"}]}],
            "max_completion_tokens": 9, "n": 2, "logprobs": True, "top_logprobs": 4, "stop": "x", "seed": 3,
            "temperature": 0.0, "presence_penalty": 1.0}
    native = oa.chat_request(body, "c1")
    assert native == {"id": "c1", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi there"}],
                      "max_tokens": 9, "n": 2, "logprobs": 4, "stop": "x", "seed": 3, "temperature": 0.0,
                      "presence_penalty": 1.0}
    assert oa.chat_request({"messages": [{"role": "user", "content": "q"}], "logprobs": True}, "c")["logprobs"] == 0
    assert "logprobs" not in oa.chat_request({"messages": [{"role": "user", "content": "q"}], "logprobs": False}, "c")
    assert oa.chat_request({"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}, "c")["max_tokens"] == 4


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[1].content"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ({"prompt": "x"}, "prompt"),
])
def test_chat_body_refusals_name_the_field(body, param):
    with pytest.raises(oa.OpenAIRequestError) as e:
        oa.chat_request(body, "r")
    assert e.value.param == param


def test_a_native_value_error_becomes_an_error_object_naming_the_field():
    native = oa.completion_request({"prompt": "a", "top_p": 2}, "r")
    with pytest.raises(PromptError) as e:
        parse_request(native, "b.jsonl line 2")
    err = oa.error_from_exception(e.value)
    assert err == {"error": {"message": str(e.value), "type": "invalid_request_error", "param": "top_p",
                             "code": None}}


# ---- responses ------------------------------------------------------------------------------

def one_result(**kw) -> Result:
    base = dict(id="r", text="abc", token_ids=[4, 5, 6], finish_reason="length", prompt_tokens=7)
    return Result(**{**base, **kw})


def test_completion_object_parses_with_openai_types():
    obj = oa.completion_object(one_result(finish_reason="stop"), "tiny", created=123, response_id="cmpl-1")
    parsed = Completion.model_validate(obj)
    assert parsed.choices[0].text == "abc" and parsed.choices[0].finish_reason == "stop"
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (7, 3, 10)
    assert parsed.id == "cmpl-1" and parsed.model == "tiny" and parsed.created == 123
    assert parsed.choices[0].logprobs is None


def test_n_choices_become_openai_choices_and_usage_sums_them():
    children = [one_result(text=t, token_ids=list(range(k)), finish_reason=f)
                for t, k, f in [("a", 2, "stop"), ("bb", 5, "length")]]
    parent = Result(id="r", prompt_tokens=3, choices=children)
    comp = Completion.model_validate(oa.completion_object(parent, "m"))
    assert [(c.index, c.text, c.finish_reason) for c in comp.choices] == [(0, "a", "stop"), (1, "bb", "length")]
    assert comp.usage.completion_tokens == 7 and comp.usage.total_tokens == 10
    chat = ChatCompletion.model_validate(oa.chat_completion_object(parent, "m"))
    assert [c.message.content for c in chat.choices] == ["a", "bb"]
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == 3
    assert chat.id.startswith("chatcmpl-") and comp.id.startswith("cmpl-") and comp.id != chat.id


def test_logprobs_translate_to_both_openai_shapes():
    lp = [{"token_id": 4, "logprob": -0.5, "top_logprobs": [{"token_id": 4, "logprob": -0.5},
                                                          {"token_id": 9, "logprob": -1.5}]},
          {"token_id": 5, "logprob": -0.25, "top_logprobs": [{"token_id": 5, "logprob": -0.25}]}]
    res = one_result(text="ab", token_ids=[4, 5])
    res.logprobs = lp  # the sampler's per-token logprobs (intermediate shape, see formats/openai.py)
    text = {4: "a", 5: "b", 9: "é"}.get
    comp = Completion.model_validate(oa.completion_object(res, "m", token_text=text))
    got = comp.choices[0].logprobs
    assert got.tokens == ["a", "b"] and got.token_logprobs == [-0.5, -0.25] and got.text_offset == [0, 1]
    assert got.top_logprobs == [{"a": -0.5, "é": -1.5}, {"b": -0.25}]
    chat = ChatCompletion.model_validate(oa.chat_completion_object(res, "m", token_text=text))
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [("a", -0.5), ("b", -0.25)]
    assert content[0].top_logprobs[1].token == "é" and content[0].top_logprobs[1].bytes == [0xC3, 0xA9]


def test_an_error_result_is_refused_as_a_choice_and_becomes_an_error_object():
    bad = one_result(finish_reason="error", error="prompt too long", token_ids=[])
    with pytest.raises(ValueError):
        oa.completion_object(bad, "m")
    err = oa.error_from_result(bad)["error"]
    assert "prompt too long" in err["message"] and err["type"] == "invalid_request_error"


# ---- the server's side: streaming, extensions, chunks ----------------------------------------

def test_streaming_options_are_read_and_checked_only_where_allowed():
    body = {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}}
    assert "stream" not in oa.completion_request(body, "r", allow_stream=True)
    assert oa.stream_mode(body) == (True, True) and oa.stream_mode({"prompt": "a"}) == (False, False)
    for bad, param in [({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": True}}, "stream_options"),
                       ({"stream": True, "stream_options": {"x": 1}}, "stream_options")]:
        with pytest.raises(oa.OpenAIRequestError) as e:
            oa.completion_request({"prompt": "a", **bad}, "r", allow_stream=True)
        assert e.value.param == param
    # n > 1 and logprobs stream (tests/test_r19_stream.py)
    assert oa.completion_request({"prompt": "a", "stream": True, "n": 2, "logprobs": 1}, "r", allow_stream=True)["n"] == 2
    assert oa.chat_request({"messages": [{"role": "user", "content": "q"}], "stream": True, "logprobs": True}, "r",
                           allow_stream=True)["logprobs"] == 0


def test_native_sampling_fields_pass_as_extensions_and_are_validated_natively():
    native = oa.completion_request({"prompt": "a", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
                                    "min_tokens": 2, "ignore_eos": True}, "r")
    req = parse_request(native, "body")
    assert (req.top_k, req.min_p, req.repetition_penalty, req.min_tokens, req.ignore_eos) == (5, 0.1, 1.2, 2, True)
    with pytest.raises(PromptError) as e:
        parse_request(oa.completion_request({"prompt": "a", "top_k": -1}, "r"), "body")
    assert oa.error_from_exception(e.value)["error"]["param"] == "top_k"
    for message, param in [({"role": "user", "content": "q", "name": "bob"}, "messages[0].name"),
                           ({"role": "tool", "content": "q"}, "messages[0].role")]:
        with pytest.raises(oa.OpenAIRequestError) as e:
            oa.chat_request({"messages": [message]}, "r")
        assert e.value.param == param


def test_stream_chunks_parse_with_openai_types():
    from openai.types.chat import ChatCompletionChunk

    chat = oa.Response(True, "m")
    first = ChatCompletionChunk.model_validate(chat.chunk("Hi", [4], include_usage=True))
    last = ChatCompletionChunk.model_validate(chat.chunk("!", [5], "stop", include_usage=True))
    usage = ChatCompletionChunk.model_validate(chat.usage_chunk(one_result(token_ids=[4, 5], finish_reason="stop")))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == "Hi"
    assert first.usage is None and last.choices[0].finish_reason == "stop" and last.choices[0].delta.role is None
    assert usage.choices == [] and usage.usage.completion_tokens == 2 and first.id == last.id == usage.id
    assert first.id.startswith("chatcmpl-") and first.object == "chat.completion.chunk"
    text = oa.Response(False, "m")
    chunk = Completion.model_validate(text.chunk("ab", [4, 5], "length"))
    assert chunk.choices[0].text == "ab" and chunk.choices[0].token_ids == [4, 5] and chunk.object == "text_completion"
    full = Completion.model_validate(text.full(one_result()))
    assert full.id == chunk.id and full.choices[0].token_ids == [4, 5, 6]
