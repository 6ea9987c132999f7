"""The thirteenth session: `run --resume` and requests edited after the interrupted run.

Every output line records the fingerprint of the request line that produced it (native:
`request_sha256`; OpenAI batch: `response.request_id` = `req_sha256_` + it), and --resume refuses an
output whose result was written for another request than the prompts file now holds under
its id (before: the old request's result was silently kept). The tests that test the defect
failed before the fix."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
from click.testing import CliRunner

from trtgraph.cli import main

PROMPTS = [{"id": f"r{i}", "prompt": f"prompt {i} ünïcödé", "max_tokens": 4 + i, "temperature": 0}
           for i in range(4)]
COMPLETIONS = "/v1/completions"
BATCH = [{"custom_id": f"c{i}", "method": "POST", "url": COMPLETIONS,
          "body": {"prompt": f"hello {i}", "max_tokens": 3 + i, "temperature": 0}} for i in range(3)]
BATCH_BAD = {"custom_id": "bad", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "a", "max_tokens": 0}}


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def write_jsonl(path, rows, dumps=json.dumps):
    path.write_text("".join(dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def fingerprint(row: dict) -> str:
    """As the README defines it: SHA-256 of the line's JSON, sorted keys, no whitespace; 32 hex digits."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


@pytest.fixture
def no_model(monkeypatch):
    """Any model work (an Engine) fails the test: refusals must come before it."""
    from trtgraph.runtime.serving import engine

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(engine.Engine, "__init__", refuse)


@pytest.fixture(scope="module")
def native_run(default_artifacts, tmp_path_factory):
    """One uninterrupted run of PROMPTS: (its directory, the output lines by id)."""
    d = tmp_path_factory.mktemp("native")
    out = d / "full.jsonl"
    res = cli("run", "--prompts", write_jsonl(d / "p.jsonl", PROMPTS), "--manifest", default_artifacts, "--output", out)
    assert res.exit_code == 0, res.output
    return d, {r["id"]: r for r in read_jsonl(out)}


def interrupted(tmp_path, full: dict, ids) -> "Path":  # noqa: F821
    """The output an interrupted run leaves: the results of `ids`, in this order."""
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(full[i]) + "\n" for i in ids), encoding="utf-8")
    return out


def test_every_native_line_records_its_request_fingerprint(native_run):
    _, full = native_run
    assert {rid: row.get("request_sha256") for rid, row in full.items()} == {p["id"]: fingerprint(p) for p in PROMPTS}


def test_n_and_refused_native_lines_carry_the_fingerprint_too(default_artifacts, tmp_path):
    rows = [{"id": "n2", "prompt": "x", "n": 2, "max_tokens": 2, "seed": 1},
            {"id": "long", "prompt_token_ids": [1] * 250, "max_tokens": 10}]  # refused: past max_seq_len
    out = tmp_path / "out.jsonl"
    res = cli("run", "--prompts", write_jsonl(tmp_path / "p.jsonl", rows), "--manifest", default_artifacts,
              "--output", out)
    assert res.exit_code == 0, res.output
    got = {r["id"]: r for r in read_jsonl(out)}
    assert len(got["n2"]["choices"]) == 2 and got["long"]["finish_reason"] == "error"
    assert {i: r["request_sha256"] for i, r in got.items()} == {r["id"]: fingerprint(r) for r in rows}


@pytest.mark.parametrize("edit", [{"prompt": "another prompt"}, {"max_tokens": 9}, {"temperature": 0.5, "seed": 3},
                                  {"stop": ["x"]}], ids=["prompt", "max_tokens", "temperature", "stop"])
def test_resume_refuses_a_result_of_a_request_edited_since(edit, native_run, default_artifacts, tmp_path, no_model):
    """It skipped r1 (already in the output) and kept the old request's result: silently wrong."""
    _, full = native_run
    out = interrupted(tmp_path, full, ["r0", "r1"])
    before = out.read_bytes()
    prompts = write_jsonl(tmp_path / "p.jsonl", [{**p, **edit} if p["id"] == "r1" else p for p in PROMPTS])
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert res.exit_code == 2, res.output
    err = res.stderr
    assert f"{out} line 2: the result for id 'r1' was written for another request than {prompts} line 2" in err
    assert f"request_sha256 {full['r1']['request_sha256']}" in err
    assert f"Remove that result line from {out}" in err and "restore the request" in err and "new --output" in err
    assert "Traceback" not in res.output and out.read_bytes() == before  # nothing appended, nothing truncated


def test_several_changed_requests_are_named_and_a_cut_last_line_stays(native_run, default_artifacts, tmp_path,
                                                                    no_model):
    _, full = native_run
    out = interrupted(tmp_path, full, ["r3", "r0", "r2"])
    with open(out, "a", encoding="utf-8") as f:
        f.write('{"id": "r1", "tok')  # a hard kill's last line: repaired only by a resume that goes on
    before = out.read_bytes()
    prompts = write_jsonl(tmp_path / "p.jsonl", [{**p, "max_tokens": 2} for p in PROMPTS])
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert res.exit_code == 2, res.output
    assert f"{out} line 1: the result for id 'r3'" in res.stderr and f"{prompts} line 4" in res.stderr
    assert f"Lines 2, 3 of {out} hold results of changed requests too" in res.stderr
    assert "Remove those result lines" in res.stderr and out.read_bytes() == before


def test_reformatted_prompts_resume_and_an_unchanged_resume_equals_one_full_run(native_run, default_artifacts,
                                                                             tmp_path):
    """Key order and whitespace are not changes; the resumed file holds each id once, with
    the tokens (and fingerprints) of one uninterrupted run."""
    _, full = native_run
    out = interrupted(tmp_path, full, ["r2", "r0"])
    reordered = [dict(reversed(list(p.items()))) for p in PROMPTS]
    prompts = write_jsonl(tmp_path / "p.jsonl", reordered, dumps=lambda r: json.dumps(r, separators=(" ,  ", " :  ")))
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert res.exit_code == 0, res.output
    assert f"resume: 2 requests already in {out}, 2 to run" in res.stderr and "older trtgraph" not in res.stderr
    rows = read_jsonl(out)
    assert sorted(r["id"] for r in rows) == ["r0", "r1", "r2", "r3"]
    assert {r["id"]: (r["token_ids"], r["request_sha256"]) for r in rows} == \
        {i: (r["token_ids"], r["request_sha256"]) for i, r in full.items()}


def test_an_older_output_without_fingerprints_resumes_with_a_note(native_run, default_artifacts, tmp_path):
    _, full = native_run
    old = {i: {k: v for k, v in r.items() if k != "request_sha256"} for i, r in full.items()}
    out = interrupted(tmp_path, old, ["r0", "r1", "r3"])
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert res.exit_code == 0, res.output
    assert f"resume: 3 requests already in {out}, 1 to run" in res.stderr
    assert res.stderr.count("written by an older trtgraph") == 1
    assert f"resume: 3 of them written by an older trtgraph, without a request fingerprint: not checked against " \
           f"{prompts}" in res.stderr
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == ["r0", "r1", "r3", "r2"]
    assert rows[-1]["request_sha256"] == full["r2"]["request_sha256"]
    assert {r["id"]: r["token_ids"] for r in rows} == {i: r["token_ids"] for i, r in full.items()}


# ---- OpenAI batch files -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def batch_run(default_artifacts, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    out = d / "full.jsonl"
    res = cli("run", "--prompts", write_jsonl(d / "in.jsonl", [*BATCH, BATCH_BAD]), "--manifest", default_artifacts,
              "--output", out)
    assert res.exit_code == 0, res.output
    return {r["custom_id"]: r for r in read_jsonl(out)}


def test_batch_lines_keep_openai_shape_and_carry_the_fingerprint_in_request_id(batch_run):
    for row in [*BATCH, BATCH_BAD]:
        line = batch_run[row["custom_id"]]
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert line["response"]["request_id"] == "req_sha256_" + fingerprint(row)
    assert batch_run["bad"]["response"]["status_code"] == 400 and batch_run["bad"]["error"]["line"] == 4
    completion = pytest.importorskip("openai.types").Completion  # the test extras have it; the GPU machine not
    completion.model_validate(batch_run["c0"]["response"]["body"])


@pytest.mark.parametrize("which,edit", [("c1", {"max_tokens": 2}), ("c1", {"prompt": "bye"}),
                                        ("bad", {"max_tokens": 2})], ids=["max_tokens", "prompt", "refused-fixed"])
def test_batch_resume_refuses_a_result_of_a_body_edited_since(which, edit, batch_run, default_artifacts, tmp_path,
                                                              no_model):
    """A refused body that was fixed since is a changed request too: its 400 line must go first."""
    out = interrupted(tmp_path, batch_run, ["bad", "c1"])
    before = out.read_bytes()
    rows = [{**r, "body": {**r["body"], **edit}} if r["custom_id"] == which else r for r in [*BATCH, BATCH_BAD]]
    prompts = write_jsonl(tmp_path / "in.jsonl", rows)
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert res.exit_code == 2, res.output
    line, in_line = (1, 4) if which == "bad" else (2, 2)
    assert (f"{out} line {line}: the result for custom_id {which!r} was written for another request than "
            f"{prompts} line {in_line}") in res.stderr
    assert f"response.request_id {batch_run[which]['response']['request_id']}" in res.stderr
    assert "Traceback" not in res.output and out.read_bytes() == before


def test_batch_resume_of_unchanged_lines_keeps_the_refused_line_once(batch_run, default_artifacts, tmp_path):
    out = interrupted(tmp_path, batch_run, ["bad", "c1"])
    prompts = write_jsonl(tmp_path / "in.jsonl", [{k: r[k] for k in reversed(list(r))} for r in [*BATCH, BATCH_BAD]])
    res = cli("run", "--prompts", prompts, "--manifest", default_artifacts, "--output", out, "--resume")
    assert res.exit_code == 0, res.output
    assert f"resume: 2 requests already in {out}, 2 to run" in res.stderr and "older trtgraph" not in res.stderr
    rows = read_jsonl(out)
    assert sorted(r["custom_id"] for r in rows) == ["bad", "c0", "c1", "c2"]
    assert {r["custom_id"]: r["response"]["request_id"] for r in rows} == \
        {k: r["response"]["request_id"] for k, r in batch_run.items()}
    assert {r["custom_id"]: r["response"]["body"].get("choices", [{}])[0].get("text") for r in rows} == \
        {k: r["response"]["body"].get("choices", [{}])[0].get("text") for k, r in batch_run.items()}


@pytest.mark.parametrize("request_id", [lambda: uuid.uuid4().hex, lambda: "req_" + uuid.uuid4().hex],
                         ids=["older-trtgraph", "openai"])
def test_a_batch_output_without_fingerprints_resumes_with_a_note(request_id, batch_run, default_artifacts, tmp_path):
    """An older trtgraph wrote a random uuid (32 hex digits) as the request_id, OpenAI writes
    `req_` + 32 hex digits: neither is taken for a fingerprint (nor refused as a changed request)."""
    old = {k: {**r, "response": {**r["response"], "request_id": request_id()}} for k, r in batch_run.items()}
    out = interrupted(tmp_path, old, ["c0"])
    rows = [{**r, "body": {**r["body"], "max_tokens": 1}} for r in [*BATCH, BATCH_BAD]]  # unseen: not checked
    res = cli("run", "--prompts", write_jsonl(tmp_path / "in.jsonl", rows), "--manifest", default_artifacts,
              "--output", out, "--resume")
    assert res.exit_code == 0, res.output
    assert "resume: 1 of them written by an older trtgraph" in res.stderr
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == ["bad", "c0", "c1", "c2"]


def test_a_run_without_resume_refuses_to_empty_an_interrupted_runs_results(default_artifacts, native_run, tmp_path,
                                                                           no_model):
    """Eighteenth session: an interrupted run's results (some of the prompts file's ids) would be emptied by
    a run without --resume; it is refused (exit 2, naming --resume), the file untouched."""
    d, full = native_run
    out = interrupted(tmp_path, full, ["r2", "r0"])
    before = out.read_bytes()
    res = cli("run", "--prompts", d / "p.jsonl", "--manifest", default_artifacts, "--output", out)
    assert res.exit_code == 2, res.output
    assert "2 of the 4 requests" in res.output and "--resume" in res.output and str(out) in res.output
    assert out.read_bytes() == before


def test_a_run_without_resume_replaces_a_finished_run_or_another_files_output(default_artifacts, native_run, tmp_path):
    d, full = native_run
    for rows in (list(full.values()), [{"id": "other", "token_ids": [1], "finish_reason": "stop"}]):
        out = tmp_path / "out.jsonl"
        write_jsonl(out, rows)
        res = cli("run", "--prompts", d / "p.jsonl", "--manifest", default_artifacts, "--output", out)
        assert res.exit_code == 0, res.output
        assert {r["id"] for r in read_jsonl(out)} == set(full)
