"""The eleventh session's adversarial pass over `trtgraph serve` (trtgraph/server/,
trtgraph/formats/): each test is a defect found by attacking a real server on 127.0.0.1
with the `openai` client and raw HTTP, fixed, and kept here."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types import Completion  # noqa: E402

from test_server import API_KEY, MODEL, serving, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def server(default_artifacts, one_torch_thread):
    with serving(default_artifacts) as running:
        yield running


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout, headers={"Authorization": f"Bearer {API_KEY}"})


@contextlib.contextmanager
def slowed(server, seconds: float):
    """Each engine step takes at least `seconds` while inside (so a client can leave mid-request)."""
    engine = server.engine
    step = engine.step

    def slow_step(*a, **kw):
        time.sleep(seconds)
        return step(*a, **kw)

    engine.step = slow_step
    try:
        yield
    finally:
        del engine.step


def aborts(server) -> float:
    return server.metrics().get("trtgraph_requests_total[('outcome', 'abort')]", 0)


@pytest.mark.parametrize("n", [1, 2])
def test_a_non_streamed_request_whose_client_left_is_aborted_mid_decode(server, n):
    """A non-streamed request gets an output from the engine every step, and the server
    looked for a gone client only when none had come for 0.5 s: a client that timed out
    (or was killed) had its request decoded to max_tokens for nobody, holding its batch slot
    and KV blocks (10 s here, 200 steps of 50 ms; the abort counter never moved)."""
    with slowed(server, 0.05):
        before = aborts(server)
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", {"model": MODEL, "prompt": "long", "max_tokens": 200, "temperature": 0.5,
                                             "n": n, "seed": 1}, timeout=1.0)
        wait_for(server.idle_and_leak_free, 3, "the abandoned request to be aborted and its blocks freed")
    assert aborts(server) == before + 1


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert r.status_code == 400 and set(body) == {"error"}, r.text
    return body["error"]


@pytest.mark.parametrize("field, value", [("top_logprobs", 21), ("top_logprobs", -1), ("top_logprobs", True),
                                          ("max_completion_tokens", 0), ("max_completion_tokens", True),
                                          ("max_completion_tokens", 1.5)])
def test_a_bad_chat_only_field_is_named_not_its_native_twin(server, field, value):
    """`top_logprobs: 21` was refused as "field `logprobs` = 21" (param logprobs) and
    `max_completion_tokens: 0` as "field `max_tokens` = 0": the native names of fields the
    client never sent."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    err = error_of(post(server, "/v1/chat/completions", body))
    assert err["param"] == field and f"`{field}`" in err["message"], err
    assert "`logprobs`" not in err["message"] and "`max_tokens`" not in err["message"], err


def test_null_echo_and_best_of_mean_their_defaults(server):
    """OpenAI reads null as "not given" (the server does so for every other field), but
    `echo: null` / `best_of: null` were refused with "`echo` = None is not supported; leave it
    out (or False)"."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    want = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    got = post(server, "/v1/completions", {**body, "echo": None, "best_of": None, "suffix": None})
    assert got.status_code == 200, got.text
    assert Completion.model_validate(got.json()).choices[0].token_ids == want
    err = error_of(post(server, "/v1/completions", {**body, "echo": True}))
    assert err["param"] == "echo" and "(or false)" in err["message"], err


# (`logprobs: 0` with `stream: true` was refused, then let through with `logprobs: null` in every
# chunk; logprobs stream since the nineteenth session: tests/test_r19_stream.py checks `logprobs: 0`.)


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}'),  # an unknown field named by a lone surrogate
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x", "\\udc00": 1}]}'),
    ("/v1/completions", b'{"prompt": "x", "model": 1' + b"0" * 5000 + b"}"),  # a model "name" of 5,001 digits
], ids=["field", "message-field", "model"])
def test_odd_names_get_a_400_not_a_500(server, path, raw):
    """The error echoed the name raw: a lone surrogate cannot be encoded as the UTF-8 JSON
    answer, and json.dumps cannot write the parser's stand-in for a huge integer: 500
    Internal Server Error with a traceback in the server's log."""
    r = httpx.post(server.url + path, content=raw, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"], err


def test_a_long_field_name_is_not_echoed_whole(server):
    """An unknown field's name (or a bad value) came back whole, in the message and in
    `param`: a 2 MB name gave a 4 MB error body."""
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "a" * 2_000_000: 1})
    assert len(error_of(r)["message"]) < 2000 and len(r.content) < 4000


@pytest.mark.parametrize("line", [
    {"custom_id": "\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "model": "\udfff"}},
], ids=["custom_id", "model"])
def test_a_batch_line_whose_echoed_text_is_no_unicode_is_refused_naming_it(tmp_path, line):
    """A custom_id or body.model with a lone surrogate (valid JSON: "\\ud800") is written back
    in the output line, which cannot hold it: `trtgraph run` ended with "internal error:
    UnicodeEncodeError ... please report it" after the model work."""
    import json

    from trtgraph.errors import PromptError
    from trtgraph.formats.batch import read_requests

    f = tmp_path / "batch.jsonl"
    f.write_text(json.dumps(line) + "\n", encoding="utf-8")
    with pytest.raises(PromptError, match=r"line 1: `(custom_id|body\.model)` = .* lone surrogate"):
        read_requests(str(f))


def test_a_huge_body_is_parsed_off_the_event_loop(server):
    """A body of millions of token ids (under the 32 MB limit) is seconds of JSON parsing and
    per-id checks; they ran on the event loop, so every other client waited: GET /health took
    5.7 s during one 30 MB body, every stream stalled as long. They run in a worker thread now."""
    import threading

    body = b'{"prompt": [' + b",".join([b"1"] * 4_000_000) + b'], "max_tokens": 1}'
    done: dict = {}

    def big():
        t0 = time.perf_counter()
        done["r"] = httpx.post(server.url + "/v1/completions", content=body, timeout=120,
                               headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        done["s"] = time.perf_counter() - t0

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)  # its body is in
    waits = []
    while t.is_alive():
        t0 = time.perf_counter()
        httpx.get(server.url + "/health", timeout=60)
        waits.append(time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    assert done["r"].status_code == 400 and "exceeds" in done["r"].json()["error"]["message"]
    assert waits and max(waits) < done["s"] / 3, (waits, done["s"])


def test_a_non_ascii_api_key_can_be_sent():
    """Header bytes reach the app as latin-1 text; the key was compared as that text's UTF-8
    encoding, so `--api-key kéy` sent as UTF-8 (curl from a UTF-8 terminal) was double-encoded
    and refused: every call 401, whatever the client did."""
    from fastapi.testclient import TestClient

    from trtgraph.server.app import create_app
    from trtgraph.server.engine_thread import EngineThread
    from trtgraph.server.metrics import Metrics

    client = TestClient(create_app(EngineThread(lambda: None, Metrics(), 1), MODEL, api_key="kéy-ключ"))
    assert client.get("/v1/models", headers={"Authorization": "Bearer kéy-ключ".encode()}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer kéy-ключа".encode()}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": b"Bearer k\xe9y"}).status_code == 401
