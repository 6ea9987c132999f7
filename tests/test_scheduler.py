"""The continuous-batching scheduler on its own (trtgraph/runtime/serving/scheduler.py): no model,
fake tokens. Every step must select a recorded key that fits, preemption must pick the
newest running sequence, every sequence must finish, and no KV block may leak."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import tiny_config
from trtgraph.buckets import GREEDY, SAMPLED, BatchShape, BucketPlan, select
from trtgraph.runtime.step.kv_cache import blocks_for_tokens
from trtgraph.runtime.serving.requests import Request
from trtgraph.runtime.serving.scheduler import Scheduler, Sequence

BLOCK = 16
MAX_SEQ_LEN = 256
MIN_BLOCKS = blocks_for_tokens(MAX_SEQ_LEN, BLOCK) + 1  # one full-length sequence + the null block


@pytest.fixture(scope="module")
def plan() -> BucketPlan:
    return BucketPlan.from_config(tiny_config())


PLAN = BucketPlan.from_config(tiny_config())


def fake_token(rid: str, index: int) -> int:
    """The token a sequence draws at output index `index`: a pure function, so a sequence
    recomputed after preemption must end with exactly these tokens."""
    return (sum(map(ord, rid)) * 31 + index * 7) % 300


class Driver:
    """Runs a Scheduler the way the engine does, with invariant checks on every step."""

    def __init__(self, plan: BucketPlan, num_blocks: int, specs, arrivals=None):
        """specs: (prompt_len, max_tokens, sampled) per request, in arrival order;
        arrivals: the step at which each request is added (default: all before the first)."""
        self.plan, self.num_blocks = plan, num_blocks
        self.sched = Scheduler(plan, num_blocks, BLOCK)
        self.chunks = sorted({k.chunk_size for k in plan.keys if k.is_prefill})
        self.seqs = []
        for i, (plen, max_tokens, sampled) in enumerate(specs):
            req = Request(id=f"r{i}", prompt_token_ids=tuple((i + j) % 256 for j in range(plen)),
                          max_tokens=max_tokens, temperature=0.8 if sampled else 0.0, seed=i)
            self.seqs.append(Sequence(request=req, arrival=i, prompt_ids=list(req.prompt_token_ids), seed=i))
        self.arrivals = list(arrivals) if arrivals is not None else [0] * len(self.seqs)
        self.finished: list[Sequence] = []
        self.steps = []
        self.num_extended = 0  # decode steps launched ahead (pipelined)
        self.num_retired_ahead = 0  # steps whose rows all ended, the next formed before reading them (pipelined)
        self.num_settled_ahead = 0  # prefill steps where no row draws, accounted at launch (pipelined)
        self.num_after_prefill = 0  # decode steps launched ahead of a prefill's tokens (pipelined)
        self.preemptions = []  # (victim, arrivals of the running sequences just before)
        orig = self.sched.preempt

        def preempt(seq):
            self.preemptions.append((seq, [s.arrival for s in self.sched.running]))
            orig(seq)

        self.sched.preempt = preempt

    def run(self, max_steps: int, pipelined: bool = False):
        """pipelined: like the engine, launch a decode step again (extend_decode) before the
        previous one's tokens are accounted."""
        pending = sorted(zip(self.arrivals, range(len(self.seqs))))
        n, inflight = 0, None
        while pending or self.sched.has_work or inflight is not None:
            while pending and pending[0][0] <= n:
                self.sched.add(self.seqs[pending.pop(0)[1]])
            assert n < max_steps, (f"no termination after {n} steps: running "
                                   f"{[(s.request.id, s.num_computed, len(s.all_ids)) for s in self.sched.running]}, "
                                   f"{len(self.sched.waiting)} waiting, {self.sched.num_preemptions} preemptions")
            if inflight is None:
                if not self.sched.has_work:
                    n += 1
                    continue
                inflight = self.sched.schedule()
                assert inflight is not None, "the scheduler has work but formed no step"
                self.check_step(inflight)
                self.steps.append((inflight.key, len(inflight.seqs), list(inflight.num_new)))
            following = None
            retired = pipelined and self.sched.retire_ahead(inflight)
            if retired or (pipelined and self.sched.settle_ahead(inflight)):
                # every row ends with this step, or none draws in it: the next is formed before
                # its tokens are read
                self.num_retired_ahead += retired
                self.num_settled_ahead += not retired
                if self.sched.has_work:
                    following = self.sched.schedule()
                    if following is not None:
                        self.check_step(following)
                        self.steps.append((following.key, len(following.seqs), list(following.num_new)))
            elif pipelined and (following := self.sched.extend_decode(inflight)) is not None:
                assert not following.is_prefill and following.seqs == self.sched.running
                drew_in = {id(inflight.seqs[j]) for _, j in following.gather}
                assert len(drew_in) == len(following.gather) == (len(inflight.seqs) if inflight.is_prefill else 0)
                for s in following.seqs:  # blocks for the token the step launched ahead writes
                    # a prefill row: its first drawn token; a row of the decode step in flight: the
                    # token after the one it feeds; a decoding row outside the prefill: its own
                    pos = len(s.all_ids) if id(s) in drew_in else s.num_computed + (not inflight.is_prefill)
                    assert id(s) in drew_in or s.num_pending == 1
                    assert len(s.block_table) >= blocks_for_tokens(pos + 1, BLOCK)
                self.num_extended += 1
                self.num_after_prefill += inflight.is_prefill
                self.steps.append((following.key, len(following.seqs), list(following.num_new)))
            self.complete(inflight, n)
            inflight = following
            n += 1
        return n

    def complete(self, step, n):
        tokens = [fake_token(s.request.id, len(s.output_ids)) for s in step.seqs]
        for seq, _ in self.sched.advance(step, tokens, now=float(n)):
            if len(seq.output_ids) >= seq.request.max_tokens:
                self.sched.finish(seq)
                self.finished.append(seq)
        self.check_blocks()

    def check_step(self, step):
        key, seqs, num_new = step.key, step.seqs, step.num_new
        assert key in self.plan.keys, f"{key} is not a recorded key"
        assert 1 <= len(seqs) <= key.batch_size
        assert len(num_new) == len(seqs) and len({id(s) for s in seqs}) == len(seqs)
        assert all(s in self.sched.running for s in seqs)
        sampled = any(not s.request.is_greedy for s in seqs)
        if sampled:
            assert key.sampling == SAMPLED, f"sampled rows in a greedy graph {key}"
        # The smallest recorded key that fits (greedy preferred at equal size).
        assert key == select(self.plan, BatchShape(len(seqs), 0, key.chunk_size, SAMPLED if sampled else GREEDY))
        if key.is_prefill:
            assert key.chunk_size in self.chunks
            assert len(seqs) <= self.plan.max_context_batch_size
            for s, n in zip(seqs, num_new):
                assert 1 <= n <= key.chunk_size
                assert n <= s.num_pending
        else:
            assert num_new == [1] * len(seqs)
            assert all(s.num_pending == 1 for s in seqs)
        for s, n in zip(seqs, num_new):  # blocks for every token this step writes
            assert len(s.block_table) >= blocks_for_tokens(s.num_computed + n, BLOCK)
            assert s.num_computed + n <= MAX_SEQ_LEN

    def check_blocks(self):
        held = [b for s in self.sched.running for b in s.block_table]
        assert len(held) == len(set(held)), "a KV block is owned by two sequences"
        assert 0 not in held, "the null block was handed out"
        assert all(not s.block_table for s in self.sched.waiting), "a waiting sequence holds blocks"
        assert len(held) + self.sched.allocator.num_free == self.num_blocks - 1, "KV blocks leaked"
        assert len(self.sched.running) <= self.plan.max_batch_size

    def check_done(self):
        assert not self.sched.has_work
        assert sorted(s.arrival for s in self.finished) == list(range(len(self.seqs))), "not every sequence finished"
        for s in self.seqs:
            assert s.output_ids == [fake_token(s.request.id, i) for i in range(s.request.max_tokens)], \
                f"{s.request.id}: generated tokens lost or duplicated (preempted {s.num_preemptions}x)"
            assert s.block_table == []
        assert self.sched.allocator.num_free == self.num_blocks - 1, "KV blocks leaked"

    def check_victims(self):
        for victim, running in self.preemptions:
            assert victim.arrival == max(running), (
                f"preempted r{victim.arrival} while newer r{max(running)} was running (running: {running})")


def step_bound(specs, arrivals=()) -> int:
    """Generous: every token recomputed many times over, plus arrival gaps."""
    return 8 * sum(p + m for p, m, _ in specs) + max(arrivals, default=0) + 100


# ---- fixed scenarios ---------------------------------------------------------------------

@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_plenty_of_blocks_every_step_uses_a_recorded_key_and_nothing_leaks(plan, pipelined):
    specs = [(1, 5, False), (16, 3, True), (3, 1, False), (7, 7, False), (17, 10, False), (64, 2, False),
             (65, 8, True), (150, 20, False), (40, 30, True), (100, 12, False), (200, 56, True), (33, 4, False)]
    num_blocks = 8 * MIN_BLOCKS
    d = Driver(plan, num_blocks, specs)
    d.run(step_bound(specs), pipelined=pipelined)
    d.check_done()
    assert d.sched.num_preemptions == 0
    keys = {k for k, _, _ in d.steps}
    assert {k.chunk_size for k in keys if k.is_prefill} <= {16, 64}
    assert any(not k.is_prefill and k.batch_size == 8 for k in keys)  # more requests than fit: 8 at a time


def test_prefill_of_a_long_prompt_is_chunked(plan):
    d = Driver(plan, 4 * MIN_BLOCKS, [(150, 2, False)])
    d.run(100)
    d.check_done()
    prefill = [(k.chunk_size, n[0]) for k, _, n in d.steps if k.is_prefill]
    assert len(prefill) >= 3  # the largest recorded chunk is 64
    assert sum(n for _, n in prefill) == 150
    assert all(n == c for c, n in prefill[:-1])  # full chunks, then the tail
    assert 1 <= prefill[-1][1] <= prefill[-1][0]
    assert [k.is_prefill for k, _, _ in d.steps] == [True] * len(prefill) + [False]  # then one decode step


def test_more_requests_than_max_batch_size_wait_their_turn(plan):
    specs = [(4, 6, False)] * 12
    d = Driver(plan, 8 * MIN_BLOCKS, specs)
    d.run(step_bound(specs))
    d.check_done()
    assert max(n for _, n, _ in d.steps) == plan.max_batch_size
    order = [s.arrival for s in d.finished]
    assert set(order[:8]) == set(range(8))  # FIFO: the first eight finish before any of the last four


@pytest.mark.parametrize("specs", [[(60, 60, False)] * 3, [(30, 100, False)] * 4, [(20, 120, True)] * 5,
                                   [(40, 80, False)] * 4], ids=["3x120", "4x130", "5x140-sampled", "4x120"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_blocks_running_out_preempts_the_newest_running_sequence(plan, specs, pipelined):
    """16 usable blocks; sequences that grow to 8-9 blocks each cannot all stay."""
    d = Driver(plan, MIN_BLOCKS, specs)
    d.run(step_bound(specs), pipelined=pipelined)
    d.check_done()
    assert d.sched.num_preemptions > 0 and d.preemptions
    d.check_victims()
    assert d.seqs[0].num_preemptions == 0  # the oldest is never the victim
    assert sum(s.num_preemptions for s in d.seqs) == d.sched.num_preemptions


def test_preempted_sequence_is_recomputed_from_prompt_plus_output(plan):
    specs = [(100, 120, False), (100, 120, False)]
    d = Driver(plan, MIN_BLOCKS, specs)
    d.run(step_bound(specs))
    d.check_done()  # outputs equal the fake-token function: nothing lost or repeated
    assert d.seqs[1].num_preemptions > 0
    assert d.seqs[0].num_preemptions == 0


def test_concurrent_chunked_prefills_with_tight_blocks_terminate(plan):
    """Long prompts (several chunks each) arriving while others decode, with few blocks:
    sequences mid-prefill must not preempt each other forever."""
    specs = [(1 + 6 * i, 1 + 2 * i, False) for i in range(24)]
    d = Driver(plan, 20, specs)
    d.run(step_bound(specs))
    d.check_done()
    d.check_victims()


def test_pipelined_decoding_reserves_ahead_and_wastes_only_finished_rows(plan):
    """Steady decoding launches each step ahead; a row that finishes wastes its next slot,
    never gains a token, and its blocks (the one reserved ahead included) come back."""
    specs = [(10, 3, False), (20, 30, True), (5, 17, False), (33, 40, False)]
    d = Driver(plan, 4 * MIN_BLOCKS, specs)
    d.run(step_bound(specs), pipelined=True)
    d.check_done()
    assert d.num_extended > 0


def test_a_step_whose_rows_all_end_lets_the_next_be_formed_before_its_tokens_are_read(plan):
    """A wave of rows that reach max_tokens in the same step: their blocks and slots are freed
    when that step is launched (retire_ahead), the waiting requests' step is formed then, and
    the retired rows still get their last token; nothing leaks, every output is exact."""
    rows = plan.max_batch_size
    specs = [(5, 4, False)] * rows + [(9, 3, i % 2 == 1) for i in range(rows)]
    d = Driver(plan, 4 * rows * MIN_BLOCKS, specs)
    d.run(step_bound(specs), pipelined=True)
    d.check_done()
    assert d.num_retired_ahead >= 2  # each wave's last step
    assert d.num_after_prefill >= 2  # each wave's first decode step
    # A step that some row outlives is not retired, and a retired row that is aborted draws nothing.
    sched = Scheduler(plan, MIN_BLOCKS * 2, BLOCK)
    long, short = (Sequence(request=Request(id=f"x{m}", prompt_token_ids=(1, 2, 3), max_tokens=m), arrival=i,
                            prompt_ids=[1, 2, 3], seed=0) for i, m in enumerate((5, 1)))
    sched.add(long)
    sched.add(short)
    step = sched.schedule()
    assert step.is_prefill and not sched.retire_ahead(step)  # `long` draws on
    sched.postprocess(step, [7, 8])
    assert short.finished and not long.finished
    for _ in range(3):
        step = sched.schedule()
        assert not sched.retire_ahead(step)
        sched.postprocess(step, [7])
    step = sched.schedule()
    assert sched.retire_ahead(step) and long.retired and not long.finished
    assert sched.allocator.num_free == MIN_BLOCKS * 2 - 1 and not sched.running
    sched.abort(long.request)
    assert long.finished and sched.postprocess(step, [9]) == [] and long.output_ids == [7, 7, 7, 7]


def test_mixed_prompts_pad_little_and_decode_rows_wait_at_most_one_step(plan):
    """Prompts of 3 to 200 tokens, outputs of 2 to 40, a third sampled, more requests than
    rows: at most 10% of the step tokens are padding, and a row ready to decode is left out of
    at most one step in a row (a prefill step) however long the prompts behind it."""
    import random

    rng = random.Random(0)
    specs = [(rng.randint(3, 200), rng.randint(2, 40), i % 3 == 0) for i in range(40)]
    d = Driver(plan, 200 * MIN_BLOCKS, specs)
    waited: dict[int, int] = {}
    longest = 0

    def watched(form):
        def formed(*args):
            nonlocal longest
            ready = [s for s in d.sched.running if s.output_ids and s.num_pending == 1]
            step = form(*args)
            if step is not None:  # every step formed (also those launched ahead) counts
                for s in ready:
                    waited[id(s)] = 0 if s in step.seqs else waited.get(id(s), 0) + 1
                    longest = max(longest, waited[id(s)])
            return step
        return formed

    d.sched.schedule = watched(d.sched.schedule)
    d.sched.extend_decode = watched(d.sched.extend_decode)
    d.run(step_bound(specs), pipelined=True)
    d.check_done()
    real = sum(sum(n) for _, _, n in d.steps)
    padded = sum(k.num_tokens for k, _, _ in d.steps)
    assert 1 - real / padded <= 0.10, f"{100 * (1 - real / padded):.1f}% of step tokens are padding"
    assert longest == 1


def test_finish_returns_every_block(plan):
    d = Driver(plan, MIN_BLOCKS, [(40, 1, False)])
    seq = d.seqs[0]
    d.sched.add(seq)
    fed = 0
    while True:
        step = d.sched.schedule()
        assert step.key.is_prefill and step.seqs == [seq]
        fed += step.num_new[0]
        drew = d.sched.advance(step, [5])
        if drew:
            break
        assert fed < 40
    assert fed == 40 and drew == [(seq, 1)] and seq.output_ids == [5]
    assert d.sched.allocator.num_free == MIN_BLOCKS - 1 - blocks_for_tokens(40, BLOCK)
    d.sched.finish(seq)
    assert d.sched.allocator.num_free == MIN_BLOCKS - 1 and seq.block_table == []
    assert not d.sched.has_work and d.sched.schedule() is None


# ---- random mixes ----------------------------------------------------------------------

@st.composite
def mixes(draw):
    n = draw(st.integers(1, 14))
    specs, arrivals = [], []
    for _ in range(n):
        plen = draw(st.integers(1, MAX_SEQ_LEN - 1))
        max_tokens = draw(st.integers(1, min(80, MAX_SEQ_LEN - plen)))
        specs.append((plen, max_tokens, draw(st.booleans())))
        arrivals.append(draw(st.sampled_from([0, 0, 0, 1, 3, 10, 40])))
    num_blocks = draw(st.integers(MIN_BLOCKS, 80))
    return specs, arrivals, num_blocks


@settings(max_examples=200, deadline=None)
@given(mixes(), st.booleans())
@example(([(1 + 6 * i, 1 + 2 * i, False) for i in range(24)], [0] * 24, 20), False)
@example(([(1 + 6 * i, 1 + 2 * i, False) for i in range(24)], [0] * 24, 20), True)
@example(([(120, 40, False), (130, 40, True), (110, 40, False)], [0, 0, 0], MIN_BLOCKS), False)
def test_random_mixes_terminate_use_recorded_keys_and_leak_nothing(mix, pipelined):
    specs, arrivals, num_blocks = mix
    d = Driver(PLAN, num_blocks, specs, arrivals)
    d.run(step_bound(specs, arrivals), pipelined=pipelined)
    d.check_done()
    d.check_victims()
    if num_blocks - 1 >= sum(blocks_for_tokens(p + m, BLOCK) for p, m, _ in specs):
        assert d.sched.num_preemptions == 0  # room for everyone: no preemption


def test_prefill_chunk_feeds_the_most_tokens_at_low_padding(plan):
    """A long prompt alone takes the big chunk; short mixed prompts the small one (the big one
    would pad most of its step); equal 64-token prompts the big one (no padding, more tokens)."""
    sched = Scheduler(plan, 8 * MIN_BLOCKS, 16)
    assert sched._chunk_for([200]) == 64
    assert sched._chunk_for([5, 9, 3, 12, 7, 30, 2, 8]) == 16
    assert sched._chunk_for([64, 64, 64, 64, 64]) == 64
