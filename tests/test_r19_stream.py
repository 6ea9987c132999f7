"""The nineteenth session's streaming of `n > 1` and logprobs over `trtgraph serve`: a real
server on 127.0.0.1 (the fixtures of tests/test_server.py and tests/test_r18_server.py),
talked to with the official `openai` client, whose own types parse every chunk. Streamed,
every completion's chunks name it by `index` and end with its own finish_reason; joined, they
are the whole answer's completion for the same seed: its text, token ids and logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from test_r11_server import slowed  # noqa: E402
from test_r18_server import server as llama  # noqa: E402,F401  (the shipped model: a chat template)
from test_server import API_KEY, MODEL, server, wait_for  # noqa: E402,F401

LLAMA = "stdlib-llama"
HELLO = [{"role": "user", "content": "hello"}]


def joined(chunks, chat: bool = False) -> dict[int, dict]:
    """Each completion's chunks joined: {index: {text, token_ids, finishes, logprobs, roles}}.
    `finishes`: the finish_reason of each of its chunks; logprobs: the lists of completions'
    logprobs joined (or a chat's content entries), None where no chunk had any."""
    out: dict[int, dict] = {}
    for ch in chunks:
        strict(ch, chat)
        assert len(ch.choices) <= 1, "one completion per chunk"
        for c in ch.choices:
            d = out.setdefault(c.index, {"text": "", "token_ids": [], "finishes": [], "logprobs": None, "roles": []})
            d["text"] += (c.delta.content or "") if chat else c.text
            d["token_ids"] += c.token_ids
            d["finishes"].append(c.finish_reason)
            if chat:
                d["roles"].append(c.delta.role)
            if c.logprobs is not None:
                lp = c.logprobs.model_dump()
                if chat:
                    d["logprobs"] = (d["logprobs"] or []) + lp["content"]
                else:
                    d["logprobs"] = {k: (d["logprobs"] or {}).get(k, []) + lp[k] for k in lp}
    return out


def strict(chunk, chat: bool) -> None:
    """A chunk as the `openai` client received it, validated by its types (the client builds
    them without validating). A completions chunk before a choice's last has finish_reason
    null, which the Completion type (made for whole answers) does not allow: checked as "stop"."""
    raw = chunk.to_dict(exclude_unset=False)
    if chat:
        ChatCompletionChunk.model_validate(raw)
        return
    for c in raw["choices"]:
        c["finish_reason"] = c["finish_reason"] or "stop"
    Completion.model_validate(raw)


def whole_logprobs(choice, chat: bool = False):
    lp = choice.logprobs.model_dump()
    return lp["content"] if chat else lp


def check_against_whole(streamed: dict[int, dict], whole, chat: bool = False, logprobs: bool = False) -> None:
    """Every completion streamed is the whole answer's: its text, ids, finish (on its last
    chunk only) and, when asked, logprobs."""
    assert sorted(streamed) == [c.index for c in whole.choices] == list(range(len(whole.choices)))
    for c in whole.choices:
        got = streamed[c.index]
        assert got["token_ids"] == c.token_ids, c.index
        assert got["text"] == (c.message.content if chat else c.text), c.index
        assert got["finishes"] == [None] * (len(got["finishes"]) - 1) + [c.finish_reason], c.index
        if chat:
            assert got["roles"] == ["assistant"] + [None] * (len(got["roles"]) - 1), c.index
        if logprobs:
            assert got["logprobs"] == whole_logprobs(c, chat), c.index
        else:
            assert got["logprobs"] is None


def stream_and_whole(client, chat: bool, stream_options: dict | None = None, **body):
    """The chunks of `body` streamed, and its whole answer."""
    create = client.chat.completions.create if chat else client.completions.create
    chunks = list(create(stream=True, **({"stream_options": stream_options} if stream_options else {}), **body))
    return chunks, create(**body)


# ---- n > 1 streamed ---------------------------------------------------------------------------

def test_completions_stream_n_choices_by_index_each_with_its_finish_and_the_summed_usage(server):
    """`n: 3, stream: true` was a 400; now each chunk names its completion, each completion
    ends with its own finish_reason, and include_usage's last chunk sums the three."""
    body = dict(model=MODEL, prompt="three ways", max_tokens=7, n=3, temperature=0.9, seed=11)
    chunks, whole = stream_and_whole(server.client(), False, stream_options={"include_usage": True}, **body)
    *deltas, last = chunks
    assert all(isinstance(ch, Completion) for ch in chunks)
    check_against_whole(joined(deltas), whole)
    assert len({tuple(c.token_ids) for c in whole.choices}) == 3, "the completions should differ"
    assert last.choices == [] and last.usage == whole.usage
    assert last.usage.completion_tokens == sum(len(c.token_ids) for c in whole.choices) == 21
    assert all(ch.usage is None for ch in deltas)
    again = joined(server.client().completions.create(stream=True, **body))  # the seed reproduces them
    assert [again[i]["token_ids"] for i in range(3)] == [c.token_ids for c in whole.choices]


def test_chat_stream_n_choices_each_say_their_role_first(llama):
    body = dict(model=LLAMA, messages=HELLO, max_tokens=9, n=2, temperature=1.0, seed=5)
    chunks, whole = stream_and_whole(llama.client(), True, **body)
    assert all(isinstance(ch, ChatCompletionChunk) for ch in chunks)
    assert isinstance(whole, ChatCompletion)
    check_against_whole(joined(chunks, chat=True), whole, chat=True)
    # two completions, not one twice (the shipped model is peaky: some seeds give both the same 9 tokens)
    assert whole.choices[0].message.content != whole.choices[1].message.content


def test_stream_n_with_stop_strings_ends_each_choice_at_its_own_stop(server):
    """Stop strings with n > 1: each completion holds back text that may start a stop and
    ends before its own first stop ("stop"), or at max_tokens ("length")."""
    body = dict(model=MODEL, prompt="ab", max_tokens=40, n=4, temperature=1.0, seed=2, stop=["abb", "ba\n"],
                logit_bias={"97": 8, "98": 8, "10": 4})
    chunks, whole = stream_and_whole(server.client(), False, **body)
    streamed = joined(chunks)
    check_against_whole(streamed, whole)
    assert {c.finish_reason for c in whole.choices} == {"stop"}  # the bias makes every one meet a stop
    assert len({c.text for c in whole.choices}) > 1
    for c in whole.choices:
        assert "abb" not in c.text and "ba\n" not in c.text


def test_stream_n_1_token_and_more_choices_than_the_batch_holds(server):
    """max_tokens 1 (the first completion ends at the token that forks the others) and n
    above the largest batch (forks wait for rows): every completion still comes, once."""
    n = server.engine.config.limits.max_batch_size + 3
    for max_tokens in (1, 5):
        body = dict(model=MODEL, prompt="fork", max_tokens=max_tokens, n=n, temperature=1.0, seed=9)
        chunks, whole = stream_and_whole(server.client(), False, stream_options={"include_usage": True}, **body)
        check_against_whole(joined(chunks[:-1]), whole)
        assert chunks[-1].usage.completion_tokens == n * max_tokens
    wait_for(server.idle_and_leak_free, 30, "no KV block leaked")


def test_a_client_leaving_a_stream_of_n_aborts_every_completion(server):
    before = server.metrics().get("trtgraph_requests_total[('outcome', 'abort')]", 0)
    with slowed(server, 0.05):
        stream = server.client().completions.create(model=MODEL, prompt="long", max_tokens=200, n=3, temperature=1.0,
                                                    seed=1, stream=True)
        seen = set()
        for ch in stream:
            seen.add(ch.choices[0].index)
            if seen == {0, 1, 2}:
                break
        assert len(server.engine.scheduler.running) == 3
        stream.close()
        wait_for(server.idle_and_leak_free, 10, "every completion aborted and its blocks freed")
    assert server.metrics()["trtgraph_requests_total[('outcome', 'abort')]"] == before + 1


def test_generation_tokens_count_every_completion_once(server):
    """/metrics' generation_tokens counted an n > 1 request's tokens at its end; its
    completions now stream, each token counted as it comes, and not again at the end."""
    def tokens():
        return server.metrics()["trtgraph_generation_tokens_total[]"]

    body = dict(model=MODEL, prompt="count", max_tokens=6, n=3, temperature=1.0, seed=3)
    for stream in (True, False):
        before = tokens()
        got = server.client().completions.create(stream=stream, **body)
        list(got) if stream else None
        assert tokens() == before + 18, stream


# ---- logprobs streamed -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2])
def test_completions_stream_logprobs_join_to_the_whole_answers(server, n):
    """`logprobs: k` with `stream: true` was a 400: tokens, token_logprobs, top_logprobs and
    text_offset of the chunks, joined, are the whole answer's (offsets go on across chunks).
    The embedded model's tokens are bytes: most characters here are split across tokens."""
    body = dict(model=MODEL, prompt="é ü ж 😀", max_tokens=12, n=n, temperature=1.0, seed=5, logprobs=3,
                logit_bias={str(b): 3 for b in "é😀".encode()})
    chunks, whole = stream_and_whole(server.client(), False, **body)
    streamed = joined(chunks)
    check_against_whole(streamed, whole, logprobs=True)
    assert any(t == "\ufffd" for c in whole.choices for t in c.logprobs.tokens), "no character split across tokens"
    assert any(ch.choices[0].logprobs.tokens and not ch.choices[0].text for ch in chunks), \
        "a chunk whose tokens end inside a character carries their logprobs and no text yet"


def test_completions_stream_logprobs_0_carries_each_tokens_own(server):
    """`logprobs: 0` (no alternatives) streamed: each token's own log-probability, empty
    top_logprobs, not `logprobs: null`."""
    body = dict(model=MODEL, prompt="zero", max_tokens=5, temperature=0, logprobs=0)
    chunks, whole = stream_and_whole(server.client(), False, **body)
    streamed = joined(chunks)
    check_against_whole(streamed, whole, logprobs=True)
    assert len(streamed[0]["logprobs"]["token_logprobs"]) == 5 and streamed[0]["logprobs"]["top_logprobs"] == [{}] * 5


@pytest.mark.parametrize("n", [1, 3])
def test_chat_stream_logprobs_join_to_the_whole_answers_with_token_bytes(llama, n):
    """chat `logprobs: true` + `top_logprobs` streamed: each chunk's `logprobs.content`
    entries (token, logprob, bytes, top_logprobs), joined, are the whole answer's; a
    character split across tokens has each token's own bytes, which join to the text."""
    tok = llama.engine.tokenizer
    split = [t for t in range(4096) if (b := tok.token_bytes(t)) is not None and len(b) == 1 and b[0] >= 0x80]
    body = dict(model=LLAMA, messages=[{"role": "user", "content": "naïve café"}], max_tokens=10, n=n,
                temperature=1.0, seed=8, logprobs=True, top_logprobs=2, logit_bias={str(t): 12 for t in split})
    chunks, whole = stream_and_whole(llama.client(), True, **body)
    streamed = joined(chunks, chat=True)
    check_against_whole(streamed, whole, chat=True, logprobs=True)
    for c in whole.choices:
        raw = bytes(b for e in c.logprobs.content for b in e.bytes)
        assert raw.decode("utf-8", errors="replace") == c.message.content
        assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
    assert any(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for c in whole.choices for e in c.logprobs.content)


def test_stop_string_and_logprobs_streamed_keep_the_stopping_tokens_entry(server):
    """A stop string ends the text before it, but the token that completed it was drawn and
    its entry is in the whole answer's logprobs: the stream carries the same entries."""
    body = dict(model=MODEL, prompt="x", max_tokens=30, n=2, temperature=1.0, seed=6, stop=["ab"], logprobs=1,
                logit_bias={"97": 8, "98": 8})
    chunks, whole = stream_and_whole(server.client(), False, **body)
    check_against_whole(joined(chunks), whole, logprobs=True)
    assert all(c.finish_reason == "stop" and len(c.logprobs.tokens) == len(c.token_ids) for c in whole.choices)


# ---- under load, and what stays refused -------------------------------------------------------

def test_many_concurrent_streams_of_n_with_logprobs_are_each_their_whole_answer(server):
    """24 streams at once (n 1..3, logprobs on every other one), joined: the tokens and text
    of the whole answer for the same seed, asked alone afterwards; every block freed."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    bodies = [dict(model=MODEL, prompt=f"load {i} " * (1 + i % 3), max_tokens=3 + i % 7, n=1 + i % 3,
                   temperature=0.8, seed=100 + i, **({"logprobs": 2} if i % 2 else {})) for i in range(24)]

    async def one(body):
        return joined([ch async for ch in await client.completions.create(stream=True, **body)])

    async def everyone():
        return await asyncio.gather(*(one(b) for b in bodies))

    results = asyncio.run(asyncio.wait_for(everyone(), 300))
    for body, streamed in zip(bodies, results):
        whole = server.client().completions.create(**body)
        assert [streamed[c.index]["token_ids"] for c in whole.choices] == [c.token_ids for c in whole.choices]
        assert [streamed[c.index]["text"] for c in whole.choices] == [c.text for c in whole.choices]
        if "logprobs" in body:  # values to float32 rounding: the stream ran in other batches
            for c in whole.choices:
                got = streamed[c.index]["logprobs"]
                assert got["tokens"] == c.logprobs.tokens and got["text_offset"] == c.logprobs.text_offset
                assert got["token_logprobs"] == pytest.approx(c.logprobs.token_logprobs, abs=1e-5)
    wait_for(server.idle_and_leak_free, 30, "no KV block leaked")


@pytest.mark.parametrize("extra, param", [({"best_of": 3}, "best_of"), ({"echo": True}, "echo"),
                                          ({"suffix": "x"}, "suffix")])
def test_echo_best_of_and_suffix_stay_refused_in_a_stream_of_n(server, extra, param):
    """n > 1 with stream no longer answers 400 naming `n`: what is refused is named itself."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2, "stream": True, "logprobs": 1, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_raw_stream_of_n_is_server_sent_events_ending_in_done(server):
    body = {"model": MODEL, "prompt": "raw", "max_tokens": 3, "n": 2, "stream": True, "logprobs": 1,
            "temperature": 1, "seed": 1}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, r.read()
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]
    assert all(len(c["choices"][0]["logprobs"]["tokens"]) == len(c["choices"][0]["token_ids"]) for c in chunks)


def post_leaving(server, body: dict, timeout: float) -> None:
    """POST `body`, leaving when no answer came in `timeout` seconds."""
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=timeout)


def test_a_running_n_request_no_longer_counts_as_waiting(server):
    """A non-streamed n > 1 request handed out nothing until all n had finished, so it counted
    as waiting (queue_depth, --max-waiting) the whole time it ran: with --max-waiting 1, one
    running `n: 2` request had every other request refused with 429. Its completions'
    deltas now come at every step."""
    body = {"model": MODEL, "prompt": "running", "max_tokens": 200, "n": 2, "temperature": 1.0, "seed": 1}
    server.thread.max_waiting = 1
    try:
        with slowed(server, 0.05):  # the runner leaves after 4 s (10 s of decoding): aborted then
            runner = threading.Thread(target=post_leaving, args=(server, body, 4), daemon=True)
            runner.start()
            wait_for(lambda: len(server.engine.scheduler.running) == 2, 3, "both completions running")
            wait_for(lambda: server.thread.queued == 0, 1, "the running request to leave the queue")
            assert server.metrics()["trtgraph_queue_depth[]"] == 0
            other = server.client().completions.create(model=MODEL, prompt="next", max_tokens=2, temperature=0)
            assert other.choices[0].finish_reason == "length" and len(server.engine.scheduler.running) == 2
            runner.join(10)
    finally:
        server.thread.max_waiting = 64
    wait_for(server.idle_and_leak_free, 10, "the runner's request aborted")


def test_a_stream_of_n_aborted_by_the_server_ends_with_an_error_event_and_done(server):
    """The server stopping (SIGTERM's drain: abort_all) mid-stream of n > 1: the deltas
    already made, then OpenAI's error object, then [DONE]; every completion's blocks freed."""
    body = {"model": MODEL, "prompt": "stopping", "max_tokens": 200, "n": 3, "stream": True, "temperature": 1,
            "seed": 2}
    with slowed(server, 0.05), httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                                            headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = (line for line in r.iter_lines() if line)
        seen = set()
        while seen != {0, 1, 2}:
            seen.add(json.loads(next(lines)[6:])["choices"][0]["index"])
        server.thread.abort_all("the server is shutting down")
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "aborted"
    assert all("choices" in json.loads(e[6:]) for e in rest[:-2])
    wait_for(server.idle_and_leak_free, 10, "every completion aborted")
