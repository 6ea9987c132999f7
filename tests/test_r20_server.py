"""The twentieth session's adversarial pass over `trtgraph serve` (trtgraph/server/,
trtgraph/formats/openai.py): each test is a defect found by talking to a real server on
127.0.0.1 with the official `openai` client (sync and async) and raw HTTP, fixed, and kept
here. One server of the embedded default model for the module (tests/test_server.py's)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types import Completion, Model  # noqa: E402

from test_server import API_KEY, MODEL, server, wait_for  # noqa: E402,F401


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout, headers={"Authorization": f"Bearer {API_KEY}"})


# ---- a Hub checkpoint is served under its repository id -------------------------------------

def test_a_hub_checkpoint_is_served_under_its_repository_id(tmp_path, monkeypatch, one_torch_thread):
    """`model: {hub: org/tiny}` was served as "trtgraph-synthetic" (the name of a synthetic
    model: the manifest's model has no `path`), so a client asking for `org/tiny`, as it
    would of vLLM or any OpenAI-compatible server of that model, got 404 model_not_found."""
    from fastapi.testclient import TestClient

    from test_checkpoints import SMALL_PLAN, _capture, _yaml
    from hf_models import save_tiny
    from trtgraph.server.app import build_server

    repo = tmp_path / "cache" / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    save_tiny("LlamaForCausalLM", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _capture(_yaml(tmp_path / "hub.yaml", {"hub": "org/tiny"}, **SMALL_PLAN), tmp_path / "art")
    srv, thread = build_server(tmp_path / "art", "127.0.0.1", 0, max_waiting=4, api_key=None, log_level="warning")
    thread.start()
    with TestClient(srv.config.app) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "org/tiny"
        assert Model.model_validate(client.get("/v1/models/org/tiny").json()).id == "org/tiny"
        wait_for(thread.ready.is_set, 120, "the engine to load")
        r = client.post("/v1/completions", json={"model": "org/tiny", "prompt": [1, 2, 3], "max_tokens": 2,
                                                  "temperature": 0})
        assert r.status_code == 200, r.text
        assert Completion.model_validate(r.json()).model == "org/tiny"
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 1}).status_code == 404
    # the same checkpoint where it has moved (`--model`, checked against the manifest's sha256): still org/tiny,
    # not the name of its snapshot directory (a commit hash)
    from trtgraph.server.app import served_name

    assert served_name(thread.engine.manifest.app_config().model, str(repo / "snapshots" / commit)) == "org/tiny"


# ---- several prompts in one /v1/completions body --------------------------------------------

def choices_of(c) -> list[tuple]:
    return [(ch.index, ch.text, ch.token_ids, ch.finish_reason) for ch in c.choices]


@pytest.mark.parametrize("prompts", [["The server says", "two", "é 😀 three"], [[5, 6, 7], [9] * 20]],
                         ids=["texts", "token-ids"])
def test_a_list_of_prompts_is_served_as_openai_numbers_its_choices(server, prompts):
    """OpenAI's and vLLM's /v1/completions take a list of prompts (texts, or lists of token
    ids) and answer each prompt's n completions as choices i*n .. i*n+n-1, usage summed; the
    server refused any list of more than one ("send one prompt per request"), so clients
    that batch (lm-eval, the `openai` client's own list type) could not use it."""
    c = server.client()
    body = dict(model=MODEL, max_tokens=6, n=2, temperature=0.9, seed=13, stop=["zz"])
    whole = c.completions.create(prompt=prompts, **body)
    alone = [c.completions.create(prompt=p, **body) for p in prompts]
    assert isinstance(whole, Completion) and Completion.model_validate(whole.model_dump())
    want = [(i * 2 + ch.index, ch.text, ch.token_ids, ch.finish_reason) for i, a in enumerate(alone)
            for ch in a.choices]
    assert choices_of(whole) == want
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(c.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **body))
    *deltas, last = chunks
    got: dict[int, list] = {}
    for ch in deltas:
        (choice,) = ch.choices
        g = got.setdefault(choice.index, [choice.index, "", [], None])
        assert g[3] is None, "a chunk after the choice's finish"
        g[1] += choice.text
        g[2] += choice.token_ids
        g[3] = choice.finish_reason
    assert [tuple(got[i]) for i in sorted(got)] == want
    assert last.choices == [] and last.usage == whole.usage
    assert len({ch.id for ch in chunks}) == 1
    wait_for(server.idle_and_leak_free, 10, "every prompt's blocks freed")


def test_a_list_of_prompts_async_and_with_logprobs(server):
    import asyncio

    async def go():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        body = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=2)
        whole = await client.completions.create(prompt=["a", "bb"], **body)
        alone = [await client.completions.create(prompt=p, **body) for p in ("a", "bb")]
        await client.close()
        return whole, alone

    whole, alone = asyncio.run(go())
    assert [ch.logprobs.tokens for ch in whole.choices] == [a.choices[0].logprobs.tokens for a in alone]
    assert [ch.index for ch in whole.choices] == [0, 1]


@pytest.mark.parametrize("prompt, param, code", [
    (["fine", ""], "prompt", None),
    (["fine", [1, 99999]], "prompt_token_ids", None),
    ([[1, 2], "x" * 100_000], "prompt", "context_length_exceeded"),
    (["fine", [1] * 300], "prompt", "context_length_exceeded"),
    (["fine", ["nested"]], "prompt", None),
], ids=["empty", "token-id", "too-long-text", "too-long-ids", "nested"])
def test_a_bad_prompt_among_several_refuses_the_body_naming_it_and_runs_nothing(server, prompt, param, code):
    """Checked before any runs (as vLLM does): one bad prompt refuses the body with the error it
    would get alone, naming which prompt; a prompt over the context keeps its OpenAI code."""
    before = server.metrics()["trtgraph_generation_tokens_total[]"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "prompt 1" in err["message"], err
    assert err["code"] == code, err
    assert server.metrics()["trtgraph_generation_tokens_total[]"] == before
    assert server.idle_and_leak_free()


def test_more_prompts_than_may_wait_is_a_400_naming_the_limit(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["p"] * 65, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "65 prompts" in err["message"], err
    assert "--max-waiting" in err["message"]


def test_a_client_leaving_a_stream_of_several_prompts_aborts_every_one(server):
    from test_r11_server import slowed

    with slowed(server, 0.05):
        stream = server.client().completions.create(model=MODEL, prompt=["long one", "long two", "three"],
                                                    max_tokens=200, n=2, temperature=1.0, seed=1, stream=True)
        seen = set()
        for ch in stream:
            seen.add(ch.choices[0].index)
            if seen == set(range(6)):
                break
        assert len(server.engine.scheduler.running) == 6
        stream.close()
        wait_for(server.idle_and_leak_free, 10, "every prompt's completions aborted and their blocks freed")
    m = server.metrics()
    assert m["trtgraph_queue_depth[]"] == 0 and m["trtgraph_running_sequences[]"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_the_engine_refuses_among_several_aborts_the_others(server, monkeypatch, stream):
    """A refusal that only the engine gives (at add_request) for one prompt of several: a 400
    in OpenAI's shape naming it, and the other prompts, already queued, are aborted, not left
    decoding for nobody."""
    from trtgraph.errors import PromptError
    from test_r11_server import slowed

    engine = server.engine
    add = engine.add_request

    def add_refusing(req, **kw):
        if req.id.endswith("-2"):
            raise PromptError(f"request {req.id}: field `prompt` refused here for the test.")
        return add(req, **kw)

    monkeypatch.setattr(engine, "add_request", add_refusing)
    with slowed(server, 0.05):  # 200 tokens: 10 s of decoding
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["one", "two", "three"], "max_tokens": 200,
                                             "stream": stream})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and "refused here" in err["message"], err
        wait_for(server.idle_and_leak_free, 2, "the other prompts aborted and their blocks freed")
    assert server.thread.queued == 0


def test_a_checkpoint_given_as_dot_is_served_under_its_directorys_name(tmp_path, monkeypatch):
    """`trtgraph serve --model .` (or `./`, `ckpt/..`) from inside the checkpoint served it as
    ".": clients had to send `model: "."`. The name is the directory's, as for any other path."""
    from trtgraph.config import Config
    from trtgraph.server.app import served_name

    ckpt = tmp_path / "my-ckpt"
    (ckpt / "sub").mkdir(parents=True)
    monkeypatch.chdir(ckpt)
    source = Config.from_dict({"model": {"path": str(ckpt)}}, check_paths=False).model
    assert [served_name(source, m) for m in (".", "./", "sub/..", str(ckpt) + "/", None)] == ["my-ckpt"] * 5
    assert served_name(Config.default().model) == "trtgraph-synthetic"


@pytest.mark.parametrize("extra, param", [({"temperature": -1}, "temperature"), ({"bogus": 1}, "bogus"),
                                          ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_a_bad_field_of_a_body_of_several_prompts_is_the_bodys_not_prompt_0s(server, extra, param):
    """A field every prompt shares is named as the body's: "request body (prompt 0): field
    `temperature`" sent the client looking at its first prompt."""
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["message"].startswith("request body: "), err


def test_a_fresh_server_reports_its_kv_blocks_before_its_first_request(default_artifacts, one_torch_thread):
    """/metrics' gauges were first set after the first engine step: a healthy, idle server
    said `kv_blocks_free 0` of `kv_blocks_total 0` until its first request (a KV-usage alert
    fired on every restart, and free/total was 0/0); and requests_total had no series until
    the first request of each outcome."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from trtgraph.server.app import build_server

    srv, thread = build_server(default_artifacts, "127.0.0.1", 0, max_waiting=4, api_key=None, log_level="warning")
    thread.start()
    with TestClient(srv.config.app) as client:
        wait_for(thread.ready.is_set, 120, "the engine to load")
        m = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
        total = thread.engine.executor.num_blocks - 1
        assert m["trtgraph_kv_blocks_total"] == m["trtgraph_kv_blocks_free"] == total > 0, m
        assert m["trtgraph_running_sequences"] == 0 and m["trtgraph_queue_depth"] == 0
        # every outcome's series from the start, at 0: a series born at 1 hides its first count from rate()
        outcomes = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(client.get("/metrics").text)
                    for s in f.samples if s.name == "trtgraph_requests_total"}
        assert outcomes == dict.fromkeys(("stop", "length", "error", "abort", "rejected"), 0.0), outcomes


def test_a_refusal_after_a_stream_of_several_prompts_began_ends_it_with_an_error_and_aborts_the_rest():
    """One prompt's refusal coming after another prompt's chunks went out (a 400 is too late):
    the chunks so far, OpenAI's error object, [DONE], and every request of the body aborted."""
    import asyncio

    from trtgraph.errors import PromptError
    from trtgraph.formats import openai as oa
    from trtgraph.runtime.serving.requests import parse_request
    from trtgraph.runtime.serving.streaming import RequestOutput
    from trtgraph.server.app import _refusal
    from trtgraph.server.streams import Group, events

    reqs = [parse_request({"id": f"r-{i}", "prompt_token_ids": [1], "n": 2}, "t") for i in range(2)]
    group, aborted = Group(reqs), []

    async def go():
        queue = asyncio.Queue()
        for item in (RequestOutput("r-0", [5], "a", index=1), PromptError("request r-1: field `prompt` refused.")):
            queue.put_nowait(item)
        first = RequestOutput("r-0", [4], "b", index=0)
        return [e async for e in events(first, queue, oa.Response(False, MODEL), True, group,
                                        lambda it: getattr(_refusal(it, ("prompt", "max_tokens")), "body", None),
                                        lambda: aborted.append(True))]

    out = asyncio.run(go())
    bodies = [json.loads(e[6:]) for e in out[:-1]]
    assert [b["choices"][0]["index"] for b in bodies[:2]] == [0, 1] and out[-1] == "data: [DONE]\n\n"
    assert bodies[2]["error"]["param"] == "prompt" and "refused" in bodies[2]["error"]["message"]
    assert aborted == [True]
