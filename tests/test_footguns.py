"""Footguns of replayed graphs, in the spirit of tinygrad's test_jit_footguns.py.

A recorded graph replays whatever its buffers hold at the addresses it recorded; nothing
re-reads Python state. Each test below names one way that goes silently wrong and shows
trtgraph either refuses it (ReplayMismatchError / CaptureError) or makes it impossible
(inputs live in persistent buffers, every padding row is rewritten, noise is per row).

The static (CPU) backend stands in for CUDA graphs: it keeps the same replay checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trtgraph.buckets import GREEDY, SAMPLED, BucketPlan, GraphKey
from trtgraph.errors import CaptureError, ReplayMismatchError
import oracle
from trtgraph.kernels import sampler_reference as sampler
from trtgraph.runtime.step.buffers import FIELDS
from trtgraph.runtime.step.executor import Executor, StepRow
from trtgraph.runtime.step.kv_cache import NULL_BLOCK
from trtgraph.runtime.step.metadata import AttentionMetadata

from conftest import tiny_config

CPU = torch.device("cpu")
DECODE = GraphKey(4, 0, 0, SAMPLED)
PREFILL = GraphKey(4, 0, 16, SAMPLED)
# Every packed field a graph reads: (name, int64 or fp32 group, the limit that sizes it).
INTS = {name for name, group, _ in FIELDS if group == "ints"}


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def loaded(cfg):
    """One model for the executors that do not touch the model itself (weights are read-only)."""
    with torch.inference_mode():
        return Executor.build(cfg, BucketPlan.from_config(cfg), CPU).loaded


def make_executor(cfg, *keys, loaded=None) -> Executor:
    """A fresh executor with `keys` warmed up and captured (not locked)."""
    ex = Executor.build(cfg, BucketPlan.from_config(cfg), CPU, loaded=loaded)
    for key in keys:
        ex.warmup(key)
        ex.capture(key)
    return ex


def positions_of(ex: Executor, key: GraphKey) -> torch.Tensor:
    return ex.buffers.dev.positions[:key.num_tokens]


def replay(ex: Executor, key: GraphKey):
    return ex.runner.replay(key, ex.metadata[key], key.num_tokens, positions_of(ex, key))


def extent(ex: Executor, key: GraphKey, name: str) -> torch.Tensor:
    """The part of a device buffer field that `key`'s graph reads."""
    size = {n: size for n, _, size in FIELDS}[name]
    n = {"tokens": key.num_tokens, "seqs": key.batch_size, "table": key.batch_size, "rows": key.num_logit_rows,
         "control": None}[size]  # control: the whole field (the mode and the real rows)
    return getattr(ex.buffers.dev, name)[:n]


def run(ex: Executor, key: GraphKey, rows: list[StepRow], eager: bool = False):
    """prepare + execute; clones of (all logits, all tokens) of the key."""
    ex.prepare(key, rows)
    out = ex.execute(key, eager=eager)
    return ex.logits(out).clone(), out.tokens.clone()


def rows_on_blocks(key: GraphKey, n: int, first_block: int, seed: int, sampled: bool = True) -> list[StepRow]:
    """`n` valid rows whose blocks are first_block, first_block+1, ...: disjoint from other calls."""
    gen = torch.Generator().manual_seed(seed)
    q, rows, block = key.q_len, [], first_block
    for i in range(n):
        start = int(torch.randint(0, 40, (1,), generator=gen))
        length = q if (not key.is_prefill or i % 2 == 0) else int(torch.randint(1, q, (1,), generator=gen))
        nblocks = (start + length + 15) // 16
        rows.append(StepRow(token_ids=torch.randint(0, 320, (length,), generator=gen).tolist(), start_pos=start,
                            block_table=list(range(block, block + nblocks)),
                            temperature=(1.5 if i % 2 == 0 else 0.0) if sampled else 0.0,
                            top_k=[0, 5, 50, 0][i % 4], top_p=[1.0, 0.9, 1.0, 0.5][i % 4], seed=1000 + 7 * i + seed))
        block += nblocks
    return rows


# ---- a shorter input leaves the tail of the static buffers stale ---------------------------

def test_fewer_tokens_than_the_key_is_refused(cfg, loaded):
    """Footgun: replaying with fewer tokens than recorded leaves the buffer tail stale."""
    ex = make_executor(cfg, DECODE, loaded=loaded)
    ex.prepare(DECODE, [])
    with pytest.raises(ReplayMismatchError, match="stale") as err:
        ex.runner.replay(DECODE, ex.metadata[DECODE], num_tokens=DECODE.num_tokens - 1,
                         positions=positions_of(ex, DECODE))
    assert f"expected={DECODE.num_tokens}" in str(err.value)
    with pytest.raises(ReplayMismatchError, match="stale"):
        ex.runner.replay(DECODE, ex.metadata[DECODE], num_tokens=DECODE.num_tokens + 1,
                         positions=positions_of(ex, DECODE))
    assert ex.runner.replays[DECODE] == 0
    replay(ex, DECODE)  # the exact count replays
    assert ex.runner.replays[DECODE] == 1


@pytest.mark.parametrize("key,num_real", [(GraphKey(8, 0, 0, SAMPLED), 3), (GraphKey(4, 0, 16, SAMPLED), 2),
                                          (GraphKey(4, 0, 64, GREEDY), 1), (GraphKey(2, 0, 0, GREEDY), 0)])
def test_prepare_rewrites_every_padding_row(cfg, loaded, key, num_real):
    """Footgun: a batch smaller than its key silently reuses whatever the last step left in the padding rows."""
    ex = Executor.build(cfg, BucketPlan.from_config(cfg), CPU, loaded=loaded)
    b, q, bs = ex.buffers, key.q_len, ex.block_size
    for t in (b.ints, b.ints_host):
        t.fill_(999)  # slot 999 is in block 62: a real block, if anything kept it
    for t in (b.floats, b.floats_host):
        t.fill_(7.5)
    rows = rows_on_blocks(key, num_real, first_block=1, seed=num_real)
    ex.prepare(key, rows)

    ids, pos, slots = (extent(ex, key, n) for n in ("input_ids", "positions", "slot_mapping"))
    tables, last = extent(ex, key, "block_tables"), extent(ex, key, "logits_indices")
    temp, top_k, top_p, seeds = (extent(ex, key, n) for n in ("temperature", "top_k", "top_p", "seeds"))

    real_tokens = set()
    for i, row in enumerate(rows):
        n, s = len(row.token_ids), i * q
        real_tokens.update(range(s, s + n))
        assert ids[s:s + n].tolist() == row.token_ids
        assert pos[s:s + n].tolist() == list(range(row.start_pos, row.start_pos + n))
        table = row.block_table
        assert tables[i, :len(table)].tolist() == table
        assert (tables[i, len(table):] == NULL_BLOCK).all(), "a real row's unused block-table entries are stale"
        assert last[i] == s + n - 1
        if n < q:  # a prefill chunk's tail: token 0, the last real position, a slot in the null block
            assert (ids[s + n:s + q] == 0).all()
            assert (pos[s + n:s + q] == row.start_pos + n - 1).all()
            assert (slots[s + n:s + q] // bs == NULL_BLOCK).all()
    pad_tokens = torch.tensor(sorted(set(range(key.num_tokens)) - real_tokens), dtype=torch.long)
    pad_rows = list(range(num_real, key.batch_size))
    assert len(pad_tokens) >= (key.batch_size - num_real) * q

    assert (ids[pad_tokens] == 0).all()
    assert (pos[pad_tokens[pad_tokens >= num_real * q]] == 0).all()
    assert ((slots[pad_tokens] >= 0) & (slots[pad_tokens] // bs == NULL_BLOCK)).all(), \
        "a padding token writes outside the null block"
    assert (tables[pad_rows] == NULL_BLOCK).all()
    assert last[pad_rows].tolist() == [i * q for i in pad_rows]
    pad_logit_rows = pad_rows if key.is_prefill else list(range(num_real * q, key.num_tokens))
    assert (temp[pad_logit_rows] == 0).all(), "a padding row samples with a stale temperature"
    assert (top_k[pad_logit_rows] == 0).all() and (top_p[pad_logit_rows] == 1).all()
    assert (seeds[pad_logit_rows] == 0).all()
    # Nothing the key reads is left at the poison value.
    for name, _, _ in FIELDS:
        assert not (extent(ex, key, name) == (999 if name in INTS else 7.5)).any(), name


# ---- copy_ broadcasts a mis-shaped tensor ----------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (DECODE.num_tokens, 1), (DECODE.num_tokens + 1,), (DECODE.num_tokens - 1,)])
def test_mis_shaped_positions_are_refused(cfg, loaded, shape):
    """Footgun: copy_ broadcasts a [1] or [T, 1] tensor into a [T] buffer without a word."""
    ex = make_executor(cfg, DECODE, loaded=loaded)
    ex.prepare(DECODE, [])
    with pytest.raises(ReplayMismatchError, match="shape") as err:
        ex.runner.replay(DECODE, ex.metadata[DECODE], DECODE.num_tokens, torch.zeros(shape, dtype=torch.long))
    assert str(tuple(shape)) in str(err.value) and "broadcast" in str(err.value)
    assert ex.runner.replays[DECODE] == 0


# ---- a Python value baked in at capture ------------------------------------------------------

def test_sampling_settings_are_read_from_buffers_at_every_replay(cfg, loaded):
    """Footgun: temperature / top-k / seed passed as Python values are frozen into the graph at capture."""
    ex = make_executor(cfg, DECODE, loaded=loaded)
    base = rows_on_blocks(DECODE, DECODE.batch_size, first_block=1, seed=3)

    def with_settings(**s):
        return [dataclasses.replace(r, **s) for r in base]

    def replay_and_eager(rows):
        logits, tokens = run(ex, DECODE, rows)
        eager_logits, eager_tokens = run(ex, DECODE, rows, eager=True)
        assert torch.equal(logits, eager_logits) and torch.equal(tokens, eager_tokens), "replay != eager"
        return logits, tokens

    # temperature 0 in every row: the argmax of the logits
    logits, tokens = replay_and_eager(with_settings(temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    # hot rows: a different seed draws different tokens from the same logits
    hot_a = replay_and_eager(with_settings(temperature=5.0, top_k=0, top_p=1.0, seed=11))
    hot_b = replay_and_eager(with_settings(temperature=5.0, top_k=0, top_p=1.0, seed=12))
    assert torch.equal(hot_a[0], logits) and torch.equal(hot_b[0], logits)
    assert not torch.equal(hot_a[1], hot_b[1]), "the seed was baked in at capture"
    assert not torch.equal(hot_a[1], tokens), "temperature was baked in at capture"
    # the same seed again: the same draw
    assert torch.equal(replay_and_eager(with_settings(temperature=5.0, top_k=0, top_p=1.0, seed=11))[1], hot_a[1])
    # top-k 1 and a tiny top-p each force the argmax however hot
    for s in (dict(top_k=1, top_p=1.0), dict(top_k=0, top_p=1e-6)):
        _, t = replay_and_eager(with_settings(temperature=5.0, seed=11, **s))
        assert torch.equal(t, logits.argmax(-1)), f"{s} was not read at replay"
    # each row its own settings: greedy rows stay greedy next to hot rows
    mixed = [dataclasses.replace(r, temperature=5.0 if i % 2 else 0.0, top_k=0, top_p=1.0, seed=11)
             for i, r in enumerate(base)]
    _, t = replay_and_eager(mixed)
    assert t[0::2].tolist() == logits.argmax(-1)[0::2].tolist()
    assert t[1::2].tolist() == hot_a[1][1::2].tolist()


# ---- a buffer re-allocated after capture -----------------------------------------------------

def _move(ex: Executor, name: str):
    """Replace persistent tensor `name` by a copy at a new address; returns an undo."""
    if name.startswith("kv_cache."):
        i, old = int(name.split(".")[1]), ex.kv_caches[int(name.split(".")[1])]
        ex.kv_caches[i] = old.clone()
        return lambda: ex.kv_caches.__setitem__(i, old)
    owner = ex.model if name == "cos_sin" else ex.buffers
    old = getattr(owner, name)
    setattr(owner, name, old.clone())
    return lambda: setattr(owner, name, old)


@pytest.mark.parametrize("name", ["ints", "floats", "next_tokens", "kv_cache.0", "kv_cache.1", "cos_sin"])
def test_reallocated_buffer_is_refused(cfg, name):
    """Footgun: a buffer re-allocated after capture leaves the graph reading the freed old memory."""
    ex = make_executor(cfg, DECODE)  # its own model: cos_sin belongs to it
    assert name in ex.persistent_tensors()
    ex.prepare(DECODE, rows_on_blocks(DECODE, 2, first_block=1, seed=0))
    expected = replay(ex, DECODE)[0].clone()
    undo = _move(ex, name)
    with pytest.raises(ReplayMismatchError, match="moved since capture") as err:
        ex.execute(DECODE)
    assert f"moved since capture: {name};" in str(err.value), "the message must name only the moved buffer"
    undo()
    assert torch.equal(ex.logits(ex.execute(DECODE)), expected)


def test_a_buffer_moved_and_another_put_in_its_place_is_refused(cfg, loaded):
    """Footgun: two buffers swapped keep the set of addresses but not which name owns which."""
    ex = make_executor(cfg, DECODE, loaded=loaded)
    ex.kv_caches[0], ex.kv_caches[1] = ex.kv_caches[1], ex.kv_caches[0]
    with pytest.raises(ReplayMismatchError, match="kv_cache.0, kv_cache.1"):
        ex.execute(DECODE)


def test_reloaded_weights_are_refused_before_serving(default_artifacts):
    """Footgun: weights re-allocated after capture (a reload, .to(), assign=True) leave the graphs
    reading freed memory; the engine checks every parameter's address before each generate()."""
    from trtgraph.runtime.serving.engine import Engine

    engine = Engine(default_artifacts)
    embed = engine.executor.model.embed_tokens
    old = embed.weight
    embed.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
    with pytest.raises(ReplayMismatchError, match="weights moved since capture: weight.embed_tokens.weight"):
        list(engine.generate([{"id": "a", "prompt": "hi", "max_tokens": 2}]))
    embed.weight = old
    assert len(list(engine.generate([{"id": "a", "prompt": "hi", "max_tokens": 2}]))) == 1


# ---- a replaced metadata object ----------------------------------------------------------------

def test_equal_but_new_metadata_object_is_refused(cfg, loaded):
    """Footgun: a new metadata object with equal contents is silently ignored by the recorded graph."""
    ex = make_executor(cfg, DECODE, loaded=loaded)
    meta = ex.metadata[DECODE]
    twins = [dataclasses.replace(meta),
             AttentionMetadata(q_len=meta.q_len, batch_size=meta.batch_size, slot_mapping=meta.slot_mapping,
                               block_tables=meta.block_tables, kv_caches=meta.kv_caches),
             ex.metadata[GraphKey(8, 0, 0, SAMPLED)]]
    for twin in twins:
        with pytest.raises(ReplayMismatchError, match="different object"):
            ex.runner.replay(DECODE, twin, DECODE.num_tokens, positions_of(ex, DECODE))
    assert ex.runner.replays[DECODE] == 0
    replay(ex, DECODE)
    assert ex.runner.replays[DECODE] == 1


# ---- capture after lock, replay of what was never recorded ---------------------------------------

def test_capture_after_lock_is_refused(cfg, loaded):
    """Footgun: a late capture at serving time records on live data and stalls every other request."""
    other = GraphKey(2, 0, 0, GREEDY)
    ex = make_executor(cfg, DECODE, loaded=loaded)
    with pytest.raises(CaptureError, match="already captured"):
        ex.capture(DECODE)
    ex.runner.lock()
    assert ex.runner.locked
    with pytest.raises(CaptureError, match=r"after lock\(\)"):
        ex.capture(other)
    with pytest.raises(CaptureError, match=r"after lock\(\)"):
        ex.runner.capture(other, ex.step_fn(other), ex.metadata[other])
    assert ex.runner.num_captures == 1
    with pytest.raises(ReplayMismatchError, match="no graph was recorded"):  # the refused capture left nothing
        replay(ex, other)
    replay(ex, DECODE)  # replay is still allowed


def test_replay_of_an_unrecorded_key_is_refused(cfg, loaded):
    """Footgun: replaying a key that was never recorded would run some other graph's shapes."""
    ex = make_executor(cfg, DECODE, loaded=loaded)
    uncaptured = GraphKey(8, 0, 0, SAMPLED)  # in the plan, never captured
    with pytest.raises(ReplayMismatchError, match="no graph was recorded") as err:
        ex.execute(uncaptured)
    assert str(DECODE) in str(err.value), "the message lists the recorded keys"
    off_plan = GraphKey(3, 0, 0, GREEDY)  # not even in the plan
    with pytest.raises(ReplayMismatchError, match="no graph was recorded"):
        ex.runner.replay(off_plan, ex.metadata[DECODE], off_plan.num_tokens, torch.zeros(3, dtype=torch.long))
    empty = Executor.build(cfg, BucketPlan.from_config(cfg), CPU, loaded=loaded)
    with pytest.raises(ReplayMismatchError, match="recorded keys: none"):
        empty.execute(DECODE)


def test_capture_and_warmup_never_touch_real_kv_blocks(cfg, loaded):
    """Footgun: the capture run itself writes K/V; on real blocks it would corrupt live sequences."""
    ex = Executor.build(cfg, BucketPlan.from_config(cfg), CPU, loaded=loaded)
    gen = torch.Generator().manual_seed(0)
    for cache in ex.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = [c[:, NULL_BLOCK + 1:].clone() for c in ex.kv_caches]
    for key in (DECODE, PREFILL, GraphKey(8, 0, 0, GREEDY), GraphKey(4, 0, 64, GREEDY)):
        ex.warmup(key)
        ex.capture(key)
    for c, b in zip(ex.kv_caches, before):
        assert torch.equal(c[:, NULL_BLOCK + 1:], b)
    assert not torch.equal(ex.kv_caches[0][:, NULL_BLOCK], before[0][:, 0]), "padding did write: to the null block"


# ---- capture-time sampling settings leaking into real requests ------------------------------------

def _generate_with_graphs(ex: Executor, prompt: list[int], n: int, **sampling) -> list[int]:
    """One sequence through the recorded graphs: chunked prefill (chunk 16), then decode steps."""
    prefill, decode = GraphKey(1, 0, 16, SAMPLED), GraphKey(1, 0, 0, SAMPLED)
    table = [7, 3, 11, 5]  # scrambled blocks: 64 tokens
    token = None
    for s in range(0, len(prompt), 16):
        ex.prepare(prefill, [StepRow(prompt[s:s + 16], s, table, **sampling)])
        token = int(ex.execute(prefill).tokens[0])
    out = [token]
    while len(out) < n:
        ex.prepare(decode, [StepRow([out[-1]], len(prompt) + len(out) - 1, table, **sampling)])
        out.append(int(ex.execute(decode).tokens[0]))
    return out


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=0, top_p=1.0, seed=1234),
                                      dict(temperature=0.8, top_k=50, top_p=0.9, seed=7),
                                      dict(temperature=2.0, top_k=5, top_p=1.0, seed=2**40 + 3)])
def test_captured_on_padding_then_real_requests_match_the_oracle(cfg, loaded, sampling):
    """Footgun: capture runs on padding (temperature 0); those settings must not leak into real requests."""
    ex = make_executor(cfg, GraphKey(1, 0, 16, SAMPLED), GraphKey(1, 0, 0, SAMPLED), loaded=loaded)
    assert (ex.buffers.dev.temperature == 0).all(), "capture ran on padding-only, greedy inputs"
    ex.runner.lock()
    prompt = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(5)).tolist()  # 16 + a tail of 5
    got = _generate_with_graphs(ex, prompt, 10, **sampling)
    want = oracle.generate(ex.loaded, prompt, 10, chunk_size=16, **sampling)
    assert got == want
    greedy = oracle.generate(ex.loaded, prompt, 10, chunk_size=16)
    assert got != greedy, "sampled request decoded greedily: capture-time settings leaked"


def test_engine_serves_sampled_requests_like_the_oracle(default_artifacts):
    """Footgun: the same leak through the real runtime (scheduler, fast decode path, mixed batches)."""
    from trtgraph.runtime.serving.engine import Engine

    engine = Engine(default_artifacts)
    assert engine.executor.runner.locked
    gen = torch.Generator().manual_seed(9)
    reqs = [dict(id=f"r{i}", prompt_token_ids=torch.randint(1, 320, (3 + 9 * i,), generator=gen).tolist(),
                 max_tokens=8, temperature=[0.0, 1.0, 0.7, 1.3][i], top_k=[0, 0, 40, 3][i],
                 top_p=[1.0, 1.0, 0.8, 1.0][i], seed=100 + i) for i in range(4)]
    results = {r.id: r for r in engine.generate(reqs)}
    assert engine.stats.fast_path_steps > 0 and engine.executor.num_eager_steps == 0
    for req in reqs:
        want = oracle.generate(engine.executor.loaded, req["prompt_token_ids"], req["max_tokens"],
                               temperature=req["temperature"], top_k=req["top_k"], top_p=req["top_p"],
                               seed=req["seed"])
        assert results[req["id"]].token_ids == want, req["id"]
    hot = reqs[1]
    assert results[hot["id"]].token_ids != oracle.generate(engine.executor.loaded, hot["prompt_token_ids"], 8)


# ---- a stale row from a previous, bigger batch -------------------------------------------------

@pytest.mark.parametrize("key", [GraphKey(4, 0, 0, SAMPLED), GraphKey(4, 0, 16, SAMPLED), GraphKey(8, 0, 0, GREEDY)])
def test_smaller_batch_after_bigger_one_matches_a_fresh_executor(cfg, loaded, key):
    """Footgun: rows of the previous, bigger batch linger in the padding rows of the next one."""
    used = make_executor(cfg, key, loaded=loaded)
    sampled = key.sampling == SAMPLED
    run(used, key, rows_on_blocks(key, key.batch_size, first_block=1, seed=1, sampled=sampled))
    small = rows_on_blocks(key, 2, first_block=60, seed=2, sampled=sampled)
    used_logits, used_tokens = run(used, key, small)

    fresh = make_executor(cfg, key, loaded=loaded)
    fresh_logits, fresh_tokens = run(fresh, key, small)
    real = 2 if key.is_prefill else 2 * key.q_len
    assert torch.equal(used_logits[:real], fresh_logits[:real])
    assert torch.equal(used_tokens, fresh_tokens), "padding rows' outputs depend on the previous batch"
    for name, _, _ in FIELDS:
        assert torch.equal(extent(used, key, name), extent(fresh, key, name)), f"{name} keeps a stale row"


# ---- seeded noise independent of batch and padding ----------------------------------------------

def test_seeded_noise_does_not_depend_on_batch_or_padding():
    """Footgun: noise drawn for the whole batch makes a seeded request's tokens depend on its neighbours."""
    gen = torch.Generator().manual_seed(0)
    V, not_argmax = 320, 0
    for trial in range(30):
        logits = torch.randn(1, V, generator=gen) * 2
        temp = torch.tensor([float(torch.rand((), generator=gen)) * 2 + 0.5])
        top_k = torch.tensor([[0, 20, 100][trial % 3]])
        top_p = torch.tensor([[1.0, 0.95, 0.8][trial % 3]])
        seed = torch.randint(0, 2**62, (1,), generator=gen)
        pos = torch.randint(1, 256, (1,), generator=gen)
        alone = sampler.sample(logits, temp, top_k, top_p, seed, pos)
        not_argmax += int(alone != logits.argmax(-1))
        for batch, at in ((8, trial % 8), (3, 2), (16, 15)):
            big = torch.randn(batch, V, generator=gen) * 2
            b_temp = torch.rand(batch, generator=gen) * 2
            b_temp[::3] = 0.0  # padding-like rows
            b_k = torch.randint(0, 60, (batch,), generator=gen)
            b_p = torch.rand(batch, generator=gen) * 0.5 + 0.5
            b_seed = torch.randint(0, 2**62, (batch,), generator=gen)
            b_pos = torch.randint(0, 256, (batch,), generator=gen)
            for t, v in ((big, logits[0]), (b_temp, temp), (b_k, top_k), (b_p, top_p), (b_seed, seed), (b_pos, pos)):
                t[at] = v
            drawn = sampler.sample(big, b_temp, b_k, b_p, b_seed, b_pos)
            assert int(drawn[at]) == int(alone), f"trial {trial}: row {at} of {batch} drew differently"
    assert not_argmax > 5, "the rows were (nearly) greedy: the test would show nothing"


def test_seeded_noise_depends_on_seed_and_position_only():
    """Footgun: noise keyed on the row index would repeat across rows and change when rows move."""
    seeds = torch.tensor([5, 5, 6, 5])
    positions = torch.tensor([10, 10, 10, 11])
    noise = sampler.uniform_noise(seeds, positions, 320)
    assert torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[3])
    assert ((noise > 0) & (noise < 1)).all()
    assert torch.equal(sampler.uniform_noise(seeds[[3, 0]], positions[[3, 0]], 320), noise[[3, 0]])
