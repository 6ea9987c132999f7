"""The capture pipeline and its manifest: `trtgraph capture` / `trtgraph inspect`, per-key
parity with eager, off-plan selection, and every way a manifest is refused (through
`load_manifest` and through the CLI: exit 2, the culprit on stderr, no traceback)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from click.testing import CliRunner

from trtgraph import artifacts
from trtgraph.artifacts import MANIFEST_NAME, _digest, load_manifest, write_manifest
from trtgraph.buckets import GREEDY, SAMPLED, BatchShape, BucketPlan, GraphKey, select
from trtgraph.cli import main
from trtgraph.compiler.pipeline import capture
from trtgraph.compiler.verify import verify_key
from trtgraph.config import Config
from trtgraph.errors import ConfigError, BucketMissError, CaptureError, ManifestError
from trtgraph.report import key_label
from trtgraph.runtime.step.executor import Executor

from conftest import tiny_config

DEFAULT_KEYS = BucketPlan.from_config(Config.default()).keys
TOP_LEVEL = ("format_version", "trtgraph_version", "created", "environment", "model", "limits", "buffers", "keys",
             "totals")
KEY_FIELDS = ("key", "num_tokens", "capture_seconds", "pool_bytes", "replay_ms", "parity")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """`trtgraph capture --out DIR --device cpu` on the embedded default: (DIR, click result)."""
    out = tmp_path_factory.mktemp("cli-capture") / "artifacts"  # does not exist yet: capture makes it
    return out, cli("capture", "--out", out, "--device", "cpu")


@pytest.fixture(scope="module")
def body(captured) -> dict:
    return json.loads((captured[0] / MANIFEST_NAME).read_text())


# ---- trtgraph capture / inspect ------------------------------------------------------------------

def test_capture_json_holds_the_phases_from_the_start_to_the_manifest(tmp_path):
    result = cli("capture", "--out", tmp_path / "art", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    phases = body["phases"]["phases_seconds"]
    assert [n for n in phases if n not in ("interpreter", "imports")] == [
        "checks_and_kernels", "weights_generated", "kv_cache_and_buffers", "warm_up", "capture", "verify_and_time",
        "manifest"]
    assert body["phases"]["total_seconds"] == pytest.approx(sum(phases.values()), abs=1e-3)
    # the capture's own work is inside its phases
    assert phases["warm_up"] >= body["warmup_seconds"] and phases["capture"] >= body["capture_seconds"]


def test_cli_capture_writes_a_manifest_and_a_summary(captured):
    out, result = captured
    assert result.exit_code == 0, result.output
    assert (out / MANIFEST_NAME).is_file()
    assert re.search(rf"^captured {len(DEFAULT_KEYS)} keys in [0-9.]+ s ", result.stdout, re.M), result.stdout
    assert "parity ok on every key" in result.stdout
    assert f"manifest: {out / MANIFEST_NAME}" in result.stdout
    assert re.search(r"^phases: .*warm_up [0-9.]+ s, capture [0-9.]+ s, verify_and_time [0-9.]+ s, manifest [0-9.]+ s",
                     result.stdout, re.M), result.stdout
    manifest = load_manifest(out)
    assert sorted(manifest.graph_keys) == sorted(DEFAULT_KEYS)
    assert manifest.environment["backend"] == "static" and manifest.config["device"] == "cpu"


def test_capture_leaves_no_temporary_manifest(captured):
    out = captured[0]
    assert (out / MANIFEST_NAME).is_file()
    assert list(out.glob(".manifest-*")) == [] and list(out.glob("*.tmp")) == []
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, artifacts.TRITON_CACHE_DIR]


def test_inspect_prints_a_table_with_every_key(captured):
    out, _ = captured
    result = cli("inspect", out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for rec in load_manifest(out).keys:
        label = key_label(rec.key)
        hits = [ln for ln in lines if ln.startswith(label)]
        assert len(hits) == 1, f"{rec.key}: {hits}"
        assert hits[0].split()[len(label.split())] == str(rec.num_tokens)
        assert "ok (" in hits[0]
    rows = [ln for ln in lines if re.match(r"\(bs=\d+, ", ln)]
    assert len(rows) == len(DEFAULT_KEYS)
    assert f"{len(DEFAULT_KEYS)} keys" in result.stdout


def test_inspect_json_has_the_documented_fields(captured, body):
    out, _ = captured
    result = cli("inspect", out, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == body, "inspect --json must print the manifest as written"
    for name in TOP_LEVEL:
        assert name in data, name
    assert data["format_version"] == artifacts.FORMAT_VERSION
    assert data["limits"] == {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 256}
    assert {"torch", "backend", "device_name"} <= set(data["environment"])
    assert data["totals"]["num_keys"] == len(data["keys"]) == len(DEFAULT_KEYS)
    assert {b["name"] for b in data["buffers"]} >= {"input_ids", "positions", "slot_mapping", "block_tables",
                                                     "temperature", "next_tokens"}
    for rec in data["keys"]:
        for f in KEY_FIELDS:
            assert f in rec, f
        assert set(rec["key"]) == {"batch_size", "draft_len", "chunk_size", "sampling"}
        assert set(rec["parity"]) >= {"max_abs_logit_diff", "tokens_equal"}
        key = GraphKey(**rec["key"])
        assert rec["num_tokens"] == key.num_tokens
        assert rec["capture_seconds"] >= 0 and rec["replay_ms"] > 0 and rec["pool_bytes"] == 0  # static: no pool


def test_inspect_check_passes_on_the_capturing_machine(captured):
    result = cli("inspect", captured[0], "--check")
    assert result.exit_code == 0, result.output
    assert "check: this machine matches the manifest" in result.stdout
    data = json.loads(cli("inspect", captured[0], "--check", "--json").stdout)
    assert data["check"] == {"ok": True, "differences": []}


# ---- parity --------------------------------------------------------------------------------------

def test_manifest_parity_is_exact_on_the_static_backend(body):
    assert len(body["keys"]) == len(DEFAULT_KEYS)
    for rec in body["keys"]:
        assert rec["parity"] == {"max_abs_logit_diff": 0.0, "tokens_equal": True}, rec["key"]
    # every manifest written has parity on every key: a key whose replay differs from
    # eager stops the capture (test_reliability_outputs.py::test_a_failed_capture_leaves_nothing_behind).


@pytest.fixture(scope="module")
def captured_executor():
    """Every key of the default plan recorded on a fresh executor (independent of the manifest)."""
    cfg = tiny_config()
    ex = Executor.build(cfg, BucketPlan.from_config(cfg), torch.device("cpu"))
    with torch.inference_mode():
        for key in sorted(ex.plan.keys, key=lambda k: -k.num_tokens):
            ex.warmup(key)
            ex.capture(key)
    ex.runner.lock()
    return ex


@pytest.mark.parametrize("key", DEFAULT_KEYS, ids=str)
def test_verify_key_is_ok_for_every_key_and_seed(captured_executor, key):
    ex = captured_executor
    with torch.inference_mode():
        for seed in (0, 1, 2):
            before = ex.runner.replays[key]
            parity = verify_key(ex, key, seed)
            assert parity.ok and parity.tokens_equal and parity.max_abs_logit_diff == 0.0, (seed, parity)
            assert ex.runner.replays[key] == before + 1, "verify_key must compare a replay, not two eager runs"


@pytest.mark.parametrize("paced", [False, True], ids=["at_once", "held_to_the_end"])
@pytest.mark.parametrize("inject", ["logit", "context"])
def test_a_replay_that_differs_from_its_warm_up_reference_fails_the_capture(inject, paced, tmp_path, monkeypatch):
    """The warm-up's eager run of a key is its verification's reference. A difference injected
    there (one logit; or the rows' context blocks swapped for others, so the replay reads a
    context the eager run did not: the KV cache is random-filled, so it differs) stops the
    capture: exit 2, the key named, no traceback, no manifest. Also where the pacer holds every
    key's verification back until all keys are captured (what CUDA's pacing may do)."""
    from trtgraph.compiler import pacing, pipeline

    if paced:
        monkeypatch.setattr(pipeline, "Pacer", lambda ahead_ms: pacing.Pacer(0.0))

    real, target = pipeline.eager_reference, max((k for k in DEFAULT_KEYS if not k.is_prefill), key=lambda k: k.batch_size)

    def reference(ex, key, seed):
        ref = real(ex, key, seed)
        if key != target:
            return ref
        if inject == "logit":
            ref.logits[0, 0] += 1.0
        else:  # the row with the longest context reads other blocks than its eager run read
            bs = ex.block_size
            row = max(ref.rows, key=lambda r: r.start_pos)
            n_ctx = row.start_pos // bs  # blocks holding context only (not written by the step)
            assert n_ctx >= 1
            used = {b for r in ref.rows for b in r.block_table}
            spare = [b for b in range(1, ex.num_blocks) if b not in used][:n_ctx]
            assert len(spare) == n_ctx
            row.block_table = spare + row.block_table[n_ctx:]
        return ref

    monkeypatch.setattr(pipeline, "eager_reference", reference)
    result = cli("capture", "--out", tmp_path / "art", "--device", "cpu")
    assert result.exit_code == 2, result.output
    assert f"{target}: replay differs from eager" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "art" / MANIFEST_NAME).exists()


# ---- selection off the plan ---------------------------------------------------------------------

@pytest.mark.parametrize("shape", [BatchShape(9), BatchShape(9, sampling=SAMPLED), BatchShape(64),
                                   BatchShape(1, chunk_size=32), BatchShape(9, chunk_size=16), BatchShape(5, chunk_size=64),
                                   BatchShape(1, draft_len=2), BatchShape(0)], ids=str)
def test_off_plan_selection_raises_bucket_miss(captured, shape):
    plan = load_manifest(captured[0]).plan()
    with pytest.raises(BucketMissError, match=re.escape(str(shape))) as err:
        select(plan, shape)
    assert "nearest recorded keys" in str(err.value)


def test_on_plan_selection_picks_the_smallest_fitting_key(captured):
    plan = load_manifest(captured[0]).plan()
    assert select(plan, BatchShape(8)) == GraphKey(8)
    assert select(plan, BatchShape(5, sampling=SAMPLED)) == GraphKey(8, sampling=SAMPLED)
    assert select(plan, BatchShape(3, chunk_size=64)) == GraphKey(3, 0, 64)
    greedy_only = BucketPlan.from_config(tiny_config(buckets={"sampling": [GREEDY]}))
    with pytest.raises(BucketMissError):
        select(greedy_only, BatchShape(1, sampling=SAMPLED))


# ---- manifest refusals ---------------------------------------------------------------------------

def _index(body: dict, batch_size: int, chunk_size: int = 0, sampling: str = SAMPLED) -> int:
    return next(i for i, r in enumerate(body["keys"]) if r["key"] == {"batch_size": batch_size, "draft_len": 0,
                                                                        "chunk_size": chunk_size, "sampling": sampling})


def _redigest(body: dict) -> dict:
    body["digest"] = _digest(body)
    return body


def _drop_key(body, redigest):
    del body["keys"][_index(body, 8)]
    return _redigest(body) if redigest else body


def _resize_key(body, redigest):
    rec = body["keys"][_index(body, 8)]
    rec["key"]["batch_size"], rec["num_tokens"] = 16, 16  # consistent with itself, not with the plan
    return _redigest(body) if redigest else body


def _bad_num_tokens(body):
    body["keys"][_index(body, 2, chunk_size=16)]["num_tokens"] = 31
    return _redigest(body)


def _duplicate_key(body):
    body["keys"][_index(body, 1)] = dict(body["keys"][_index(body, 2)])
    return _redigest(body)


STR_8 = re.escape(str(GraphKey(8, sampling=SAMPLED)))
STR_16 = re.escape(str(GraphKey(16, sampling=SAMPLED)))
EDITS = {  # name: (edit of the parsed manifest, or of its text; what the message must say)
    "unknown format_version": (lambda b: {**b, "format_version": 99}, r"format_version 99 is not one"),
    "format_version as a string": (lambda b: {**b, "format_version": "1"}, r"format_version '1' is not one"),
    "key removed": (lambda b: _drop_key(b, False), r"edited after capture \(its digest"),
    "batch size changed": (lambda b: _resize_key(b, False), r"edited after capture \(its digest"),
    "key removed, digest recomputed": (lambda b: _drop_key(b, True), rf"not in the plan: none; missing: {STR_8}"),
    "batch size changed, digest recomputed": (lambda b: _resize_key(b, True),
                                              rf"not in the plan: {STR_16}; missing: {STR_8}"),
    "num_tokens inconsistent, digest recomputed": (_bad_num_tokens, r"keys\[\d+\]\.num_tokens = 31; expected 32 for "
                                                   + re.escape(str(GraphKey(2, 0, 16, SAMPLED)))),
    "key listed twice, digest recomputed": (_duplicate_key, r"lists a graph key twice"),
    "truncated JSON": ("truncate", r"not valid JSON .*truncated"),
    "missing file": ("delete", r"no manifest here"),
}


@pytest.fixture
def edited(captured, tmp_path, request):
    """A copy of the captured artifacts with one edit applied: (dir, message pattern)."""
    edit, pattern = EDITS[request.param]
    text = (captured[0] / MANIFEST_NAME).read_text()
    path = tmp_path / MANIFEST_NAME
    if edit == "truncate":
        path.write_text(text[:len(text) // 2])
    elif edit != "delete":
        path.write_text(json.dumps(edit(json.loads(text)), indent=2))
    return tmp_path, pattern


@pytest.mark.parametrize("edited", list(EDITS), indirect=True)
def test_load_manifest_refuses(edited):
    out, pattern = edited
    with pytest.raises(ManifestError, match=pattern) as err:
        load_manifest(out)
    assert str(out / MANIFEST_NAME) in str(err.value), "the message names the manifest"
    assert "trtgraph capture" in str(err.value), "the message says what to do next"


@pytest.mark.parametrize("edited", list(EDITS), indirect=True)
@pytest.mark.parametrize("extra", [[], ["--json"], ["--check"]], ids=["plain", "json", "check"])
def test_cli_inspect_refuses_with_exit_2(edited, extra):
    out, pattern = edited
    result = cli("inspect", out, *extra)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("error: ")
    assert re.search(pattern, " ".join(result.stderr.split())), result.stderr
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cli_run_refuses_an_edited_manifest_with_exit_2(captured, tmp_path):
    body = _drop_key(json.loads((captured[0] / MANIFEST_NAME).read_text()), True)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(body))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi", "max_tokens": 2}\n')
    result = cli("run", "--prompts", prompts, "--manifest", tmp_path)
    assert result.exit_code == 2, result.output
    assert re.search(rf"missing: {STR_8}", result.stderr) and "Traceback" not in result.output


def test_inspect_check_names_a_changed_torch_version(captured, tmp_path):
    body = json.loads((captured[0] / MANIFEST_NAME).read_text())
    here = body["environment"]["torch"]
    body["environment"]["torch"] = "1.0.0"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(_redigest(body)))
    assert load_manifest(tmp_path).environment["torch"] == "1.0.0"  # a valid manifest, for another machine

    result = cli("inspect", tmp_path, "--check")
    assert result.exit_code == 3, result.output
    assert "DIFFERS" in result.stdout
    line = next(ln for ln in result.stdout.splitlines() if "environment.torch" in ln)
    assert "'1.0.0'" in line and repr(here) in line
    assert "Traceback" not in result.output

    result = cli("inspect", tmp_path, "--check", "--json")
    assert result.exit_code == 3
    check = json.loads(result.stdout)["check"]
    assert check["ok"] is False
    assert {"field": "environment.torch", "manifest": "1.0.0", "here": here} in check["differences"]

    assert cli("inspect", tmp_path).exit_code == 0, "without --check the environment is not compared"


# ---- capture refusals and atomic writes ------------------------------------------------------------

@pytest.mark.parametrize("sizes,uncovered", [([1, 2, 4], "5-8"), ([2, 4, 6], "7-8"), ([1], "2-8")])
def test_capture_refuses_a_plan_that_does_not_cover_max_batch_size(tmp_path, sizes, uncovered):
    out = tmp_path / "out"
    cfg = tiny_config(buckets={"batch_sizes": sizes})
    with pytest.raises(CaptureError) as err:
        capture(cfg, out)
    msg = str(err.value)
    for mode in (GREEDY, SAMPLED):
        assert f"generation batches of {uncovered} (draft_len=0, sampling={mode})" in msg
    assert "prefill" not in msg, "prefill keys cover their batches"
    assert not (out / MANIFEST_NAME).exists()


def test_capture_names_kv_cache_num_blocks_when_a_full_batch_does_not_fit(tmp_path):
    """A fixed kv_cache.num_blocks too small for the plan's largest batch (capture checks every
    key on a full batch of rows) is a ConfigError naming the field and the blocks needed, not a
    ValueError from inside the capture; nothing is written."""
    out = tmp_path / "out"
    cfg = tiny_config(kv_cache={"num_blocks": 6}, limits={"max_seq_len": 32},  # a sequence fits: 2 blocks + 1
                      buckets={"chunk_sizes": [16]})
    with pytest.raises(ConfigError, match=r"kv_cache.num_blocks = 6 cannot hold the key \(bs=\d+.* need at least "
                                          r"\d+ blocks.*Raise kv_cache.num_blocks to \d+") as err:
        capture(cfg, out)
    need = int(str(err.value).split("need at least ")[1].split()[0])
    assert need > 6 and f"to {need} or more" in str(err.value)
    assert not (out / MANIFEST_NAME).exists()


def test_cli_capture_refuses_an_uncovered_plan_with_exit_2(tmp_path):
    config = tiny_config(buckets={"batch_sizes": [1, 2, 4]}).to_dict()
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    result = cli("capture", "--config", path, "--out", out, "--device", "cpu")
    assert result.exit_code == 2, result.output
    assert "generation batches of 5-8" in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.output
    assert not (out / MANIFEST_NAME).exists() and list(tmp_path.rglob(".manifest-*")) == []


def test_manifest_write_is_atomic(captured, tmp_path, monkeypatch):
    manifest = load_manifest(captured[0])
    path = write_manifest(tmp_path, manifest)
    first = path.read_text()
    assert load_manifest(tmp_path).to_json() == manifest.to_json()
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME]

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(artifacts.os, "replace", fail)
    manifest.totals = {**manifest.totals, "num_keys": 0}
    with pytest.raises(OSError, match="disk full"):
        write_manifest(tmp_path, manifest)
    monkeypatch.undo()
    assert path.read_text() == first, "a failed write must leave the old manifest whole"
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME], "the temporary file was left behind"
