"""`trtgraph run` through click's CliRunner: JSONL in, JSONL out, the summary on stderr,
`--eager` for A/B, and a bad prompts file rejected with exit 2 (file, line, field, no
traceback) before any model work."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from trtgraph.cli import main
from trtgraph.runtime.serving.engine import Engine

RESULT_FIELDS = {"id", "text", "token_ids", "finish_reason", "error", "usage", "ttft_ms", "tpot_ms", "request_sha256"}

PROMPTS = [
    {"id": "a", "prompt": "Hello, world", "max_tokens": 12},
    {"id": "b", "prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6, 300], "max_tokens": 5},
    {"id": 3, "prompt": "größer ✓", "max_tokens": 1},
    {"id": "long", "prompt": "x" * 100, "max_tokens": 30},
    {"id": "s", "prompt": "sampled", "max_tokens": 10, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 11},
    {"id": "stop", "prompt": "stop early", "max_tokens": 20, "stop": ["\u2603never"]},
    {"id": "too-long", "prompt_token_ids": [1] * 250, "max_tokens": 10},
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def invoke(*args):
    return CliRunner().invoke(main, ["run", *map(str, args)])


def parse_lines(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("cli") / "prompts.jsonl", PROMPTS)


@pytest.fixture(scope="module")
def replay_run(default_artifacts, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-out") / "results.jsonl"
    result = invoke("--prompts", prompts_file, "--manifest", default_artifacts, "--output", out)
    return result, out


def by_id(rows):
    return {r["id"]: r for r in rows}


# ---- a good run -------------------------------------------------------------------------

def test_run_writes_one_result_line_per_request(replay_run):
    result, out = replay_run
    assert result.exit_code == 0, result.output
    rows = parse_lines(out.read_text(encoding="utf-8"))
    assert len(rows) == len(PROMPTS)
    assert sorted(r["id"] for r in rows) == sorted(str(p["id"]) for p in PROMPTS)
    for row in rows:
        assert set(row) == RESULT_FIELDS
        assert isinstance(row["text"], str) and isinstance(row["token_ids"], list)
        assert set(row["usage"]) == {"prompt_tokens", "completion_tokens"}
        assert row["usage"]["completion_tokens"] == len(row["token_ids"])
    res = by_id(rows)
    for p in PROMPTS:
        if p["id"] == "too-long":
            continue
        r = res[str(p["id"])]
        assert r["finish_reason"] == "length" and r["error"] is None
        assert len(r["token_ids"]) == p["max_tokens"]
        n_prompt = len(p["prompt"].encode()) if "prompt" in p else len(p["prompt_token_ids"])
        assert r["usage"]["prompt_tokens"] == n_prompt
        assert isinstance(r["ttft_ms"], (int, float)) and r["ttft_ms"] >= 0
        if p["max_tokens"] > 1:
            assert isinstance(r["tpot_ms"], (int, float)) and r["tpot_ms"] >= 0
        else:
            assert r["tpot_ms"] is None
    bad = res["too-long"]
    assert bad["finish_reason"] == "error" and "max_seq_len" in bad["error"] and bad["token_ids"] == []
    assert bad["usage"] == {"prompt_tokens": 250, "completion_tokens": 0}


def test_run_prints_the_summary_on_stderr(replay_run):
    result, _ = replay_run
    err = result.stderr
    assert f"{len(PROMPTS)} requests (1 refused)" in err
    assert "tokens/s" in err and "padding waste" in err and "%" in err
    assert "steps per key:" in err
    key_lines = [ln for ln in err.splitlines() if ln.startswith("  (bs=")]
    assert key_lines and all(ln.rsplit(": ", 1)[1].isdigit() for ln in key_lines)
    assert any("prefill" in ln for ln in key_lines) and any("decode" in ln for ln in key_lines)
    assert "[replay]" in err
    assert "Traceback" not in result.output
    assert result.stdout == ""  # results went to --output


def test_run_to_stdout_and_summary_json(default_artifacts, prompts_file, replay_run, tmp_path):
    summary = tmp_path / "summary.json"
    result = invoke("--prompts", prompts_file, "--manifest", default_artifacts, "--summary-json", summary)
    assert result.exit_code == 0, result.output
    rows = parse_lines(result.stdout)  # only JSONL on stdout: progress and summary are on stderr
    assert len(rows) == len(PROMPTS) and all(set(r) == RESULT_FIELDS for r in rows)
    body = json.loads(summary.read_text())
    assert body["requests"] == len(PROMPTS) and body["refused"] == 1
    assert body["completion_tokens"] == sum(len(r["token_ids"]) for r in rows)
    assert sum(body["steps_per_key"].values()) == body["steps"]
    # greedy and seeded requests give the same tokens as the --output run
    first = by_id(parse_lines(replay_run[1].read_text(encoding="utf-8")))
    assert {r["id"]: r["token_ids"] for r in rows} == {k: v["token_ids"] for k, v in first.items()}


def test_verbose_prints_and_the_summary_json_holds_the_start_up_phases(default_artifacts, prompts_file, tmp_path):
    summary = tmp_path / "summary.json"
    result = invoke("--prompts", prompts_file, "--manifest", default_artifacts, "--summary-json", summary,
                    "--output", tmp_path / "out.jsonl", "--verbose")
    assert result.exit_code == 0, result.output
    startup = json.loads(summary.read_text())["startup"]
    phases = startup["phases_seconds"]
    # `interpreter` (the process's start to `import trtgraph`) only for the first engine of a
    # process: this in-process run may not be the first
    assert [n for n in phases if n != "interpreter"] == [
        "imports", "checks_and_kernels", "weights_generated", "kv_cache_and_buffers", "warmup_triton_cache",
        "re_record", "tokenizer_and_scheduler", "serving"]
    assert list(phases).index("interpreter") == 0 if "interpreter" in phases else True
    assert all(v >= 0 for v in phases.values()) and phases["re_record"] > 0 and phases["serving"] > 0
    # the first token lies inside `serving`: beside the phases, not in their sum
    assert 0 < startup["first_token_seconds"] <= phases["serving"]
    assert startup["total_seconds"] == pytest.approx(sum(phases.values()), abs=1e-3)
    assert "phases" in result.stderr and "re_record" in result.stderr and "<- largest" in result.stderr
    assert "summary" in result.stderr and "first_token" in result.stderr


def test_eager_gives_the_same_greedy_tokens(default_artifacts, prompts_file, replay_run, tmp_path):
    out = tmp_path / "eager.jsonl"
    result = invoke("--prompts", prompts_file, "--manifest", default_artifacts, "--output", out, "--eager")
    assert result.exit_code == 0, result.output
    assert "[eager (no graphs)]" in result.stderr
    eager = by_id(parse_lines(out.read_text(encoding="utf-8")))
    replay = by_id(parse_lines(replay_run[1].read_text(encoding="utf-8")))
    greedy_ids = [str(p["id"]) for p in PROMPTS if p.get("temperature", 0) == 0 and p["id"] != "too-long"]
    assert len(greedy_ids) >= 4
    for rid in greedy_ids:
        assert eager[rid]["token_ids"] == replay[rid]["token_ids"] and len(eager[rid]["token_ids"]) > 0, rid
    assert eager["s"]["token_ids"] == replay["s"]["token_ids"]  # seeded: the same too


# ---- bad prompts files: exit 2, file + line + field, no traceback, before the engine -----------

@pytest.fixture
def no_engine(monkeypatch):
    """Building the engine fails loudly: a bad prompts file must be rejected before it."""
    calls = []

    def boom(self, *a, **kw):
        calls.append(a)
        raise RuntimeError("ENGINE WAS BUILT")

    monkeypatch.setattr(Engine, "__init__", boom)
    return calls


GOOD = '{"id": "ok", "prompt": "fine", "max_tokens": 4}'

BAD_LINES = [
    ("invalid-json", '{"id": "x", "prompt": "hi"', "not valid JSON"),
    ("missing-id", '{"prompt": "hi"}', "`id`"),
    ("unknown-field", '{"id": "x", "prompt": "hi", "max_new_tokens": 3}', "max_new_tokens"),
    ("empty-prompt", '{"id": "x", "prompt": ""}', "`prompt`"),
    ("both-prompts", '{"id": "x", "prompt": "hi", "prompt_token_ids": [1, 2]}', "prompt_token_ids"),
    ("max-tokens-zero", '{"id": "x", "prompt": "hi", "max_tokens": 0}', "`max_tokens`"),
    ("max-tokens-negative", '{"id": "x", "prompt": "hi", "max_tokens": -5}', "`max_tokens`"),
    ("max-tokens-huge", '{"id": "x", "prompt": "hi", "max_tokens": %d}' % 2 ** 40, "`max_tokens`"),
    ("max-tokens-string", '{"id": "x", "prompt": "hi", "max_tokens": "8"}', "`max_tokens`"),
    ("temperature-negative", '{"id": "x", "prompt": "hi", "temperature": -0.1}', "`temperature`"),
    ("top-p-zero", '{"id": "x", "prompt": "hi", "top_p": 0}', "`top_p`"),
    ("top-p-two", '{"id": "x", "prompt": "hi", "top_p": 2}', "`top_p`"),
    ("token-ids-not-ints", '{"id": "x", "prompt_token_ids": [1, "a"]}', "`prompt_token_ids`"),
    ("not-an-object", '["id", "x"]', "JSON object"),
]


@pytest.mark.parametrize("name,line,needle", BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_bad_prompt_line_exits_2_naming_file_line_and_field(tmp_path, no_engine, name, line, needle):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n{GOOD.replace('ok', 'ok2')}\n", encoding="utf-8")  # bad on line 3
    result = invoke("--prompts", path, "--manifest", "does-not-matter")
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr
    assert err.startswith("error: ")
    assert f"{path} line 3" in err
    assert needle in err
    assert "Traceback" not in result.output and "ENGINE WAS BUILT" not in result.output
    assert no_engine == []
    assert result.stdout == ""


def test_duplicate_ids_name_both_lines(tmp_path, no_engine):
    path = tmp_path / "dup.jsonl"
    write_jsonl(path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}])
    result = invoke("--prompts", path)
    assert result.exit_code == 2
    err = result.stderr
    assert f"{path} line 3" in err and "line 1" in err and "duplicate id 'a'" in err
    assert "Traceback" not in result.output and no_engine == []


def test_integer_and_string_ids_collide(tmp_path, no_engine):
    path = tmp_path / "dup2.jsonl"
    write_jsonl(path, [{"id": 7, "prompt": "x"}, {"id": "7", "prompt": "y"}])
    result = invoke("--prompts", path)
    assert result.exit_code == 2 and "line 2" in result.stderr and "line 1" in result.stderr


def test_invalid_utf8_names_the_line(tmp_path, no_engine):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"id": "x", "prompt": "caf\xe9"}\n')
    result = invoke("--prompts", path)
    assert result.exit_code == 2
    assert f"{path} line 2" in result.stderr and "UTF-8" in result.stderr
    assert "Traceback" not in result.output and no_engine == []


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"], ids=["empty", "blank-lines"])
def test_empty_prompts_file(tmp_path, no_engine, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    result = invoke("--prompts", path)
    assert result.exit_code == 2
    assert str(path) in result.stderr and "no requests" in result.stderr
    assert "Traceback" not in result.output and no_engine == []


def test_missing_prompts_file(tmp_path, no_engine):
    path = tmp_path / "nope.jsonl"
    result = invoke("--prompts", path)
    assert result.exit_code == 2
    assert str(path) in result.stderr and "cannot read" in result.stderr
    assert "Traceback" not in result.output and no_engine == []


def test_good_file_does_reach_the_engine(default_artifacts, tmp_path, no_engine):
    """The patch above is effective: a good file gets as far as building the engine."""
    path = tmp_path / "good.jsonl"
    path.write_text(GOOD + "\n", encoding="utf-8")
    result = invoke("--prompts", path, "--manifest", default_artifacts)
    assert len(no_engine) == 1
    assert result.exit_code == 1 and "ENGINE WAS BUILT" in result.output


def test_bad_file_is_rejected_before_a_real_manifest_is_loaded(default_artifacts, tmp_path, monkeypatch):
    import trtgraph.artifacts

    loads = []
    real = trtgraph.artifacts.load_manifest
    monkeypatch.setattr(trtgraph.artifacts, "load_manifest", lambda *a, **k: loads.append(a) or real(*a, **k))
    monkeypatch.setattr("trtgraph.runtime.serving.engine_start.load_manifest", trtgraph.artifacts.load_manifest)
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + '\n{"id": "x", "prompt": "hi", "top_p": 2}\n', encoding="utf-8")
    result = invoke("--prompts", path, "--manifest", default_artifacts)
    assert result.exit_code == 2 and f"{path} line 2" in result.stderr and "`top_p`" in result.stderr
    assert loads == []  # the manifest was never even read


def test_missing_manifest_dir_exits_2_pointing_to_capture(prompts_file, tmp_path):
    result = invoke("--prompts", prompts_file, "--manifest", tmp_path / "no-such-artifacts")
    assert result.exit_code == 2, result.output
    assert "trtgraph capture" in result.stderr and "no-such-artifacts" in result.stderr
    assert "Traceback" not in result.output


def test_trtgraph_raise_errors_shows_the_exception(tmp_path, monkeypatch):
    """The escape hatch: TRTGRAPH_RAISE_ERRORS=1 lets the PromptError through."""
    from trtgraph.errors import PromptError

    monkeypatch.setenv("TRTGRAPH_RAISE_ERRORS", "1")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x"}\n', encoding="utf-8")
    result = invoke("--prompts", path)
    assert isinstance(result.exception, PromptError) and "line 1" in str(result.exception)
