"""The eleventh session's adversarial pass over `trtgraph serve` (trtgraph/server/,
trtgraph/formats/): each test is a defect found by attacking a real server on 127.0.0.1
with the `openai` client and raw HTTP, fixed, and kept here."""

from __future__ import annotations

import asyncio
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


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": "hi", "logprobs": 0}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                   "logprobs": True, "top_logprobs": 0})])
def test_logprobs_0_with_stream_is_refused_not_dropped(server, path, extra):
    """Logprobs are not streamed (a 400 says so), but `logprobs: 0` passed the check (`0 in
    (None, False)` is true in Python): the stream came back 200 with `logprobs: null` in every
    chunk, the asked-for log-probabilities silently dropped."""
    err = error_of(post(server, path, {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True, **extra}))
    assert err["param"] == "logprobs" and "stream" in err["message"], err
