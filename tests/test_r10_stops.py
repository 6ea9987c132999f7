"""Stop strings end a request at the token that completes the stop, whatever the step drew:
a verify step that accepts several tokens at once gives exactly plain decoding's tokens,
text and finish reason (README: speculation only changes how many steps they take)."""

from __future__ import annotations

import pytest

from conftest import tiny_config

PROMPTS = ["one two three four " * 5, "abcabcabcabcabcabc", "[1, 2, 3, 1, 2, 3, 1, 2, 3", "the cat sat on the mat. " * 4]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, one_torch_thread):
    from trtgraph.compiler.pipeline import capture
    from trtgraph.runtime.serving.engine import Engine

    out = tmp_path_factory.mktemp("spec-stops")
    capture(tiny_config(speculative={"draft_len": 3, "ngram_min": 1, "ngram_max": 3}, kv_cache={"num_blocks": 30}), out)
    return Engine(out), Engine(out, speculative=False)


def _one(engine, req):
    return list(engine.generate([req]))[0]


def _stops(text: str) -> list[str]:
    """Stop strings cut from the plain output: 1-3 characters at a few places."""
    return sorted({text[a:a + n] for a in range(1, min(len(text), 30), 3) for n in (1, 2, 3)
                   if text[a:a + n] and "\ufffd" not in text[a:a + n]})


def test_a_stop_string_inside_an_accepted_run_gives_plain_decodings_tokens(engines):
    spec, plain = engines
    cases = accepting = 0
    for i, prompt in enumerate(PROMPTS):
        for temperature in (0.0, 0.8):
            base = {"id": "x", "prompt": prompt, "max_tokens": 40, "temperature": temperature, "seed": i}
            full = _one(plain, base)
            for stop in _stops(full.text):
                req = {**base, "stop": [stop]}
                got, want = _one(spec, req), _one(plain, req)
                assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), \
                    (prompt, temperature, stop)
                assert got.to_json()["usage"]["completion_tokens"] == len(want.token_ids)
                cases += want.finish_reason == "stop"
                accepting += spec.stats.to_json()["speculative"]["acceptance_rate"] > 0
    assert cases > 20
    assert accepting >= 3  # runs of several tokens were accepted


def test_a_stop_string_completed_before_min_tokens_does_not_count(engines):
    """min_tokens: no stop applies before that many tokens (README), so a stop string the
    first min_tokens - 1 tokens hold is not one; one completed later stops the request. The
    text is never cut inside the first min_tokens - 1 tokens' text, and streamed deltas add
    up to it."""
    spec, plain = engines
    decode = plain.tokenizer.decode
    checked = 0
    for i, prompt in enumerate(PROMPTS):
        base = {"id": "x", "prompt": prompt, "max_tokens": 30, "temperature": 0.8, "seed": i}
        full = _one(plain, base).token_ids
        for m in (4, 8, 12):
            head = decode(full[:m - 1])
            for stop in sorted({head[a:a + n] for a in range(len(head)) for n in (1, 2)} - {""}):
                if "\ufffd" in stop:
                    continue
                req = {**base, "stop": [stop], "min_tokens": m}
                want_len = next((t for t in range(m, len(full) + 1)
                                 if decode(full[:t]).find(stop, max(len(head) - len(stop) + 1, 0)) >= 0), len(full))
                for engine in (plain, spec):
                    got = _one(engine, req)
                    assert got.token_ids == full[:want_len], (prompt, m, stop)
                    text = decode(got.token_ids)
                    assert got.text.startswith(head) and text.startswith(got.text), (prompt, m, stop)
                    if want_len < len(full):
                        assert got.finish_reason == "stop"
                    deltas = list(engine.outputs_of(engine.submit([{**req, "id": "s"}])))
                    assert "".join(d.text for d in deltas) == got.text
                checked += 1
    assert checked > 20


def test_stop_strings_are_bounded_in_number_and_length():
    """Every stop string is looked for in the text at every step (and, streamed, each of its
    prefixes): a request of thousands of long ones (6 MB, under the server's body limit) made
    every step of every request on the engine ~15x slower. Refused naming the field."""
    from trtgraph.errors import PromptError
    from trtgraph.runtime.serving.requests import parse_request
    from trtgraph.runtime.serving.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    ok = parse_request({"id": 1, "prompt": "x", "stop": ["s"] * MAX_STOP_STRINGS + [7] * 16}, "p.jsonl line 1")
    assert len(ok.stop_strings) == MAX_STOP_STRINGS
    parse_request({"id": 1, "prompt": "x", "stop": "é" * MAX_STOP_STRING_CHARS}, "p.jsonl line 1")
    for stop in (["s"] * (MAX_STOP_STRINGS + 1), "é" * (MAX_STOP_STRING_CHARS + 1), ["a", "b" * 5000]):
        with pytest.raises(PromptError, match=r"p.jsonl line 1: field `stop` .* at most 16 stop strings of at most 1024"):
            parse_request({"id": 1, "prompt": "x", "stop": stop}, "p.jsonl line 1")
