"""OpenAI Batch API files in `trtgraph run`: detection, OpenAI's output format (every body
parses with the `openai` package's own types), per-request errors as status 400 lines while
the rest runs, whole-file refusals naming the line, `-` for stdin/stdout, and --resume keyed
by custom_id."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
pytest.importorskip("openai")  # a test extra (pyproject); skipped where it is not installed
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion

from trtgraph.cli import main
from trtgraph.errors import PromptError
from trtgraph.formats.batch import read_requests
from trtgraph.runtime.serving import requests as native

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def line(cid, body, url=COMPLETIONS, **extra):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body, **extra}


GOOD = [
    line("greedy", {"model": "tiny", "prompt": "Hello, world", "max_tokens": 6, "temperature": 0}),
    line("sampled", {"prompt": "Once upon", "max_tokens": 5, "temperature": 0.8, "top_p": 0.9, "seed": 3}),
    line("ids", {"prompt": [3, 1, 4, 1, 5], "max_tokens": 4, "temperature": 0, "stop": ["\u2603"]}),
    line("n3", {"prompt": "x" * 40, "max_tokens": 3, "n": 3, "seed": 11}),
]
BAD = [
    line("bad-field", {"prompt": "a", "echo": True}),  # refused by the translation
    line("bad-value", {"prompt": "a", "max_tokens": 0}),  # refused by the native validation
    line("too-long", {"prompt": [1] * 250, "max_tokens": 10, "temperature": 0}),  # refused at admission
    line("bad-body", ["not", "an", "object"]),
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def parse_lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def check_batch_line(row: dict, url: str) -> None:
    """One output line in OpenAI's batch output format; the body parses with openai's types."""
    assert set(row) == {"id", "custom_id", "response", "error"} and row["id"].startswith("batch_req_")
    resp = row["response"]
    assert set(resp) == {"status_code", "request_id", "body"} and isinstance(resp["request_id"], str)
    if resp["status_code"] == 200:
        assert row["error"] is None
        (Completion if url == COMPLETIONS else ChatCompletion).model_validate(resp["body"])
    else:
        assert resp["status_code"] == 400 and set(resp["body"]) == {"error"}
        assert set(resp["body"]["error"]) == {"message", "type", "param", "code"}
        BatchError.model_validate(row["error"])
        assert row["error"]["message"] == resp["body"]["error"]["message"]


# ---- reading ----------------------------------------------------------------------------------

def test_batch_file_is_detected_and_bad_bodies_are_refused_per_line(tmp_path):
    f = read_requests(write_jsonl(tmp_path / "b.jsonl", GOOD + BAD[:2] + BAD[3:]))
    assert f.is_batch and f.id_field == "custom_id"
    assert [r.id for r in f.requests] == ["greedy", "sampled", "ids", "n3"]
    assert f.requests[3].n == 3 and f.requests[1].temperature == 0.8 and f.requests[0].temperature == 0.0
    assert f.requests[2].prompt_token_ids == (3, 1, 4, 1, 5)
    assert list(f.refused) == ["bad-field", "bad-value", "bad-body"]
    assert f.refused["bad-field"]["response"]["body"]["error"]["param"] == "echo"
    assert f.refused["bad-value"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert f.refused["bad-value"]["error"]["line"] == 6
    for row in f.refused.values():
        check_batch_line(row, COMPLETIONS)
    assert f.ids == [r["custom_id"] for r in GOOD + BAD[:2] + BAD[3:]]


def test_native_file_reads_as_before(tmp_path):
    f = read_requests(write_jsonl(tmp_path / "n.jsonl", [{"id": "a", "prompt": "x", "n": 2}]))
    assert not f.is_batch and f.id_field == "id" and f.ids == ["a"] and f.requests[0].n == 2


@pytest.mark.parametrize("rows, where, says", [
    ([GOOD[0], {"id": "a", "prompt": "x"}], "line 2", "a native request in a file of OpenAI batch lines"),
    ([{"id": "a", "prompt": "x"}, GOOD[0]], "line 2", "an OpenAI batch line in a file of native requests"),
    ([GOOD[0], {**GOOD[1], "custom_id": ""}], "line 2", "custom_id"),
    ([GOOD[0], {k: v for k, v in GOOD[1].items() if k != "custom_id"}], "line 2", "custom_id"),
    ([GOOD[0], GOOD[1], {**GOOD[2], "custom_id": "greedy"}], "line 3", "duplicate custom_id 'greedy' (first on line 1)"),
    ([GOOD[0], {**GOOD[1], "url": "/v1/embeddings"}], "line 2", "/v1/embeddings"),
    ([{**GOOD[0], "method": "GET"}], "line 1", "POST"),
    ([{**GOOD[0], "extra": 1}], "line 1", "unknown field extra"),
    ([{k: v for k, v in GOOD[0].items() if k != "body"}], "line 1", "no `body`"),
])
def test_malformed_line_structure_refuses_the_whole_file(tmp_path, rows, where, says):
    with pytest.raises(PromptError) as e:
        read_requests(write_jsonl(tmp_path / "b.jsonl", rows))
    assert f"b.jsonl {where}:" in str(e.value) and says in str(e.value)


def test_not_json_names_the_line(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(PromptError, match="b.jsonl line 2: not valid JSON"):
        read_requests(str(path))


# ---- running ----------------------------------------------------------------------------------

def invoke(*args, stdin=None):
    return CliRunner().invoke(main, ["run", *map(str, args)], input=stdin)


@pytest.fixture(scope="module")
def batch_run(default_artifacts, tmp_path_factory, one_torch_thread):
    d = tmp_path_factory.mktemp("batch")
    rows = GOOD + BAD
    result = invoke("--prompts", write_jsonl(d / "in.jsonl", rows), "--manifest", default_artifacts,
                    "--output", d / "out.jsonl")
    assert result.exit_code == 0, result.output
    return rows, parse_lines((d / "out.jsonl").read_text(encoding="utf-8")), d


def test_every_batch_output_line_parses_with_openai_types(batch_run):
    rows, out, _ = batch_run
    assert sorted(r["custom_id"] for r in out) == sorted(r["custom_id"] for r in rows)
    for row in out:
        check_batch_line(row, COMPLETIONS)
    by_id = {r["custom_id"]: r["response"] for r in out}
    assert {k for k, v in by_id.items() if v["status_code"] == 400} == {r["custom_id"] for r in BAD}
    assert "max_seq_len" in by_id["too-long"]["body"]["error"]["message"]
    greedy = Completion.model_validate(by_id["greedy"]["body"])
    assert greedy.model == "tiny" and greedy.usage.completion_tokens == 6 and greedy.choices[0].finish_reason == "length"
    n3 = Completion.model_validate(by_id["n3"]["body"])
    assert [c.index for c in n3.choices] == [0, 1, 2] and n3.usage.completion_tokens == 9
    assert n3.usage.prompt_tokens == 40 and n3.model == "trtgraph"


def test_batch_output_equals_native_run_of_the_same_requests(batch_run, default_artifacts):
    """The batch path changes only the shapes: the same requests as native lines give the same text."""
    _, out, d = batch_run
    rows = [{"id": "greedy", "prompt": "Hello, world", "max_tokens": 6},
            {"id": "sampled", "prompt": "Once upon", "max_tokens": 5, "temperature": 0.8, "top_p": 0.9, "seed": 3}]
    result = invoke("--prompts", write_jsonl(d / "native.jsonl", rows), "--manifest", default_artifacts)
    assert result.exit_code == 0, result.output
    want = {r["id"]: r["text"] for r in parse_lines(result.stdout)}
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in out if r["custom_id"] in want}
    assert {k: got[k] for k in want} == want


def test_stdin_and_stdout_dash(default_artifacts):
    rows = [GOOD[0], BAD[0]]
    stdin = "".join(json.dumps(r) + "\n" for r in rows)
    result = invoke("--prompts", "-", "--manifest", default_artifacts, "--output", "-", stdin=stdin)
    assert result.exit_code == 0, result.output
    out = parse_lines(result.stdout)  # only JSONL on stdout
    assert [r["custom_id"] for r in out] == ["bad-field", "greedy"]
    for row in out:
        check_batch_line(row, COMPLETIONS)
    native_in = json.dumps({"id": "a", "prompt": "hi", "max_tokens": 2}) + "\n"
    result = invoke("--prompts", "-", "--manifest", default_artifacts, stdin=native_in)
    assert result.exit_code == 0 and [r["id"] for r in parse_lines(result.stdout)] == ["a"]


def test_stdin_errors_name_stdin(default_artifacts):
    result = invoke("--prompts", "-", "--manifest", default_artifacts, stdin=json.dumps(GOOD[0]) + "\n[1]\n")
    assert result.exit_code == 2 and "<stdin> line 2" in result.stderr and "Traceback" not in result.output


def test_resume_of_a_batch_output_runs_only_the_missing_custom_ids(batch_run, default_artifacts):
    rows, out, d = batch_run
    partial = d / "partial.jsonl"
    kept = out[:3]
    partial.write_text("".join(json.dumps(r) + "\n" for r in kept) + json.dumps(out[3])[:20], encoding="utf-8")
    result = invoke("--prompts", d / "in.jsonl", "--manifest", default_artifacts, "--output", partial, "--resume")
    assert result.exit_code == 0, result.output
    assert f"resume: 3 requests already in {partial}, {len(rows) - 3} to run" in result.stderr
    final = parse_lines(partial.read_text(encoding="utf-8"))
    assert final[:3] == kept
    assert sorted(r["custom_id"] for r in final) == sorted(r["custom_id"] for r in rows)
    for row in final:
        check_batch_line(row, COMPLETIONS)


# ---- chat: needs the chat-template support of the native requests (`messages`) ------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_chat_checkpoint(path):
    """A tiny Llama with a byte-level tokenizer and a chat template, saved like a hub checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_models import save_tiny

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]})
    fast.chat_template = CHAT_TEMPLATE
    save_tiny("LlamaForCausalLM", path, eos_token_id=fast.convert_tokens_to_ids("<|end|>"))
    fast.save_pretrained(path)


@pytest.mark.skipif("messages" not in native.FIELDS,
                    reason="chat lines need `messages` in native requests (the ckpt helper's chat templates)")
def test_chat_batch_lines_parse_as_chat_completions(tmp_path):
    from conftest import tiny_config
    from trtgraph.compiler.pipeline import capture
    from trtgraph.config import Config

    ckpt = tmp_path / "ckpt"
    save_chat_checkpoint(ckpt)
    d = tiny_config().to_dict()
    d["model"] = {"path": str(ckpt)}
    capture(Config.from_dict(d, source="chat test"), tmp_path / "art")
    rows = [line("c1", {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}],
                        "max_completion_tokens": 5, "temperature": 0, "n": 2}, url=CHAT),
            line("c2", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "seed": 1}, url=CHAT),
            line("c-bad", {"messages": [{"role": "wizard", "content": "x"}]}, url=CHAT)]
    result = invoke("--prompts", write_jsonl(tmp_path / "chat.jsonl", rows), "--manifest", tmp_path / "art")
    assert result.exit_code == 0, result.output
    out = {r["custom_id"]: r for r in parse_lines(result.stdout)}
    for row in out.values():
        check_batch_line(row, CHAT)
    c1 = ChatCompletion.model_validate(out["c1"]["response"]["body"])
    assert len(c1.choices) == 2 and c1.choices[0].message.content == c1.choices[1].message.content
    assert out["c-bad"]["response"]["body"]["error"]["param"] == "messages[0].role"
