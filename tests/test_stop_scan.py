"""The incremental stop-string search (streaming.StopScan, deliveries._stop_string): the same
verdict as decoding the whole output at every step, for the shipped checkpoint's byte-level BPE
and the byte tokenizer, and a step's cost that does not grow with the output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from trtgraph.models.tokenizer import ByteTokenizer, HFTokenizer
from trtgraph.runtime.serving.streaming import TextStream

ASSET = Path(__file__).resolve().parents[1] / "trtgraph" / "assets" / "stdlib-llama" / "tokenizer.json"
TEXTS = ["def f(x):\n    return x + 1  # é, ü, 日本語, 🙂\n" * 6,
         "class A:\n    pass\n\nprint('stop here')  -> ünïcödé\n" * 5]


def _tokenizers():
    return [("bytes", ByteTokenizer(512, None)), ("stdlib", HFTokenizer(ASSET))]


def _first_hit_full(tok, ids, stops, floor):
    """The first output length whose full decode holds a stop ending past `floor` characters."""
    stream = TextStream(tok, stops)
    for t in range(1, len(ids) + 1):
        if stream.stop_text(ids[:t], floor)[1]:
            return t
    return None


def _first_hit_scan(tok, ids, stops, floor, chunk):
    """The same by the incremental search, `chunk` tokens a step (a verify step draws several)."""
    scan = TextStream(tok, stops).scan()
    for t in range(chunk, len(ids) + chunk, chunk):
        if scan.hit(ids[:t], floor):
            return min(t, len(ids))
    return None


@pytest.mark.parametrize("name,tok", _tokenizers())
def test_the_incremental_search_finds_what_the_full_decode_finds(name, tok):
    rng = random.Random(7)
    checked = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(40):
            a = rng.randrange(len(text) - 4)
            stops = (text[a:a + rng.randint(1, 4)], "never-in-text")
            floor = rng.choice([0, 0, rng.randrange(40)])
            for chunk in (1, 3):
                full = _first_hit_full(tok, ids, stops, floor)
                found = _first_hit_scan(tok, ids, stops, floor, chunk)
                # one step of `chunk` tokens finds the hit made by any of them
                assert (found is None) == (full is None), (name, stops, floor)
                if full is not None:
                    assert found - chunk < full <= found, (name, stops, floor, full, found)
                checked += 1
    assert checked == len(TEXTS) * 40 * 2


def test_a_steps_search_decodes_its_new_tokens_not_the_whole_output():
    tok = HFTokenizer(ASSET)
    decoded = []

    class Counting:
        def decode(self, ids):
            decoded.append(len(ids))
            return tok.decode(ids)

    ids = tok.encode(TEXTS[0] * 20, add_special_tokens=False)  # ~ 4,000 tokens
    scan = TextStream(Counting(), ("\x00",)).scan()
    for t in range(1, len(ids) + 1):
        assert not scan.hit(ids[:t])
    assert len(ids) > 2000
    assert sum(decoded) < 20 * len(ids)  # a full decode a step: len(ids) ** 2 / 2 = 2,000 x len(ids)


def test_an_engines_stop_check_does_not_decode_the_whole_output_every_step(default_artifacts, one_torch_thread):
    from trtgraph.runtime.serving.engine import Engine

    engine = Engine(default_artifacts)
    decode, decoded = engine.tokenizer.decode, []

    def counting(ids, *args, **kwargs):
        decoded.append(len(ids))
        return decode(ids, *args, **kwargs)

    engine.tokenizer.decode = counting
    req = {"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 200, "ignore_eos": True,
           "temperature": 0, "stop": ["\x00never\x00"]}
    result = list(engine.generate([req]))[0]
    out = len(result.token_ids)
    assert out >= 150 and result.finish_reason == "length"
    # a full decode at every step: out * (out + 1) / 2 ids (100 a token here); the incremental search a window a
    # step (random bytes: windows held open by incomplete characters), plus the finished sequence's full decodes
    # (the check's and the Result's)
    assert sum(decoded) < 30 * out, (sum(decoded), out)


def _first_stop(tok, ids, stops):
    """Where deliveries._stop_string ends the output, fed one token a step (None: never)."""
    from types import SimpleNamespace

    from trtgraph.runtime.serving.deliveries import _stop_string

    stream = TextStream(tok, stops)
    seq = SimpleNamespace(prompt_ids=[], all_ids=[], facts=SimpleNamespace(min_tokens=0), stop_floor=None,
                          stop_scan=None, stop_checked=0)
    for token in ids:
        seq.all_ids.append(token)
        seq.output_ids = list(seq.all_ids)
        found = _stop_string(seq, stream)
        if found is not None:
            return found[1]
    return None


def test_the_output_ends_where_the_full_decode_finds_a_stop_also_among_cut_characters():
    """Through deliveries._stop_string, one token a step, on bytes that cut and complete
    characters (a window's decode marks undecodable bytes U+FFFD as the full decode does; a
    review's suspicion, checked over 20,000 byte and 3,000 BPE cases: none differed), stop strings
    holding U+FFFD too: the output ends at the token a full decode at every step ends it."""
    tok = ByteTokenizer(512, None)
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(0x80, 0x100), rng.randrange(0x20, 0x7f), rng.randrange(0xc0, 0xf8)])
               for _ in range(40)]  # ASCII, continuation bytes and lead bytes: characters cut and completed
        for stops in (("\ufffd\ufffd",), ("\ufffd",), ("a\ufffd", "zz"), ("ab",)):
            assert _first_stop(tok, ids, stops) == _first_hit_full(tok, ids, stops, 0), stops
