"""A manifest damaged in any field — deleted, or replaced by a value of another type — is
refused with a ManifestError naming it (exit 2), never an internal error (exit 1). The digest
is recomputed after each change, so every field's own check is reached."""

from __future__ import annotations

import copy
import json

import pytest

from trtgraph.artifacts import _digest, load_manifest
from trtgraph.errors import TrtgraphError

ODD = ["del", None, "x", [1], {"a": 1}, 1.5, -1]


def _fields(o, at=()):
    """Every field path of the JSON value (the first 2 items of a list)."""
    items = o.items() if isinstance(o, dict) else enumerate(o[:2]) if isinstance(o, list) else []
    for k, v in items:
        yield at + (k,)
        yield from _fields(v, at + (k,))


def _damaged(body: dict, field: tuple, value) -> dict:
    m = copy.deepcopy(body)
    o = m
    for k in field[:-1]:
        o = o[k]
    if value == "del" and not isinstance(value, bool):
        del o[field[-1]]
    else:
        o[field[-1]] = value
    m["digest"] = _digest(m)
    return m


def test_every_damaged_field_is_a_manifest_error(one_torch_thread, default_artifacts, tmp_path):
    body = json.loads((default_artifacts / "manifest.json").read_text())
    path = tmp_path / "manifest.json"
    internal = []
    for field in _fields(body):
        for value in ODD:
            path.write_text(json.dumps(_damaged(body, field, value)))
            try:
                load_manifest(path)
            except TrtgraphError:
                pass
            except Exception as exc:  # an internal error: exit 1 "please report it"
                internal.append((field, value, f"{type(exc).__name__}: {exc}"))
    assert not internal, internal


@pytest.mark.parametrize("field, value, says", [
    (("format_version",), [2], "format_version [2] is not one"),
    (("format_version",), {"a": 1}, "format_version"),
    (("config", "limits"), "del", "limits"),
])
def test_the_cli_names_the_damaged_field(default_artifacts, tmp_path, field, value, says):
    import os
    import subprocess
    import sys

    body = json.loads((default_artifacts / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps(_damaged(body, field, value)))
    p = subprocess.run([sys.executable, "-m", "trtgraph", "inspect", str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "TRTGRAPH_RAISE_ERRORS": "0"})
    assert p.returncode == 2 and says in p.stderr and "manifest.json" in p.stderr, p.stderr


def test_an_exact_replay_records_a_max_abs_logit_difference_of_plus_zero(default_artifacts):
    import math

    body = json.loads((default_artifacts / "manifest.json").read_text())
    diffs = [k["parity"]["max_abs_logit_diff"] for k in body["keys"]]  # max(-low, high) was -0.0 here
    assert all(math.copysign(1.0, d) > 0 for d in diffs), diffs
