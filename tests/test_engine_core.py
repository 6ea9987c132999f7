"""The incremental engine core (trtgraph/runtime/serving/engine.py: add_request / abort / step) and
its streamed outputs (trtgraph/runtime/serving/streaming.py).

Requests that arrive between steps, while others decode, get exactly the tokens they get
alone (greedy and seeded sampled, checked against the eager oracle); token and text deltas
add up to the final Result; an abort frees the sequence's KV blocks at the next step; text
deltas never split a UTF-8 character or show the start of a stop string.
"""

from __future__ import annotations

import pytest

from trtgraph.errors import PromptError
from trtgraph.models.tokenizer import ByteTokenizer
import oracle
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.serving.streaming import TextStream, stop_prefix_length

REQS = [
    {"id": "g-long", "prompt": "an early arrival that decodes for a while", "max_tokens": 30},
    {"id": "s-mid", "prompt_token_ids": [(7 * j) % 300 for j in range(40)], "max_tokens": 12,
     "temperature": 0.9, "top_k": 40, "seed": 11},
    {"id": "g-short", "prompt": "late", "max_tokens": 5},
    {"id": "s-late", "prompt": "¿qué tal? naïve café", "max_tokens": 9, "temperature": 1.2, "top_p": 0.9,
     "seed": 3},
]


def oracle_of(engine: Engine, req: dict) -> list[int]:
    ids = list(req["prompt_token_ids"]) if "prompt_token_ids" in req else engine.tokenizer.encode(req["prompt"])
    return oracle.generate(engine.executor.loaded, ids, req["max_tokens"], temperature=req.get("temperature", 0.0),
                           top_k=req.get("top_k", 0), top_p=req.get("top_p", 1.0), seed=req.get("seed", 0))


@pytest.fixture(scope="module")
def engine(default_artifacts, one_torch_thread):
    return Engine(default_artifacts)


def drain(engine: Engine, outputs: dict, max_steps: int = 2000) -> None:
    """Step until idle, appending every output to outputs[id]."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        for out in engine.step():
            outputs.setdefault(out.id, []).append(out)
    raise AssertionError("the engine did not go idle")


def test_requests_arriving_between_steps_get_their_tokens_alone(engine):
    outputs: dict = {}
    engine.add_request(REQS[0])
    for _ in range(4):
        for out in engine.step():
            outputs.setdefault(out.id, []).append(out)
    assert outputs["g-long"] and not outputs["g-long"][-1].finished  # decoding when the others arrive
    engine.add_request(REQS[1])
    for out in engine.step():
        outputs.setdefault(out.id, []).append(out)
    engine.add_request(REQS[2])
    engine.add_request(REQS[3])
    drain(engine, outputs)
    for req in REQS:
        outs = outputs[req["id"]]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], req["id"]
        result = outs[-1].result
        assert result.token_ids == oracle_of(engine, req), req["id"]
        assert sum((o.token_ids for o in outs), []) == result.token_ids
        assert "".join(o.text for o in outs) == result.text
        assert outs[-1].finish_reason == result.finish_reason == "length"
    assert engine.scheduler.allocator.num_free == engine.executor.num_blocks - 1
    assert not engine.has_unfinished()


def test_each_step_streams_each_drawing_request_and_the_overlap_survives_step_calls(engine):
    engine.add_request({"id": "a", "prompt": "stream me", "max_tokens": 20})
    engine.add_request({"id": "b", "prompt": "and me", "max_tokens": 20})
    fast_before, steps_before = engine.stats.fast_path_steps, engine.stats.steps
    per_step = []
    while engine.has_unfinished():
        per_step.append({o.id: o.token_ids for o in engine.step()})
    decoding = [s for s in per_step if s]
    assert all(len(toks) == 1 for s in decoding[1:] for toks in s.values())  # one token per decode step
    assert sum(len(s.get("a", [])) for s in per_step) == 20
    assert engine.stats.fast_path_steps - fast_before >= 15  # steady decoding replays on the fast path
    assert engine.stats.steps - steps_before >= 20


def test_abort_frees_blocks_at_the_next_step_and_nothing_more_comes(engine):
    full = engine.executor.num_blocks - 1
    engine.add_request({"id": "keep", "prompt": "keep going", "max_tokens": 25})
    engine.add_request({"id": "drop", "prompt_token_ids": list(range(1, 100)), "max_tokens": 60})
    for _ in range(6):
        engine.step()
    seq = next(s for s in engine.scheduler.running if s.request.id == "drop")
    assert seq.block_table and engine.scheduler.allocator.num_free < full
    assert engine.abort("drop") and not engine.abort("no-such-request")
    held = len(seq.block_table)
    free_before = engine.scheduler.allocator.num_free
    first = engine.step()
    assert all(o.id != "drop" for o in first)
    assert seq.finished and seq not in engine.scheduler.running and seq.block_table == []
    assert engine.scheduler.allocator.num_free >= free_before + held - 2  # "keep" may take a block
    rest: dict = {}
    drain(engine, rest)
    assert set(rest) <= {"keep"} and rest["keep"][-1].finished
    assert engine.scheduler.allocator.num_free == full
    # An aborted request that was still waiting leaves the queue; its id is free again.
    engine.add_request({"id": "drop", "prompt": "x", "max_tokens": 3})
    assert engine.abort("drop")
    engine.step()
    assert not engine.scheduler.waiting and not engine.has_unfinished()
    assert engine.stats.aborted >= 2


def test_duplicate_ids_among_live_requests_are_refused_until_they_finish(engine):
    engine.add_request({"id": "dup", "prompt": "one", "max_tokens": 4})
    with pytest.raises(PromptError, match="duplicate id 'dup'.*still being served"):
        engine.add_request({"id": "dup", "prompt": "two", "max_tokens": 4})
    with pytest.raises(PromptError, match="duplicate id 'dup'"):
        list(engine.generate([{"id": "dup", "prompt": "two", "max_tokens": 4}]))
    outputs: dict = {}
    drain(engine, outputs)
    assert outputs["dup"][-1].result.token_ids == oracle_of(engine, {"prompt": "one", "max_tokens": 4})
    engine.add_request({"id": "dup", "prompt": "two", "max_tokens": 4})  # finished: the id is free
    drain(engine, outputs)


def test_refusals_come_from_the_next_step_as_error_results(engine):
    engine.add_request({"id": "too-long", "prompt_token_ids": [5] * 250, "max_tokens": 50})
    assert engine.has_unfinished()
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "error" and "max_seq_len" in out.result.error
    assert not engine.has_unfinished()


def test_generate_leaves_outputs_of_other_live_requests_for_their_consumer(engine):
    engine.add_request({"id": "other", "prompt": "someone else's", "max_tokens": 15})
    mine = list(engine.generate([{"id": "mine", "prompt": "mine", "max_tokens": 3}]))
    assert [r.id for r in mine] == ["mine"]
    outputs: dict = {}
    drain(engine, outputs)
    outs = outputs["other"]
    assert outs[-1].finished and sum((o.token_ids for o in outs), []) == outs[-1].result.token_ids
    assert outs[-1].result.token_ids == oracle_of(engine, {"prompt": "someone else's", "max_tokens": 15})


# ---- text deltas ------------------------------------------------------------------------------

def test_text_deltas_never_split_a_utf8_character():
    tok = ByteTokenizer(320)
    text = "naïve café — 日本語 ✓ 🙂 ok"
    ids = list(text.encode("utf-8"))
    stream, deltas, out = TextStream(tok), [], []
    for b in ids:
        out += [b, 300] if b % 3 == 0 else [b]  # 300 decodes to nothing, a special token
        deltas.append(stream.feed(out))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert deltas[ids.index(0xE6)] == ""  # the first byte of 日 alone shows nothing
    assert stream.finish(text) == ""


def test_text_deltas_hold_back_a_possible_stop_string():
    tok = ByteTokenizer(320)
    stream = TextStream(tok, ("STOP", "<end>"))
    shown = ""
    text = "abc ST <e xSTO <enx STOP tail"
    ids = list(text.encode())
    for n in range(1, len(ids) + 1):
        shown += stream.feed(ids[:n])
        assert "STOP" not in shown
        assert not shown.endswith(("S", "ST", "STO", "<", "<e", "<en", "<end"))
        if text[:n].endswith("STOP"):
            break
    assert shown == "abc ST <e xSTO <enx "
    assert shown + stream.finish("abc ST <e xSTO <enx ") == "abc ST <e xSTO <enx "
    assert stop_prefix_length("xx<en", ("<end>", "n")) == 3


def test_streamed_text_with_a_stop_string_adds_up_to_the_result(engine):
    base = {"prompt": "stop strings while streaming", "max_tokens": 40}
    plain = oracle_of(engine, base)
    text = engine.tokenizer.decode(plain)
    stop = next(text[j:j + 2] for j in range(4, len(text) - 2) if text[j:j + 2].isprintable()
                and text[j:j + 2] not in text[:j + 1])
    engine.add_request({**base, "id": "stopper", "stop": [stop]})
    outputs: dict = {}
    drain(engine, outputs)
    outs = outputs["stopper"]
    result = outs[-1].result
    assert result.finish_reason == "stop" and result.text == text[:text.index(stop)]
    shown = ""
    for o in outs:
        shown += o.text
        assert stop not in shown
    assert shown == result.text


def test_admission_in_slices_changes_no_step(default_artifacts, one_torch_thread, monkeypatch):
    """Submitted requests are admitted in slices while steps run (Engine._admit_slice) and topped
    up before every scheduler decision: every step (key and rows) and every token equal those of
    an engine that admits everything at the first step; a refusal late in the batch still comes
    back as an error Result, a request aborted before its admission never runs and is counted,
    and a request added with add_request while others wait for admission joins after them."""
    rows = Engine(default_artifacts).scheduler.plan.max_batch_size
    reqs = [{"id": f"a{i}", "prompt_token_ids": [(3 * i + j) % 300 + 2 for j in range(5 + i % 7)],
             "max_tokens": 3 + i % 5, "temperature": 0.8 if i % 3 else 0.0, "seed": i} for i in range(3 * rows)]
    reqs[2 * rows + 1] = {"id": "too-long", "prompt_token_ids": [5] * 300, "max_tokens": 4}

    def serve(admit_all: bool):
        engine = Engine(default_artifacts)
        if admit_all:
            monkeypatch.setattr(engine, "_admit_slice", lambda: engine._admit_pending(len(engine._pending)))
        steps, launch = [], engine.launcher.launch
        monkeypatch.setattr(engine.launcher, "launch", lambda step, stats: (
            steps.append((step.key, [s.request.id for s in step.seqs])), launch(step, stats))[1])
        engine.submit(reqs)
        assert len(engine._pending) == 2 * rows  # the first step's rows admitted, the rest wait
        engine.abort(f"a{3 * rows - 1}")  # not admitted yet
        engine.add_request({"id": "late", "prompt_token_ids": [7, 8, 9], "max_tokens": 2})
        outputs = {}
        drain(engine, outputs)
        news = {rid: [(o.token_ids, o.text, o.finished, o.finish_reason) for o in outs] for rid, outs in outputs.items()}
        return steps, news, engine.stats, outputs

    sliced, whole = serve(False), serve(True)
    assert sliced[0] == whole[0], "a step differs"
    assert sliced[1] == whole[1]
    out = sliced[3]
    assert out["too-long"][-1].finish_reason == "error" and "max_seq_len" in out["too-long"][-1].result.error
    assert f"a{3 * rows - 1}" not in out and out["late"][-1].finished
    assert sliced[2].requests == whole[2].requests == 3 * rows + 1
    assert sliced[2].aborted == 1 and sliced[2].refused == 1
    first_step = {rid: next(i for i, (_, ids) in enumerate(sliced[0]) if rid in ids) for rid in ("late", f"a{3 * rows - 2}")}
    assert first_step["late"] >= first_step[f"a{3 * rows - 2}"]
