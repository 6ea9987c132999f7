"""Triton's own cache key remembered in the Triton cache by file size and time
(trtgraph/runtime/triton_key.py): computed once, handed back while Triton's files are unchanged."""

from __future__ import annotations

import json
import sys

import pytest

from trtgraph.runtime import triton_key

triton = pytest.importorskip("triton")
import triton.runtime.cache as cache  # noqa: E402


def _fake(value, calls):
    def key():
        calls.append(value)
        return value
    return key


def test_the_key_is_computed_once_then_read_while_the_files_are_unchanged(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cache, "triton_key", _fake("K1", calls))
    assert triton_key.remember(tmp_path) and cache.triton_key() == "K1" and calls == ["K1"]
    saved = json.loads((tmp_path / triton_key.KEY_FILE).read_text())
    assert saved["key"] == "K1" and any(f[0].startswith("_C") for f in saved["stamp"]["files"])
    assert triton_key.remember(tmp_path)  # installed already: nothing computed again
    calls.clear()
    monkeypatch.setattr(cache, "triton_key", _fake("K2", calls))  # a fresh process's Triton
    assert triton_key.remember(tmp_path) and cache.triton_key() == "K1" and calls == []  # read, not hashed


def test_a_changed_file_or_version_computes_the_key_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cache, "triton_key", _fake("K1", calls))
    triton_key.remember(tmp_path)
    path = tmp_path / triton_key.KEY_FILE
    body = json.loads(path.read_text())
    body["stamp"]["files"][0][1] += 1  # a source file of another size
    path.write_text(json.dumps(body))
    calls.clear()
    monkeypatch.setattr(cache, "triton_key", _fake("K2", calls))
    assert triton_key.remember(tmp_path) and cache.triton_key() == "K2" and calls == ["K2"]
    assert json.loads(path.read_text())["key"] == "K2"
    path.write_text("not json")  # a damaged file is computed again too
    monkeypatch.setattr(cache, "triton_key", _fake("K3", calls))
    assert triton_key.remember(tmp_path) and cache.triton_key() == "K3"


def test_nothing_is_done_without_triton_loaded_or_a_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cache, "triton_key", _fake("K1", calls))
    assert not triton_key.remember(None)
    monkeypatch.delitem(sys.modules, "triton")
    assert not triton_key.remember(tmp_path)
    assert calls == [] and not (tmp_path / triton_key.KEY_FILE).exists()
