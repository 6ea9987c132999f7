"""The nineteenth session's pass over `trtgraph run`'s request files and the new-user path:
an OpenAI batch chat line without a max runs to the end of the context as `serve`'s chat
does (the native `max_tokens: "context"`), and what following README.md as written found.
The shipped model (a real tokenizer and chat template) is captured once for the module with a
short context (limits.max_seq_len 64), so a reply reaches the context's end in a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtgraph.cli import main
from trtgraph.runtime.serving import resume

ROOT = Path(__file__).resolve().parents[1]
MAX_SEQ_LEN = 64
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, one_torch_thread):
    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config

    config = Config.from_dict({
        "model": {"path": str(ROOT / "trtgraph" / "assets" / "stdlib-llama")}, "dtype": "float32", "device": "cpu",
        "limits": {"max_batch_size": 2, "max_seq_len": MAX_SEQ_LEN, "max_num_tokens": 64},
        "buckets": {"batch_sizes": [1, 2], "context_batch_sizes": [1], "chunk_sizes": [64],
                    "sampling": ["greedy", "sampled"]}}, source="test_r19_files")
    out = tmp_path_factory.mktemp("stdlib-64")
    capture(config, out)
    return out


def batch_line(cid, body, url=CHAT):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def run(artifacts, prompts: str, *extra: str):
    return CliRunner().invoke(main, ["run", "--prompts", prompts, "--manifest", str(artifacts), *extra])


def rows_of(path) -> dict[str, dict]:
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    return {r.get("custom_id", r.get("id")): r for r in rows}


# ---- a batch chat line without a max runs to the end of the context ---------------------------

def test_a_batch_chat_line_without_a_max_runs_to_the_end_of_the_context_as_serve_does(artifacts, tmp_path):
    """A chat line without max_tokens / max_completion_tokens was cut at the native default of
    16 tokens (finish_reason "length"), while the same body sent to `serve` ran to the end of
    the context, as OpenAI's and vLLM's do: a silently shorter answer for the same body."""
    body = {"messages": HELLO, "temperature": 0, "ignore_eos": True}
    prompts = write_jsonl(tmp_path / "b.jsonl", [
        batch_line("whole", body),
        batch_line("sampled", {"messages": HELLO, "temperature": 0.8, "seed": 5, "ignore_eos": True, "n": 2}),
        batch_line("completion", {"prompt": "def f():\n", "temperature": 0, "ignore_eos": True}, "/v1/completions")])
    res = run(artifacts, prompts, "--output", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 0, res.output
    out = rows_of(tmp_path / "out.jsonl")
    whole = out["whole"]["response"]["body"]
    usage = whole["usage"]
    assert whole["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_SEQ_LEN == usage["total_tokens"]
    for choice in out["sampled"]["response"]["body"]["choices"]:  # n > 1: each completion to the end too
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == usage["completion_tokens"]
    # completions keep OpenAI's default of 16 tokens
    assert out["completion"]["response"]["body"]["usage"]["completion_tokens"] == 16
    # the same tokens as asking for exactly that many
    asked = write_jsonl(tmp_path / "asked.jsonl", [
        batch_line("whole", {**body, "max_completion_tokens": usage["completion_tokens"]})])
    res = run(artifacts, asked, "--output", str(tmp_path / "asked-out.jsonl"))
    assert res.exit_code == 0, res.output
    assert rows_of(tmp_path / "asked-out.jsonl")["whole"]["response"]["body"]["choices"][0]["token_ids"] == \
        whole["choices"][0]["token_ids"]


def test_a_batch_chat_line_without_a_max_is_refused_only_where_the_context_leaves_nothing(artifacts, tmp_path):
    """min_tokens past 16 without a max was refused ("expected an integer in [0, max_tokens =
    16]") for a max the line never gave; it is checked against what the context leaves once the
    prompt is encoded. A prompt that fills the context is a 400 saying so (not naming a
    max_tokens the line never sent); the rest of the file runs."""
    prompts = write_jsonl(tmp_path / "b.jsonl", [
        batch_line("min20", {"messages": HELLO, "temperature": 0, "min_tokens": 20}),
        batch_line("min-too-many", {"messages": HELLO, "temperature": 0, "min_tokens": MAX_SEQ_LEN}),
        batch_line("full", {"messages": [{"role": "user", "content": " x" * MAX_SEQ_LEN}]}),
        batch_line("string-max", {"messages": HELLO, "max_tokens": "context"}),
        batch_line("fine", {"messages": HELLO, "max_tokens": 3, "temperature": 0})])
    res = run(artifacts, prompts, "--output", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 0, res.output
    out = rows_of(tmp_path / "out.jsonl")
    assert out["min20"]["response"]["status_code"] == 200
    assert out["min20"]["response"]["body"]["usage"]["completion_tokens"] >= 20
    for cid, words in (("min-too-many", ["min_tokens", "max_seq_len"]), ("full", ["max_seq_len", "shorten the messages"])):
        assert out[cid]["response"]["status_code"] == 400, out[cid]
        message = out[cid]["error"]["message"]
        assert all(w in message for w in words) and "max_tokens (" not in message, message
    # an OpenAI body's max_tokens is an integer: the native "context" is not taken from a body
    assert out["string-max"]["response"]["status_code"] == 400
    assert out["string-max"]["error"]["param"] == "max_tokens"
    assert out["fine"]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_a_batch_line_over_the_context_gets_openais_code_and_names_the_bodys_field(artifacts, tmp_path):
    """A batch line refused by limits.max_seq_len had `code` and `param` null where `serve` answers
    `context_length_exceeded` naming the field: the prompt (`messages` / `prompt`) where it alone
    leaves no room, else the max field the body gave."""
    long = " x" * MAX_SEQ_LEN
    prompts = write_jsonl(tmp_path / "b.jsonl", [
        batch_line("chat-full", {"messages": [{"role": "user", "content": long}]}),
        batch_line("chat-max", {"messages": HELLO, "max_completion_tokens": MAX_SEQ_LEN}),
        batch_line("text-full", {"prompt": long, "max_tokens": 4}, url="/v1/completions"),
        batch_line("text-max", {"prompt": "hello", "max_tokens": MAX_SEQ_LEN}, url="/v1/completions"),
        batch_line("min-too-many", {"messages": HELLO, "min_tokens": MAX_SEQ_LEN})])
    res = run(artifacts, prompts, "--output", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 0, res.output
    out = rows_of(tmp_path / "out.jsonl")
    for cid, param in (("chat-full", "messages"), ("chat-max", "max_completion_tokens"), ("text-full", "prompt"),
                       ("text-max", "max_tokens")):
        error = out[cid]["response"]["body"]["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", param), (cid, error)
        assert out[cid]["error"]["param"] == param and out[cid]["error"]["message"] == error["message"]
    assert out["min-too-many"]["response"]["body"]["error"]["code"] is None  # not the context's length: min_tokens


# ---- the native spelling: max_tokens "context" -------------------------------------------------

def test_a_native_request_may_ask_to_run_to_the_end_of_the_context(artifacts, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "chat", "messages": HELLO, "max_tokens": "context", "ignore_eos": True},
        {"id": "ids", "prompt_token_ids": [5] * 60, "max_tokens": "context", "ignore_eos": True, "n": 2,
         "temperature": 0.5, "seed": 1}])
    res = run(artifacts, prompts, "--output", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 0, res.output
    out = rows_of(tmp_path / "out.jsonl")
    chat = out["chat"]
    assert chat["finish_reason"] == "length"
    assert chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] == MAX_SEQ_LEN
    assert out["ids"]["usage"] == {"prompt_tokens": 60, "completion_tokens": 8}
    assert [len(c["token_ids"]) for c in out["ids"]["choices"]] == [4, 4]


@pytest.mark.parametrize("value", ["Context", "auto", None, -1, 1.5, True, [16]])
def test_a_bad_max_tokens_names_the_field_and_the_context_spelling(tmp_path, value):
    from trtgraph.runtime.serving.sampling_params import SamplingParams

    bad = {"id": "a", "prompt": "x", "max_tokens": value}
    res = CliRunner().invoke(main, ["run", "--prompts", write_jsonl(tmp_path / "p.jsonl", [bad]),
                                    "--manifest", str(tmp_path / "none")])
    if value is None:  # null is "not given" (the default), as for every field; Python's None is not
        assert res.exit_code == 2 and "no manifest here" in res.output, res.output
    else:
        assert res.exit_code == 2 and "line 1" in res.output and "max_tokens" in res.output
        assert '"context"' in res.output, res.output
    with pytest.raises(Exception, match='max_tokens.*"context"'):
        SamplingParams(max_tokens=value)


def test_the_python_api_serves_max_tokens_context(artifacts):
    import trtgraph

    llm = trtgraph.LLM(artifacts)
    sampling = trtgraph.SamplingParams(max_tokens="context", ignore_eos=True, temperature=0)
    [c] = llm.chat(HELLO, sampling)
    assert c.finish_reason == "length" and c.usage.total_tokens == MAX_SEQ_LEN
    [d] = llm.generate([{"prompt": "def", "max_tokens": "context", "min_tokens": 70}])
    assert d.finish_reason == "error" and "min_tokens" in d.error and "max_seq_len" in d.error
    [e] = llm.generate([{"prompt_token_ids": [5] * MAX_SEQ_LEN, "max_tokens": "context"}])
    assert e.finish_reason == "error" and "max_seq_len" in e.error


def test_resume_refuses_a_chat_result_an_earlier_trtgraph_cut_at_16_tokens(artifacts, tmp_path):
    """A batch chat line without a max got 16 tokens from trtgraph before this session; its input
    line (so its fingerprint) is unchanged, so --resume kept that cut result beside full ones
    written now: the same kind of line answered two ways in one output. It is refused, naming the
    line and what to do; a result that reached the end of the context, or asked for 16, is kept."""
    body = {"messages": HELLO, "temperature": 0, "ignore_eos": True}
    lines = [batch_line("old", body), batch_line("asked16", {**body, "max_tokens": 16}), batch_line("new", body),
             batch_line("todo", body)]
    prompts, out = write_jsonl(tmp_path / "b.jsonl", lines), tmp_path / "out.jsonl"
    assert run(artifacts, write_jsonl(tmp_path / "first.jsonl", lines[1:3]), "--output", str(out)).exit_code == 0
    rows = rows_of(out)
    old = json.loads(json.dumps(rows["asked16"]).replace("asked16", "old"))  # as the old default wrote it
    old["response"]["request_id"] = "req_sha256_" + resume.request_fingerprint(lines[0])
    for row in rows.values():
        row["response"]["request_id"] = "req_sha256_" + resume.request_fingerprint(
            next(ln for ln in lines if ln["custom_id"] == row["custom_id"]))
    write_jsonl(out, [old, rows["asked16"], rows["new"]])
    before = out.read_text()
    res = run(artifacts, prompts, "--output", str(out), "--resume")
    assert res.exit_code == 2 and "line 1" in res.output and "'old'" in res.output and "16 tokens" in res.output
    assert "Remove" in res.output and out.read_text() == before, res.output
    write_jsonl(out, [rows["asked16"], rows["new"]])
    res = run(artifacts, prompts, "--output", str(out), "--resume")
    assert res.exit_code == 0, res.output
    assert set(rows_of(out)) == {"old", "asked16", "new", "todo"}


# ---- the new-user path: README.md followed as written --------------------------------------------

@pytest.mark.parametrize("name", ["prompts.jsonl", "stdlib-prompts.jsonl", "stdlib-batch.jsonl"])
def test_the_example_request_files_read_whole(name):
    """The README's batch section had no example file to run; each example reads with no line refused."""
    from trtgraph.formats.batch import read_requests

    f = read_requests(str(ROOT / "examples" / name))
    assert f.requests and not f.refused
    assert f.is_batch == (name == "stdlib-batch.jsonl")


def test_penalties_refused_with_speculative_decoding_name_the_switch_that_turns_it_off(tmp_path_factory, tmp_path):
    """The refusal said "run with speculative decoding off" without saying how; `run` has
    --no-speculative and LLM speculative=False, which serve the same capture."""
    from conftest import tiny_config
    from trtgraph.compiler.pipeline import capture

    arts = tmp_path_factory.mktemp("spec")
    capture(tiny_config(speculative={"draft_len": 2, "ngram_min": 1, "ngram_max": 2}), arts)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "pen", "prompt": "abc", "max_tokens": 2,
                                                 "presence_penalty": 1.0}])
    res = run(arts, prompts, "--output", str(tmp_path / "a.jsonl"))
    assert res.exit_code == 0 and "--no-speculative" in rows_of(tmp_path / "a.jsonl")["pen"]["error"]
    res = run(arts, prompts, "--output", str(tmp_path / "b.jsonl"), "--no-speculative")
    assert res.exit_code == 0 and rows_of(tmp_path / "b.jsonl")["pen"]["finish_reason"] == "length"


def test_inspect_check_of_a_moved_checkpoint_says_to_pass_model_not_to_recapture(tmp_path, one_torch_thread):
    """README: a checkpoint that moved after capture is served with `run --model PATH`; `inspect
    --check` named the moved path but told the user to recapture."""
    import shutil

    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config

    shutil.copytree(ROOT / "trtgraph" / "assets" / "stdlib-llama", tmp_path / "ckpt")
    capture(Config.from_dict({"model": {"path": str(tmp_path / "ckpt")}, "dtype": "float32", "device": "cpu",
                              "limits": {"max_batch_size": 1, "max_seq_len": 32, "max_num_tokens": 32},
                              "buckets": {"batch_sizes": [1], "context_batch_sizes": [1], "chunk_sizes": [32],
                                          "sampling": ["greedy"]}}, source="t"), tmp_path / "art")
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    res = CliRunner().invoke(main, ["inspect", str(tmp_path / "art"), "--check"])
    assert res.exit_code == 3 and "config.model.path" in res.output
    assert "--model" in res.output and "recapture" not in res.output, res.output
