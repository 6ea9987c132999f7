"""A request that gives a field twice is refused naming the line and the key: json.loads
keeps the last value, so `{"temperature": 0.7, ..., "temperature": 0}` would silently run
greedy (the YAML reader refuses duplicate keys the same way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtgraph.errors import PromptError
from trtgraph.inputs import JSONProblem, loads_json
from trtgraph.runtime.serving.requests import json_lines

ROOT = Path(__file__).resolve().parents[1]


def test_a_key_given_twice_is_refused_where_requests_are_read():
    with pytest.raises(PromptError, match=r"p.jsonl line 2: .*'temperature' is given twice"):
        json_lines(b'{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b", "temperature": 0.7, "temperature": 0}\n',
                   "p.jsonl")
    with pytest.raises(JSONProblem, match="'max_tokens' is given twice"):  # nested: a batch line's body
        loads_json('{"body": {"max_tokens": 3, "max_tokens": 5}}', unique_keys=True)
    assert loads_json('{"a": {"b": 1}, "b": {"b": 2}}', unique_keys=True) == {"a": {"b": 1}, "b": {"b": 2}}
    assert loads_json('{"a": 1, "a": 2}') == {"a": 2}  # (checkpoint files are read as transformers reads them)


def test_run_exits_2_naming_the_line_and_key(default_artifacts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x", "max_tokens": 2, "id": "b"}\n')
    p = subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", str(prompts), "--manifest",
                        str(default_artifacts)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.returncode == 2 and "p.jsonl line 1" in p.stderr and "'id' is given twice" in p.stderr, p.stderr
    assert p.stdout == ""
