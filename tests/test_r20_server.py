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
