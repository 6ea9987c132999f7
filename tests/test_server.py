"""`trtgraph serve` (trtgraph/server/): a real uvicorn server on 127.0.0.1, talked to with the
official `openai` client. Greedy and seeded requests get exactly the tokens `trtgraph run`
gives (completions, streaming and not); bad requests get OpenAI error JSON (400 naming the
field, 401, 429); a client that disconnects has its sequence aborted and its KV blocks
freed; /health and /metrics parse; a bounded load test of concurrent streaming clients ends
with every response complete and equal to the offline run and no KV block leaked. Last,
the CLI: `trtgraph serve` under SIGTERM finishes or aborts in-flight work and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")  # a test extra (pyproject); skipped where it is not installed
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from trtgraph.server.app import build_server

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
MODEL = "trtgraph-synthetic"
START_TIMEOUT_S = 300
NUM_CLIENTS, REQUESTS_PER_CLIENT = 32, 4

BASIC = [
    {"id": "greedy-text", "prompt": "The server says", "max_tokens": 12},
    {"id": "greedy-ids", "prompt_token_ids": [(9 * j) % 310 for j in range(30)], "max_tokens": 10},
    {"id": "seeded", "prompt": "a seeded ¿qué? draw", "max_tokens": 14, "temperature": 0.9, "top_k": 50,
     "seed": 77},
    {"id": "seeded-top-p", "prompt": "top p", "max_tokens": 9, "temperature": 1.3, "top_p": 0.8, "seed": 5},
    {"id": "too-long", "prompt_token_ids": [3] * 250, "max_tokens": 50},
    {"id": "n2", "prompt": "two of them", "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": 2},
    {"id": "logprobs", "prompt": "how likely", "max_tokens": 5, "temperature": 0, "logprobs": 3},
]


def load_requests() -> list[dict]:
    rng = random.Random(0)
    out = []
    for c in range(NUM_CLIENTS):
        for k in range(REQUESTS_PER_CLIENT):
            req = {"id": f"load-{c}-{k}", "prompt": f"client {c} request {k} " * rng.randint(1, 4),
                   "max_tokens": rng.randint(2, 12)}
            if (c + k) % 2:
                req.update(temperature=0.7, seed=1000 * c + k)
            out.append(req)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def body_of(req: dict, chat: bool = False) -> dict:
    """The OpenAI body of a run request (less `messages` for a chat). A request without a
    temperature is greedy in `run` and says so to OpenAI, whose default is 1."""
    body = {k: v for k, v in req.items() if k not in ("id", "prompt", "prompt_token_ids", "top_k", "messages")}
    body.setdefault("temperature", 0)
    if not chat:
        body["prompt"] = req.get("prompt", req.get("prompt_token_ids"))
    if "top_k" in req:
        body.setdefault("extra_body", {})["top_k"] = req["top_k"]
    return body


def run_offline(artifacts, requests: list[dict], d: Path) -> dict:
    """`trtgraph run` over `requests`: {id: result line}."""
    prompts, out = d / "prompts.jsonl", d / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", str(prompts), "--manifest",
                    str(artifacts), "--output", str(out)], check=True, capture_output=True, env=env, timeout=600)
    return {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}


@pytest.fixture(scope="module")
def offline(default_artifacts, tmp_path_factory):
    """`trtgraph run` over every request the tests send: {id: result line}."""
    return run_offline(default_artifacts, BASIC + load_requests(), tmp_path_factory.mktemp("offline"))


class Running:
    def __init__(self, server, thread, port):
        self.server, self.thread, self.port = server, thread, port
        self.url = f"http://127.0.0.1:{port}"
        self.health_before_load: int | None = None

    def client(self, key: str = API_KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {s.name + str(sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    @property
    def engine(self):
        return self.thread.engine

    def idle_and_leak_free(self) -> bool:
        e = self.engine
        return (not e.has_unfinished() and not e.scheduler.running and not e.scheduler.waiting
                and e.scheduler.allocator.num_free == e.executor.num_blocks - 1)


@contextlib.contextmanager
def serving(artifacts):
    """A uvicorn server over `artifacts` on a free port of 127.0.0.1, healthy; stopped after."""
    port = free_port()
    srv, thread = build_server(artifacts, "127.0.0.1", port, max_waiting=64, api_key=API_KEY,
                               log_level="warning")
    runner = threading.Thread(target=srv.run, daemon=True)
    runner.start()
    running = Running(srv, thread, port)
    try:
        wait_for(lambda: srv.started, 60, "uvicorn to start")
        running.health_before_load = httpx.get(running.url + "/health", timeout=30).status_code
        thread.start()
        wait_for(lambda: httpx.get(running.url + "/health", timeout=30).status_code == 200, START_TIMEOUT_S,
                 "GET /health to answer 200")
        yield running
    finally:
        srv.should_exit = True
        runner.join(60)
        assert not runner.is_alive(), "the server did not stop within 60 s"


@pytest.fixture(scope="module")
def server(default_artifacts, one_torch_thread):
    with serving(default_artifacts) as running:
        yield running


# ---- health, models, exact tokens ----------------------------------------------------------

def test_health_is_503_until_the_graphs_are_locked_then_200(server):
    assert server.health_before_load == 503
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    assert [m.id for m in server.client().models.list().data] == [MODEL]


@pytest.mark.parametrize("rid", ["greedy-text", "greedy-ids", "seeded", "seeded-top-p"])
def test_completion_gives_run_tokens(server, offline, rid):
    want = offline[rid]
    req = next(r for r in BASIC if r["id"] == rid)
    c = server.client().completions.create(model=MODEL, **body_of(req))
    (choice,) = c.choices
    assert choice.token_ids == want["token_ids"] and choice.text == want["text"]
    assert choice.finish_reason == want["finish_reason"] == "length"
    assert c.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert c.usage.completion_tokens == len(want["token_ids"])
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


@pytest.mark.parametrize("rid", ["greedy-text", "seeded"])
def test_streamed_completion_gives_run_tokens_and_usage(server, offline, rid, monkeypatch):
    want = offline[rid]
    req = next(r for r in BASIC if r["id"] == rid)
    # A reader slower than the engine gets merged chunks (app._merged): steps 50 ms apart, so
    # that on a loaded machine the stream is still seen arriving token by token.
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda *a, **k: (time.sleep(0.05), step(*a, **k))[1])
    chunks = list(server.client().completions.create(model=MODEL, stream=True,
                                                      stream_options={"include_usage": True}, **body_of(req)))
    *deltas, last = chunks
    assert len(deltas) > 2  # incremental, not one chunk at the end
    assert sum((ch.choices[0].token_ids for ch in deltas), []) == want["token_ids"]
    assert "".join(ch.choices[0].text for ch in deltas) == want["text"]
    assert [ch.choices[0].finish_reason for ch in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert last.choices == [] and last.usage.completion_tokens == len(want["token_ids"])
    assert all(ch.usage is None for ch in deltas)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})


def test_n_completions_and_logprobs_give_runs_and_parse_with_openai_types(server, offline):
    """n > 1 and logprobs (not streamed): the raw JSON validates as the `openai` package's
    Completion, with run's tokens per choice and run's logprobs."""
    n2 = Completion.model_validate(post(server, "/v1/completions", {"model": MODEL, **body_of(
        next(r for r in BASIC if r["id"] == "n2"))}).json())
    want = offline["n2"]["choices"]
    assert [c.index for c in n2.choices] == [0, 1]
    assert [c.token_ids for c in n2.choices] == [w["token_ids"] for w in want]
    assert [c.text for c in n2.choices] == [w["text"] for w in want]
    assert n2.usage.completion_tokens == sum(len(w["token_ids"]) for w in want)
    lp = Completion.model_validate(post(server, "/v1/completions", {"model": MODEL, **body_of(
        next(r for r in BASIC if r["id"] == "logprobs"))}).json())
    want = offline["logprobs"]
    got = lp.choices[0].logprobs
    assert lp.choices[0].token_ids == want["token_ids"]
    assert got.tokens == [e["token"] for e in want["logprobs"]]
    # The values, to float32 rounding: run served this request in another batch (other GEMM shapes).
    assert got.token_logprobs == pytest.approx([e["logprob"] for e in want["logprobs"]], abs=1e-5)
    # OpenAI's completion format keys alternatives by text: tokens that decode alike share a key.
    want_top = [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in want["logprobs"]]
    assert [list(t) for t in got.top_logprobs] == [list(t) for t in want_top]
    assert [v for t in got.top_logprobs for v in t.values()] == pytest.approx(
        [v for t in want_top for v in t.values()], abs=1e-5)


def test_stream_ends_with_done(server):
    body = {"model": MODEL, "prompt": "done?", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_on_a_checkpoint_without_a_template_is_a_400_naming_it(server, stream):
    """The served model (the synthetic default) has no chat template: a chat request gets the
    same per-request refusal `run` gives, as an OpenAI 400, streaming or not. (Chat rendering
    itself is proven against transformers in tests/test_chat.py, through `run`.)"""
    messages = [{"role": "user", "content": "Hello there"}]
    with pytest.raises(openai.BadRequestError) as exc:
        chat = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=stream)
        list(chat) if stream else None
    assert "has no chat template" in str(exc.value) and "messages" in str(exc.value)


# ---- chat on a checkpoint with a chat template ---------------------------------------------------

CHAT_REQUESTS = [
    {"id": "chat-greedy", "max_tokens": 10, "temperature": 0},
    {"id": "chat-seeded", "max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 21},
]


@pytest.fixture(scope="module")
def chat_served(tmp_path_factory, one_torch_thread):
    """A tiny Llama with a Llama-3 tokenizer and chat template (tests/test_chat.py), captured
    and served; `trtgraph run` of every chat request, as `messages` and as the token ids
    transformers' apply_chat_template gives for them; those ids."""
    from transformers import AutoTokenizer

    from hf_models import save_tiny
    from test_chat import SYSTEM_MULTI_TURN, _checkpoint_files, _config_for
    from trtgraph.compiler.pipeline import capture

    path = _checkpoint_files(tmp_path_factory.mktemp("chat-ckpt"), "llama3")
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    save_tiny("LlamaForCausalLM", path, vocab_size=len(hf_tok))
    art = tmp_path_factory.mktemp("chat-art")
    capture(_config_for(path), art)
    hf_ids = hf_tok.apply_chat_template(SYSTEM_MULTI_TURN, add_generation_prompt=True, return_dict=False)
    reqs = [{**r, "messages": SYSTEM_MULTI_TURN} for r in CHAT_REQUESTS]
    reqs += [{**r, "id": "ids-" + r["id"], "prompt_token_ids": hf_ids} for r in CHAT_REQUESTS]
    offline = run_offline(art, reqs, tmp_path_factory.mktemp("chat-offline"))
    with serving(art) as running:
        yield running, offline, hf_ids, SYSTEM_MULTI_TURN


@pytest.mark.parametrize("rid", [r["id"] for r in CHAT_REQUESTS])
def test_chat_gives_run_tokens_on_the_apply_chat_template_prompt(chat_served, rid):
    """`client.chat.completions.create`, whole and streamed, gives exactly the tokens `trtgraph
    run` gives for the same `messages`, and those of the ids transformers' apply_chat_template
    renders for them (the same prompt: same length, same continuation, greedy and seeded)."""
    server, offline, hf_ids, messages = chat_served
    want = offline[rid]
    assert want["error"] is None and want["token_ids"] == offline["ids-" + rid]["token_ids"]
    assert want["usage"]["prompt_tokens"] == len(hf_ids)
    body = body_of(next(r for r in CHAT_REQUESTS if r["id"] == rid), chat=True)
    (model,) = [m.id for m in server.client().models.list().data]
    whole = server.client().chat.completions.create(model=model, messages=messages, **body)
    raw = ChatCompletion.model_validate(whole.model_dump())
    (choice,) = raw.choices
    assert choice.token_ids == want["token_ids"] and choice.message.content == want["text"]
    assert choice.message.role == "assistant" and choice.finish_reason == want["finish_reason"]
    assert raw.usage.prompt_tokens == len(hf_ids) and raw.usage.completion_tokens == len(want["token_ids"])
    chunks = [ChatCompletionChunk.model_validate(ch.model_dump()) for ch in server.client().chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **body)]
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant" and deltas[0].object == "chat.completion.chunk"
    assert sum((ch.choices[0].token_ids for ch in deltas), []) == want["token_ids"]
    assert "".join(ch.choices[0].delta.content for ch in deltas) == want["text"]
    assert [ch.choices[0].finish_reason for ch in deltas][-1] == want["finish_reason"]
    assert last.choices == [] and last.usage.prompt_tokens == len(hf_ids)
    assert len({ch.id for ch in chunks}) == 1


def test_raw_chat_json_validates_as_openai_types(chat_served):
    server, offline, _, messages = chat_served
    assert offline["chat-seeded"]["token_ids"] != offline["chat-greedy"]["token_ids"]  # the seeded one samples
    assert len(offline["chat-greedy"]["token_ids"]) >= 3
    (model,) = [m.id for m in server.client().models.list().data]
    body = {"model": model, "messages": messages, **body_of(CHAT_REQUESTS[0], chat=True)}
    got = ChatCompletion.model_validate(post(server, "/v1/chat/completions", body).json())
    assert got.choices[0].token_ids == offline["chat-greedy"]["token_ids"] and got.object == "chat.completion"
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        events = [line[6:] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
    assert sum((c.choices[0].token_ids for c in chunks), []) == offline["chat-greedy"]["token_ids"]


def test_prompts_are_rendered_and_encoded_off_the_engine_thread(chat_served, monkeypatch):
    """A chat's template render and a text prompt's encoding ran on the engine thread: 200,000
    messages held every other request's steps about 1 s. The request handler's worker thread does
    both now (Admission.prepare); the engine takes the ids as given."""
    server = chat_served[0]
    engine, seen = server.engine, []
    render, encode = engine.chat_template.render, engine.tokenizer.encode

    def rendering(*a, **k):
        seen.append(("render", threading.current_thread().name))
        return render(*a, **k)

    def encoding(text, *a, **k):
        seen.append(("encode " + text, threading.current_thread().name))
        return encode(text, *a, **k)

    monkeypatch.setattr(engine.chat_template, "render", rendering)
    monkeypatch.setattr(engine.tokenizer, "encode", encoding)
    (model,) = [m.id for m in server.client().models.list().data]
    chat = server.client().chat.completions.create(model=model, messages=chat_served[3], max_tokens=3, temperature=0)
    text = server.client().completions.create(model=model, prompt="offthread prompt", max_tokens=3, temperature=0)
    assert chat.choices[0].token_ids and text.choices[0].token_ids
    kinds = [k.split(" ")[0] for k, _ in seen]
    assert kinds.count("render") == 1 and kinds.count("encode") == 2, seen  # the chat's text, then the prompt
    assert ("encode offthread prompt", seen[-1][1]) == seen[-1], seen
    assert all(name != "trtgraph-engine" for _, name in seen), seen


def test_a_chat_too_long_to_serve_is_refused_by_the_handler_with_admissions_message(chat_served):
    """200,000 messages: refused (the rendered text cannot fit max_seq_len) with the message admission
    gives, a 400 in OpenAI's shape, counted in /metrics as the engine counts a refusal."""
    server = chat_served[0]
    (model,) = [m.id for m in server.client().models.list().data]
    before = server.metrics().get("trtgraph_requests_total[('outcome', 'error')]", 0)
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}] * 200_000,
                                                max_tokens=2)
    assert "cannot fit limits.max_seq_len" in error_of(exc.value)["message"]
    assert server.metrics().get("trtgraph_requests_total[('outcome', 'error')]", 0) == before + 1
    assert server.idle_and_leak_free()


# ---- errors -----------------------------------------------------------------------------------

def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"n": 0, "stream": True}, "n"),  # (n > 1 and logprobs stream: tests/test_r19_stream.py)
    ({"logprobs": 21, "stream": True}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"echo": True}, "echo"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"prompt": ["two", ["nested"]]}, "prompt"),  # (a list of prompts is served: tests/test_r20_server.py)
    ({"prompt": [1, 2, 99999]}, "prompt_token_ids"),
], ids=["temperature", "max_tokens", "unknown", "n-stream", "logprobs-stream", "stream-options", "echo", "top-k",
        "batch", "token-id"])
def test_bad_requests_get_400_naming_the_field(server, kwargs, param):
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().completions.create(**args)
    err = error_of(exc.value)
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_a_prompt_no_key_can_serve_gets_400_with_runs_message(server, offline):
    req = next(r for r in BASIC if r["id"] == "too-long")
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            server.client().completions.create(model=MODEL, stream=stream, **body_of(req))
        assert error_of(exc.value)["message"] == offline["too-long"]["error"]


def test_malformed_json_and_wrong_model(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "temperature": NaN}', timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"]
    for method, path, status in [("GET", "/v1/completions", 405), ("POST", "/v1/embeddings", 404)]:
        r = httpx.request(method, server.url + path, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    with pytest.raises(openai.NotFoundError) as exc:
        server.client().completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert error_of(exc.value)["param"] == "model"
    for model in (b"null", b"3", b'["m"]'):  # not a name at all: a 400 naming the field, not "model None" unknown
        r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "model": ' + model + b"}", timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "must be a string" in r.json()["error"]["message"]


def test_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError) as exc:
        server.client(key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert error_of(exc.value)["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# ---- queue limit and disconnects ----------------------------------------------------------------

def open_stream(server, prompt: str, max_tokens: int):
    """A raw streaming request and its line iterator, read up to the first chunk."""
    client = httpx.Client(timeout=120)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    cm = client.stream("POST", server.url + "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert next(line for line in lines if line).startswith("data: {")
    return client, cm, lines


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(server):
    before = server.metrics().get("trtgraph_requests_total[('outcome', 'abort')]", 0)
    client, cm, lines = open_stream(server, "talk for a long time", 200)
    assert next(line for line in lines if line).startswith("data: {")  # a second delta: decoding
    assert server.engine.scheduler.running
    cm.__exit__(None, None, None)
    client.close()
    wait_for(server.idle_and_leak_free, 60, "the aborted sequence to leave and free its blocks")
    assert server.metrics()["trtgraph_requests_total[('outcome', 'abort')]"] == before + 1


def test_more_than_max_waiting_gets_429(server):
    batch = server.engine.config.limits.max_batch_size
    server.thread.max_waiting = 2
    streams = []
    try:
        streams = [open_stream(server, f"long runner {i}", 230) for i in range(batch)]  # a full batch
        waiting = [threading.Thread(target=lambda i=i: _post_quietly(server, f"waiting {i}"), daemon=True)
                   for i in range(2)]
        for t in waiting:
            t.start()
        wait_for(lambda: server.thread.queued == 2, 60, "two requests waiting")
        with pytest.raises(openai.RateLimitError) as exc:
            server.client().completions.create(model=MODEL, prompt="one too many", max_tokens=2)
        assert error_of(exc.value)["code"] == "too_many_waiting_requests"
        assert server.metrics()["trtgraph_queue_depth[]"] == 2
    finally:
        server.thread.max_waiting = 64
        for client, cm, _ in streams:
            cm.__exit__(None, None, None)
            client.close()
    for t in waiting:
        t.join(120)
    wait_for(server.idle_and_leak_free, 60, "every sequence to finish or abort and free its blocks")


def _post_quietly(server, prompt):
    httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
               headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)


# ---- metrics and load ----------------------------------------------------------------------------

def test_metrics_parse_in_the_prometheus_text_format(server):
    server.client().completions.create(model=MODEL, prompt="count me", max_tokens=3)
    wait_for(server.idle_and_leak_free, 60, "the request to finish")
    m = server.metrics()
    assert m["trtgraph_generation_tokens_total[]"] > 0 and m["trtgraph_prompt_tokens_total[]"] > 0
    assert m["trtgraph_requests_total[('outcome', 'length')]"] >= 1
    assert any(k.startswith("trtgraph_steps_total[('key', '(bs=") for k in m)
    assert m["trtgraph_time_to_first_token_seconds_count[]"] >= 1
    assert m["trtgraph_time_per_output_token_seconds_count[]"] >= 1
    assert 0.0 <= m["trtgraph_padding_waste_ratio[]"] < 1.0
    assert m["trtgraph_kv_blocks_free[]"] == m["trtgraph_kv_blocks_total[]"] == server.engine.executor.num_blocks - 1
    assert "trtgraph_running_sequences[]" in m and "trtgraph_step_seconds_count[]" in m


def test_load_concurrent_streaming_clients_get_run_tokens(server, offline):
    reqs = load_requests()
    order = random.Random(1).sample(range(NUM_CLIENTS), NUM_CLIENTS)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(req):
        t0 = time.perf_counter()
        stream = await client.completions.create(model=MODEL, stream=True, **body_of(req))
        times, toks, finish = [], [], None
        async for ch in stream:
            times.append(time.perf_counter())
            toks += ch.choices[0].token_ids
            finish = ch.choices[0].finish_reason or finish
        return req["id"], toks, finish, times[0] - t0, (times[-1] - times[0]) / max(len(toks) - 1, 1)

    async def user(c, rng):
        await asyncio.sleep(rng.random() * 0.5)  # arrivals spread out, in random order
        return [await one(reqs[c * REQUESTS_PER_CLIENT + k]) for k in range(REQUESTS_PER_CLIENT)]

    async def everyone():
        rng = random.Random(2)
        return sum(await asyncio.gather(*(user(c, rng) for c in order)), [])

    results = asyncio.run(asyncio.wait_for(everyone(), 600))
    assert len(results) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    for rid, toks, finish, _, _ in results:
        assert toks == offline[rid]["token_ids"], rid
        assert finish == offline[rid]["finish_reason"], rid
    wait_for(server.idle_and_leak_free, 60, "no KV block leaked")
    ttft = sorted(r[3] * 1e3 for r in results)
    tpot = sorted(r[4] * 1e3 for r in results)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    print(f"\nload: {len(results)} streamed requests from {NUM_CLIENTS} clients: TTFT p50 {q(ttft, .5):.1f} ms "
          f"p99 {q(ttft, .99):.1f} ms; TPOT p50 {statistics.median(tpot):.1f} ms p99 {q(tpot, .99):.1f} ms")


# ---- the CLI under SIGTERM -----------------------------------------------------------------------

def test_cli_serve_sigterm_finishes_or_aborts_in_flight_and_exits_0(default_artifacts):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRTGRAPH_API_KEY": "env-key"}
    proc = subprocess.Popen([sys.executable, "-m", "trtgraph", "serve", "--manifest", str(default_artifacts),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(healthy, START_TIMEOUT_S, "the CLI server to answer /health 200")
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401  # TRTGRAPH_API_KEY applies
        got: list = []
        body = {"model": MODEL, "prompt": "in flight at SIGTERM", "max_tokens": 200, "stream": True}

        def consume():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": "Bearer env-key"}) as r:
                got.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        wait_for(lambda: len(got) >= 2, 60, "the stream to start")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        reader.join(30)
        assert proc.returncode == 0, stderr.decode()
        assert "Traceback" not in stderr.decode()
        assert got[-1] == "data: [DONE]"  # finished, or ended with an abort event before [DONE]
        last = json.loads(got[-2][6:])
        assert last.get("error", {}).get("code") == "aborted" or last["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_cli_serve_refuses_a_missing_model_directory_with_exit_2(default_artifacts, tmp_path):
    """`--model` as in `run`: a checkpoint directory that is not there is named, exit 2, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "trtgraph", "serve", "--manifest", str(default_artifacts), "--port",
                           str(free_port()), "--model", str(tmp_path / "gone")], capture_output=True, env=env,
                          timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert f"--model {tmp_path / 'gone'}: no such checkpoint directory" in err and "Traceback" not in err


def test_a_client_gone_before_its_body_arrived_is_no_server_error(server):
    """A client that closes the connection before sending all of its body (a timeout, a
    cancelled call) is an ordinary event: no "Exception in ASGI application" traceback in the
    server's log, nothing submitted, and the server serves on."""
    import logging

    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                          + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            time.sleep(0.3)
        c = server.client().completions.create(model=MODEL, prompt="still here", max_tokens=2, temperature=0)
        assert c.choices[0].finish_reason == "length"
    finally:
        logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]
