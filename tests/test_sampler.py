"""The sort-free sampler against a sort-based reference of the same semantics, and the
Triton kernels against the torch reference (TRITON_INTERPRET=1 on the CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtgraph.kernels import sampler_reference as sampler


def sorted_keep(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The semantics by sorting: a stable descending sort, ties share the rank and the
    preceding mass of the first of their group."""
    V = x.shape[0]
    vals, order = x.sort(descending=True, stable=True)
    first = torch.ones(V, dtype=torch.bool)
    first[1:] = vals[1:] != vals[:-1]
    group_start = torch.where(first, torch.arange(V), torch.zeros(V, dtype=torch.int64)).cummax(0).values
    k = V if top_k <= 0 or top_k > V else top_k
    keep = group_start < k  # fewer than k tokens strictly above
    e = torch.exp(vals - vals[0])
    ek = torch.where(keep, e, torch.zeros_like(e))
    before = (ek.cumsum(0) - ek)[group_start]  # mass strictly above the tie group
    if top_p < 1:
        keep &= before <= top_p * ek.sum()
    keep &= e >= min_p
    out = torch.zeros(V, dtype=torch.bool)
    out[order] = keep
    return out


def rows_strategy():
    values = st.one_of(st.floats(-30, 30, width=32), st.sampled_from([0.0, -0.0, 1.0, 2.5, float("-inf")]))
    return st.lists(values, min_size=2, max_size=48).filter(lambda r: any(v != float("-inf") for v in r))


@settings(max_examples=300, deadline=None)
@given(row=rows_strategy(), top_k=st.integers(-1, 50), top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1, 1e-6]),
       min_p=st.sampled_from([0.0, 0.0, 0.05, 0.5, 1.0]))
def test_keep_mask_equals_the_sort_based_reference(row, top_k, top_p, min_p):
    x = torch.tensor([row], dtype=torch.float32)
    got = sampler.keep_mask(x, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
    assert torch.equal(got, sorted_keep(x[0], top_k, top_p, min_p))


def random_batch(gen, R, V, ties=False):
    logits = torch.randn(R, V, generator=gen) * 3
    if ties:
        logits = (logits * 2).round() / 2  # many exact ties
    return (logits, torch.rand(R, generator=gen) * 1.5 + 0.2, torch.randint(-1, V + 3, (R,), generator=gen),
            torch.rand(R, generator=gen).clamp_min(1e-6), torch.rand(R, generator=gen) * 0.3,
            torch.randint(0, 2**62, (R,), generator=gen), torch.randint(0, 4096, (R,), generator=gen))


@pytest.mark.parametrize("ties", [False, True])
def test_sample_draws_the_gumbel_argmax_over_the_kept_set(ties):
    gen = torch.Generator().manual_seed(1)
    logits, temp, top_k, top_p, min_p, seeds, pos = random_batch(gen, 64, 300, ties)
    top_p[::4], top_k[1::4], min_p[2::4] = 1.0, 0, 0.0
    got = sampler.sample(logits, temp, top_k, top_p, seeds, pos, min_p)
    x = logits / temp.unsqueeze(1)
    noise = -torch.log(-torch.log(sampler.uniform_noise(seeds, pos, 300)))
    for r in range(64):
        keep = sorted_keep(x[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
        want = (x[r] + noise[r]).masked_fill(~keep, float("-inf")).argmax()
        assert int(got[r]) == int(want), f"row {r}"
    assert (got != logits.argmax(-1)).sum() > 10, "nearly greedy: the test would show little"


def test_extreme_filters_reduce_to_the_argmax():
    gen = torch.Generator().manual_seed(2)
    logits, temp, _k, _p, _m, seeds, pos = random_batch(gen, 32, 500)
    one, ones = torch.ones(32, dtype=torch.int64), torch.ones(32)
    best = logits.argmax(-1)
    assert torch.equal(sampler.sample(logits, temp, one, ones, seeds, pos), best)  # top_k = 1
    assert torch.equal(sampler.sample(logits, temp, 0 * one, ones * 1e-7, seeds, pos), best)  # top_p tiny
    assert torch.equal(sampler.sample(logits, temp, 0 * one, ones, seeds, pos, ones), best)  # min_p = 1
    assert torch.equal(sampler.sample(logits, 0 * temp, 0 * one, ones, seeds, pos), best)  # temperature 0


def test_min_p_equals_the_transformers_warper():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 400, generator=gen) * 2
    for min_p in (0.01, 0.1, 0.3):
        want = MinPLogitsWarper(min_p)(None, TopKLogitsWarper(40)(None, x.clone())) != float("-inf")
        got = sampler.keep_mask(x, torch.full((16,), 40), torch.ones(16), torch.full((16,), min_p))
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def tri():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from trtgraph.kernels import sampling

    return sampling


@pytest.fixture(scope="module")
def tri_proc(tri):
    from trtgraph.kernels import processors

    return processors


def filter_mix(gen, R, V, ties):
    """Every filter combination, and greedy rows."""
    logits, temp, top_k, top_p, min_p, seeds, pos = random_batch(gen, R, V, ties)
    top_k[0::3] = 0
    top_p[1::3] = 1.0
    min_p[::2] = 0.0
    temp[5::7] = 0.0
    top_k[7], top_p[8], top_k[9], top_p[9] = 1, 1e-7, 50, 0.95
    return logits, temp, top_k, top_p, min_p, seeds, pos


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("V", [300, 2500])
def test_triton_sample_equals_the_reference(tri, ties, V):
    gen = torch.Generator().manual_seed(V + ties)
    logits, temp, top_k, top_p, min_p, seeds, pos = filter_mix(gen, 24, V, ties)
    want = sampler.sample(logits, temp, top_k, top_p, seeds, pos, min_p)
    got = tri.sample(logits, temp, top_k, top_p, seeds, pos, min_p, block=512)  # several chunks per row
    assert torch.equal(got, want)


@pytest.mark.parametrize("cap", [1, 8, 64, 1024])
def test_triton_sample_settles_rows_from_candidates_or_by_rejection(tri, cap):
    """The same tokens whichever path a row takes: few candidates per chunk send most filtered
    rows past the candidates, many settle them all from the candidates."""
    gen = torch.Generator().manual_seed(cap)
    logits, temp, top_k, top_p, min_p, seeds, pos = filter_mix(gen, 24, 2500, False)
    want = sampler.sample(logits, temp, top_k, top_p, seeds, pos, min_p)
    got, path = tri.draw(logits, temp, top_k, top_p, seeds, pos, min_p, None, None, 256, cap)
    assert torch.equal(got, want)
    filtered = (temp > 0) & (((top_k > 0) & (top_k < 2500)) | (top_p < 1) | (min_p > 0))
    assert not path[~filtered].any()
    top_p_alone = filtered & ((top_k <= 0) | (top_k >= 2500)) & (top_p < 1)
    assert not (path[~top_p_alone] == 1).any()  # the split search is for top-p without top-k
    if cap >= 256:  # a chunk is its own candidates: nothing left out
        assert not path.any()
    elif cap > 1:  # both paths taken
        assert path[filtered].any() and (path[filtered] == 0).any()


@pytest.mark.parametrize("enough", [1, 64])
def test_triton_sample_is_the_same_wherever_the_candidate_cut_stops(tri, enough):
    """The chunks' candidate cut stops bisecting once `enough` candidates are kept (1: few
    candidates, more rows reach past them; 64 = the cap: the full bisection; rows with top-p
    and no top-k always bisect to the cap); the tokens are the reference's either way."""
    gen = torch.Generator().manual_seed(enough)
    logits, temp, top_k, top_p, min_p, seeds, pos = filter_mix(gen, 24, 2500, False)
    want = sampler.sample(logits, temp, top_k, top_p, seeds, pos, min_p)
    got, _ = tri.draw(logits, temp, top_k, top_p, seeds, pos, min_p, None, None, 256, 64, enough=enough)
    assert torch.equal(got, want)


def flat_rows(gen, R, V, ties=False):
    """Top-p without top-k on rows from peaked to near-flat (the kept set from a few tokens to
    most of the row), some with min-p."""
    spread = torch.tensor([3.0, 1.0, 0.5, 2.0, 0.3, 0.05, 1.5, 0.8])[torch.arange(R) % 8]
    logits = torch.randn(R, V, generator=gen) * spread.unsqueeze(1)
    if ties:  # exact ties in small groups (a bin can split them off)
        logits = (logits * 64).round() / 64
    temp = torch.rand(R, generator=gen) + 0.5
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.95, 0.7, 0.9])[torch.arange(R) % 6]
    min_p = torch.where(torch.arange(R) % 5 == 4, 0.2, 0.0)
    return (logits, temp, torch.zeros(R, dtype=torch.int64), top_p, torch.randint(0, 2**62, (R,), generator=gen),
            torch.randint(0, 4096, (R,), generator=gen), min_p)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("rounds,bins", [(2, 32), (1, 8), (3, 4)])
def test_triton_top_p_alone_searches_the_threshold_over_chunks(tri, ties, rounds, bins):
    """Rows whose kept set reaches past the candidates find the threshold by the split bin
    search (path 1); rows whose last bin holds too many tokens of a chunk (coarse bins, ties)
    take the rejection rounds (path 2). Tokens equal the reference's on every path."""
    gen = torch.Generator().manual_seed(rounds * 100 + bins + ties)
    logits, temp, top_k, top_p, seeds, pos, min_p = flat_rows(gen, 24, 3000, ties)
    want = sampler.sample(logits, temp, top_k, top_p, seeds, pos, min_p)
    got, path = tri.draw(logits, temp, top_k, top_p, seeds, pos, min_p, None, None, 256, 8, rounds, bins)
    assert torch.equal(got, want)
    assert (path == 0).any()
    if (rounds, bins) == (1, 8):  # too coarse: bins of more than 8 tokens in a chunk
        assert (path == 2).any()
    else:
        assert (path == 1).sum() >= 4
    if (rounds, bins) == (2, 32) and not ties:
        assert not (path == 2).any()


@pytest.mark.parametrize("chunk", [128, 4096])  # several chunks per row, one chunk per row
def test_triton_argmax_equals_torch_argmax(tri, chunk):
    """The first maximal index, ties across chunks, NaN above every number (the first NaN),
    -0.0 == +0.0, rows of -inf, bf16 logits."""
    gen = torch.Generator().manual_seed(chunk)
    x = torch.randn(8, 1000, generator=gen)
    x[1, ::3] = x[1].max()  # ties in many chunks: the first
    x[2, 700], x[2, 900], x[2, 5] = float("nan"), float("nan"), float("inf")
    x[3] = float("-inf")
    x[4] = -1.0
    x[4, 10], x[4, 500] = -0.0, 0.0
    x[5, 999] = 1e30
    x[6, 300], x[6, 301] = float("inf"), float("inf")
    x[7, 640] = -float("nan")  # a NaN with the sign bit set
    want = sampler.greedy(x)
    assert torch.equal(tri.argmax(x, chunk), want)
    assert want.tolist()[1:5] == [0, 700, 0, 10]
    assert torch.equal(tri.argmax(x.bfloat16(), chunk), sampler.greedy(x.bfloat16()))
    assert torch.equal(tri.argmax(x[:, ::2], chunk), sampler.greedy(x[:, ::2]))  # strided rows
    # written into a given buffer (the greedy step's drawn tokens, no copy): the same indices
    buf, ref = torch.full((9,), -7, dtype=torch.int64), torch.full((9,), -7, dtype=torch.int64)
    assert tri.argmax(x, chunk, out=buf[1:]) is not None and torch.equal(buf[1:], want) and buf[0] == -7
    sampler.greedy(x, out=ref[1:])
    assert torch.equal(ref[1:], want) and ref[0] == -7


def test_triton_sample_reads_processed_rows(tri):
    gen = torch.Generator().manual_seed(9)
    logits, temp, top_k, top_p, min_p, seeds, pos = random_batch(gen, 8, 700)
    processed = torch.randn(8, 700, generator=gen) * 3
    active = torch.tensor([1, 0] * 4)
    mixed = torch.where(active.unsqueeze(1) != 0, processed, logits)
    want = sampler.sample(mixed, temp, top_k, top_p, seeds, pos, min_p)
    assert torch.equal(tri.sample(logits, temp, top_k, top_p, seeds, pos, min_p, processed, active), want)


def random_state(gen, R, V, S=6, n_bias=300, n_stop=5):
    counts = torch.randint(0, 3, (S, V), generator=gen, dtype=torch.int32)
    counts |= (torch.rand(S, V, generator=gen) < 0.2).to(torch.int32) * sampler.PROMPT_BIT
    bias_ids = torch.full((S, n_bias), -1, dtype=torch.int64)
    bias_vals = torch.zeros(S, n_bias)
    for s in range(S - 1):
        n = s * 7
        bias_ids[s, :n] = torch.randperm(V, generator=gen)[:n]
        bias_vals[s, :n] = torch.rand(n, generator=gen) * 200 - 100
    stop = torch.randint(0, V, (S, n_stop), generator=gen)
    state = sampler.SlotState(counts, bias_ids, bias_vals, stop)
    rows = sampler.RowParams(active=torch.randint(0, 2, (R,), generator=gen), slots=torch.randint(0, S, (R,), generator=gen),
                             eos_until=torch.randint(0, 20, (R,), generator=gen),
                             repetition=torch.rand(R, generator=gen) + 0.5, presence=torch.rand(R, generator=gen) * 4 - 2,
                             frequency=torch.rand(R, generator=gen) * 4 - 2)
    return state, rows, torch.randint(0, 20, (R,), generator=gen)


def test_triton_process_equals_the_reference(tri_proc):
    gen = torch.Generator().manual_seed(4)
    R, V = 12, 1500
    logits = torch.randn(R, V, generator=gen) * 3
    state, rows, pos = random_state(gen, R, V)
    want = sampler.process(logits, rows, state, pos)
    got = tri_proc.process(logits, rows, state, pos)
    active = rows.active != 0
    assert active.sum() >= 3 and torch.equal(got[active], want[active])
    assert torch.equal(want[~active], logits[~active])
    assert (want == float("-inf")).any(), "no min_tokens mask applied: the test shows less"


@pytest.mark.parametrize("chunk", [256, 4096])  # several chunks per row, one chunk per row
@pytest.mark.parametrize("ties", [False, True])
def test_triton_logprobs_equal_the_reference(tri_proc, chunk, ties):
    gen = torch.Generator().manual_seed(5 + ties)
    R, V = 6, 2100
    logits = torch.randn(R, V, generator=gen) * 4
    if ties:  # many exact ties, some across the top 20 and across chunks; a row of -inf mostly
        logits = (logits * 2).round() / 2
        logits[4, 10:] = float("-inf")
    tokens = torch.randint(0, V, (R,), generator=gen)
    want = torch.tensor([1, 0, 1, 1, 1, 1])
    vals, ids = tri_proc.top_logprobs(logits, tokens, want, 20, chunk)
    ref_vals, ref_ids = sampler.top_logprobs(logits, tokens, want, 20)
    rows = want != 0
    torch.testing.assert_close(vals[rows], ref_vals[rows], rtol=0, atol=1e-5)
    if not ties:
        assert torch.equal(ids[rows], ref_ids[rows])
    else:  # torch.topk leaves the order of equal values open: (value desc, id asc) here
        order = torch.log_softmax(logits, -1).sort(dim=-1, descending=True, stable=True).indices[:, :20]
        assert torch.equal(ids[rows], order[rows])
        top = vals[rows][:, 1:]
        assert (top[:, 1:] == top[:, :-1]).any(), "no tie in a top 20: the test shows less"


def test_the_kernel_set_chooses_the_sampler_once():
    """`kernels: torch` runs the torch reference everywhere (also on CUDA); Triton only by choice."""
    from trtgraph.kernels import get_kernels, processors, sampling

    ref = get_kernels("torch")
    assert (ref.sample, ref.process_logits, ref.top_logprobs) == (sampler.sample, sampler.process, sampler.top_logprobs)
    tri = get_kernels("triton")
    assert (tri.sample, tri.process_logits, tri.top_logprobs) == (sampling.sample, processors.process,
                                                                  processors.top_logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_sample_equals_the_reference_at_full_vocabulary():
    """Llama-3 vocabulary, 64 rows: every filter mix equals the torch reference on the GPU;
    top-k 50 + top-p 0.9 rows settle from the candidates; top-p alone on near-flat rows takes
    the split threshold search; a row's token is the same alone;
    the split argmax (fp32, bf16) and top logprobs equal torch's."""
    from trtgraph.kernels import sampling

    dev, V, R = torch.device("cuda"), 128256, 64
    gen = torch.Generator().manual_seed(11)
    logits, temp, top_k, top_p, min_p, seeds, pos = [t.to(dev) for t in filter_mix(gen, R, V, False)]
    batch = (logits, temp, top_k, top_p, seeds, pos, min_p)  # sample's argument order
    want = sampler.sample(*batch)
    got, _ = sampling.draw(*batch, None, None, sampling.CHUNK, sampling.CAP)
    assert torch.equal(got, want)
    k50, p09 = torch.full_like(top_k, 50), torch.full_like(top_p, 0.9)
    got, path = sampling.draw(logits, temp.clamp_min(0.5), k50, p09, seeds, pos, min_p, None, None,
                              sampling.CHUNK, sampling.CAP)
    assert not path.any()
    assert torch.equal(got, sampler.sample(logits, temp.clamp_min(0.5), k50, p09, seeds, pos, min_p))
    for r in (0, 9, 63):
        one = sampling.sample(*(t[r:r + 1] for t in batch))
        assert int(one) == int(sampling.sample(*batch)[r])
    flat = [t.to(dev) for t in flat_rows(gen, R, V)]  # top-p alone, peaked to near-flat rows
    got, path = sampling.draw(*flat, None, None, sampling.CHUNK, sampling.CAP)
    assert torch.equal(got, sampler.sample(*flat)) and (path == 1).sum() >= 8
    assert torch.equal(sampling.argmax(logits), sampler.greedy(logits))
    assert torch.equal(sampling.argmax(logits.bfloat16()), sampler.greedy(logits.bfloat16()))
    from trtgraph.kernels import processors

    want_lp = (torch.arange(R, device=dev) % 3 != 0).to(torch.int64)
    vals, ids = processors.top_logprobs(logits, want, want_lp, 20)
    ref_vals, ref_ids = sampler.top_logprobs(logits, want, want_lp, 20)
    rows = want_lp != 0
    assert torch.equal(ids[rows], ref_ids[rows])
    torch.testing.assert_close(vals[rows], ref_vals[rows], rtol=0, atol=1e-5)
