"""The eighteenth session's adversarial pass over `trtgraph serve` (trtgraph/server/,
trtgraph/formats/): each test is a defect found by talking to a real server on 127.0.0.1
with the official `openai` client and raw HTTP, fixed, and kept here. The server serves the
shipped model (examples/stdlib-llama.yaml: a real tokenizer, chat template and
generation_config), captured once for the module."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

from test_server import API_KEY, serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "stdlib-llama"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_torch_thread):
    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config

    config = Config.from_yaml(ROOT / "examples" / "stdlib-llama.yaml").to_dict()
    config["device"] = "cpu"
    out = tmp_path_factory.mktemp("stdlib-llama-art")
    capture(Config.from_dict(config, base_dir=ROOT / "examples"), out)
    with serving(out) as running:
        yield running


def client(server, key: str = API_KEY) -> openai.OpenAI:
    return server.client(key)


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"} if headers is None else headers)


# ---- a chat without max_tokens is not cut at 16 tokens ------------------------------------

def test_a_chat_without_max_tokens_may_run_to_the_end_of_the_context(server):
    """OpenAI's chat API (and vLLM) give a chat without `max_tokens` / `max_completion_tokens`
    the rest of the context; the server gave it the native default of 16 tokens, so every such
    reply stopped mid-sentence with finish_reason "length"."""
    c = client(server)
    whole = c.chat.completions.create(model=MODEL, messages=HELLO, temperature=0.7, seed=3,
                                      extra_body={"ignore_eos": True})
    max_seq_len = server.engine.admission.max_seq_len
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens + whole.usage.completion_tokens == max_seq_len
    streamed = list(c.chat.completions.create(model=MODEL, messages=HELLO, temperature=0.7, seed=3, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert sum(len(ch.choices[0].token_ids) for ch in streamed) == whole.usage.completion_tokens
    # the same tokens as asking for exactly that many
    asked = c.chat.completions.create(model=MODEL, messages=HELLO, temperature=0.7, seed=3,
                                      max_completion_tokens=whole.usage.completion_tokens,
                                      extra_body={"ignore_eos": True})
    assert asked.choices[0].token_ids == whole.choices[0].token_ids
    # completions keep OpenAI's default of 16
    r = c.completions.create(model=MODEL, prompt="def f():\n", temperature=0.5, seed=1, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_a_chat_without_max_tokens_and_with_min_tokens_past_16_is_served(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, extra_body={"min_tokens": 40})
    assert r.usage.completion_tokens >= 40


def test_a_long_chat_without_max_tokens_gets_what_the_context_leaves(server):
    """A chat whose prompt leaves fewer than 16 tokens was refused for a max_tokens of 16 that
    the client never sent; one that leaves none is refused saying so."""
    max_seq_len = server.engine.admission.max_seq_len
    long = [{"role": "user", "content": " x" * (max_seq_len - 20)}]
    prompt = client(server).chat.completions.create(model=MODEL, messages=long, max_tokens=1).usage.prompt_tokens
    assert max_seq_len - 16 < prompt < max_seq_len
    r = client(server).chat.completions.create(model=MODEL, messages=long, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_seq_len - prompt and r.choices[0].finish_reason == "length"
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": " x" * (max_seq_len + 10)}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_seq_len" in message and "max_tokens" not in message



# ---- OpenAI fields at their "not used" values ----------------------------------------------

@pytest.mark.parametrize("extra", [
    {"tools": None}, {"tool_choice": None}, {"response_format": None}, {"functions": None},
    {"parallel_tool_calls": None}, {"store": None}, {"metadata": None}, {"service_tier": None},
    {"tools": []}, {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"store": False},
])
def test_openai_fields_left_at_not_used_values_are_served(server, extra):
    """Clients that spell out every field send `tools: null`, `response_format: {"type":
    "text"}` and the like; they were refused as unsupported, though null is OpenAI's "not
    given" and these values ask for nothing. The response is the one without them."""
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0}
    r = post(server, "/v1/chat/completions", {**body, **extra})
    assert r.status_code == 200, r.text
    assert ChatCompletion.model_validate(r.json()).choices[0].token_ids == \
        post(server, "/v1/chat/completions", body).json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"store": True}, "store"), ({"max_token": None}, "max_token"),
])
def test_openai_fields_that_ask_for_something_are_still_a_400_naming_them(server, extra, param):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


# ---- auth and the models endpoint ------------------------------------------------------------

def test_the_bearer_scheme_is_case_insensitive_and_a_401_says_which_scheme(server):
    """RFC 9110: an authentication scheme is case-insensitive (`bearer KEY` was a 401), and a
    401 names the scheme it wants in WWW-Authenticate (RFC 6750)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert post(server, "/v1/completions", body, {"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    for headers in ({}, {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer wrong"},
                    {"Authorization": API_KEY}):
        r = post(server, "/v1/completions", body, headers)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_a_model_can_be_retrieved_by_its_id(server):
    """`client.models.retrieve(id)` (GET /v1/models/{id}) was a 404 for the served model."""
    got = client(server).models.retrieve(MODEL)
    assert Model.model_validate(got.model_dump()).id == MODEL
    with pytest.raises(openai.NotFoundError) as exc:
        client(server).models.retrieve("gpt-4")
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.retrieve(MODEL)


def test_health_answers_head(server):
    """Load balancers probe with HEAD; it was a 405."""
    assert httpx.head(server.url + "/health", timeout=30).status_code == 200


# ---- a prompt over the context is OpenAI's context_length_exceeded ------------------------------

@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_a_prompt_over_the_context_is_context_length_exceeded_naming_the_prompt(server, path, field):
    """Clients (LiteLLM, LangChain) tell a context overflow, which they can trim and retry, from
    other 400s by OpenAI's code `context_length_exceeded`; it came with code and param null."""
    max_seq_len = server.engine.admission.max_seq_len
    text = " x" * (max_seq_len + 10)
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    for extra in ({"max_tokens": 4}, {}):
        r = post(server, path, {"model": MODEL, **body, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == field, err
        assert f"limits.max_seq_len ({max_seq_len})" in err["message"]
    # text past what any prompt that fits could spell is refused before encoding (admission's bound); a chat's
    # refusal named `prompt`, a field its body does not have (the nineteenth session's review)
    per_token = server.engine.tokenizer.max_token_chars
    long = "x" * (max_seq_len * per_token * 8 + 1)
    r = post(server, path, {"model": MODEL, **({"prompt": long} if field == "prompt" else
                                               {"messages": [{"role": "user", "content": long}]})})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == field, err
    assert "refused before encoding" in err["message"], err
    r = post(server, path, {"model": MODEL, "max_tokens": max_seq_len, **(
        {"prompt": "x"} if field == "prompt" else {"messages": HELLO})})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err


def test_a_developer_message_is_a_system_message(server):
    """OpenAI's `developer` role (the `openai` client's ChatCompletionDeveloperMessageParam; for
    OpenAI's models it replaces `system`) was a 400; it is rendered as the system message."""
    def tokens(role):
        return client(server).chat.completions.create(
            model=MODEL, messages=[{"role": role, "content": "Answer in Python."}, *HELLO], max_tokens=6,
            temperature=0).choices[0].token_ids
    assert tokens("developer") == tokens("system")
