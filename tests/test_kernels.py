"""Each Triton kernel against its torch reference, on fresh random inputs, outputs poisoned
first. On the CPU this runs under TRITON_INTERPRET=1 (set by the README's test command);
the same tests run on the GPU with `pytest -m gpu` (test_gpu_kernels below)."""

from __future__ import annotations

import os

import pytest
import torch

from trtgraph.kernels import reference as ref

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels run on a GPU, or on the CPU with TRITON_INTERPRET=1")


def _tri():
    from trtgraph.kernels import triton_ops

    return triton_ops


def _attn():
    from trtgraph.kernels import attention

    return attention


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close(got, want, dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert not torch.isnan(got).any()
    rel = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    assert rel < tol, rel


def _cases(device):
    return [(device, torch.float32)] + ([(device, torch.bfloat16)] if device.type == "cuda" else [])


def run_norms(device, dtype, seed=0):
    g = _gen(seed)
    for shape in ((7, 64), (5, 4, 16), (3, 96)):
        x = torch.randn(shape, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype)
        _close(_tri().rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)


def run_silu(device, dtype, seed=0):
    gu = torch.randn((9, 2 * 172), generator=_gen(seed)).to(device, dtype)
    _close(_tri().silu_and_mul(gu), ref.silu_and_mul(gu), dtype)


def run_rope_kv(device, dtype, seed=0):
    g = _gen(seed)
    T, hq, hkv, d, nblocks, bs = 11, 4, 2, 16, 6, 4
    qkv = torch.randn((T, (hq + 2 * hkv) * d), generator=g).to(device, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)  # strided views, as in the model
    cos_sin = torch.randn((64, d), generator=g).to(device)
    positions = torch.randint(0, 64, (T,), generator=g).to(device)
    slots = torch.randperm(nblocks * bs, generator=g)[:T].to(device)
    caches = [torch.full((2, nblocks, bs, hkv, d), 7.0, dtype=dtype, device=device) for _ in range(2)]
    got_q = _tri().rope_write_kv(q, k, v, cos_sin, positions, caches[0], slots)
    want_q = ref.rope_write_kv(q, k, v, cos_sin, positions, caches[1], slots)
    _close(got_q, want_q, dtype)
    _close(caches[0], caches[1], dtype)


def _paged_case(g, device, dtype, q_len, batch, hq=8, hkv=2, d=16, bs=4, blocks=12):
    """Random contexts through scattered block tables, the step's rows at the end of each
    context: (cache, tables, positions)."""
    max_blocks = max(blocks, -(-q_len // bs) + 4)
    nblocks = batch * max_blocks + 1
    cache = torch.randn((2, nblocks, bs, hkv, d), generator=g).to(device, dtype)
    perm = torch.randperm(nblocks - 1, generator=g) + 1
    tables = torch.zeros((batch + 2, max_blocks), dtype=torch.int64)  # extra rows: unused table tail
    positions = []
    for b in range(batch):
        length = int(torch.randint(q_len, max_blocks * bs + 1, (1,), generator=g))
        nb = -(-length // bs)
        tables[b, :nb] = perm[b * max_blocks:b * max_blocks + nb]
        positions += list(range(length - q_len, length))
    return cache, tables.to(device), torch.tensor(positions, dtype=torch.int64, device=device)


def run_attention(device, dtype, q_len, batch, seed=0, hq=8, hkv=2, d=16, bs=4, blocks=12):
    g = _gen(seed)
    cache, tables, positions = _paged_case(g, device, dtype, q_len, batch, hq=hq, hkv=hkv, d=d, bs=bs, blocks=blocks)
    q = torch.randn((batch * q_len, hq, d), generator=g).to(device, dtype)
    got = _attn().paged_attention(q, cache, tables, positions, q_len, d ** -0.5)
    want = ref.paged_attention(q, cache, tables, positions, q_len, d ** -0.5)
    _close(got, want, dtype)


def _slots(tables, positions, q_len, bs=4):
    """Each step row's cache slot: its position's page in its sequence's table."""
    seq = torch.arange(positions.shape[0], device=positions.device) // q_len
    return tables[seq, positions // bs] * bs + positions % bs


def run_rope_attention(device, dtype, q_len, batch, seed=0, hq=8, hkv=2, d=16, bs=4, blocks=12):
    """RoPE + KV write + attention in one op against the reference (rope_write_kv, then
    paged_attention): the output, and the cache it wrote (the step's k and v at their slots),
    both from unrotated strided q, k, v views as the model passes them."""
    g = _gen(seed)
    cache, tables, positions = _paged_case(g, device, dtype, q_len, batch, hq=hq, hkv=hkv, d=d, bs=bs, blocks=blocks)
    qkv = torch.randn((batch * q_len, (hq + 2 * hkv) * d), generator=g).to(device, dtype)
    q, k, v = (t.view(batch * q_len, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    cos_sin = torch.randn((int(positions.max()) + 1, d), generator=g).to(device)
    slots = _slots(tables, positions, q_len, bs)
    caches = [cache.clone(), cache.clone()]
    got = _attn().rope_paged_attention(q, k, v, cos_sin, positions, caches[0], slots, tables, q_len, d ** -0.5)
    want = ref.rope_paged_attention(q, k, v, cos_sin, positions, caches[1], slots, tables, q_len, d ** -0.5)
    _close(got, want, dtype)
    _close(caches[0], caches[1], dtype)
    assert not torch.equal(caches[0], cache)  # the step's k and v were written
    return got, caches[0]


def run_attention_batch_invariance(device, dtype, q_len=1, first=70):
    """Row 0's attention output (context `first` tokens: several KV splits, or one that
    writes its rows without a merge) is bitwise the same alone, in a batch of 5 with longer
    neighbours, and in a wider block table (a bigger bucket)."""
    g = _gen(7)
    hq, hkv, d, bs = 8, 2, 16, 4
    width = max(40, -(-first // bs) + 10)
    cache = torch.randn((2, 5 * width + 1, bs, hkv, d), generator=g).to(device, dtype)
    tables = (torch.randperm(5 * width, generator=g) + 1).view(5, width).to(device)
    lengths = [first, 150, 3, 99, 160]
    positions = torch.tensor([p for n in lengths for p in range(n - q_len, n)], device=device)
    q = torch.randn((5 * q_len, hq, d), generator=g).to(device, dtype)
    scale = d ** -0.5
    crowd = _attn().paged_attention(q, cache, tables, positions, q_len, scale)[:q_len]
    alone = _attn().paged_attention(q[:q_len], cache, tables[:1, :-(-first // bs) + 2], positions[:q_len], q_len,
                                   scale)
    assert torch.equal(alone, crowd)
    if q_len == 1:  # RoPE + KV write in the kernel: the same row-0 bits alone and in the crowd
        k, v = (torch.randn((5, hkv, d), generator=g).to(device, dtype) for _ in range(2))
        cos_sin = torch.randn((max(lengths), d), generator=g).to(device)
        tables_cpu = tables.cpu()
        slots = torch.tensor([int(tables_cpu[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lengths)],
                             device=device)
        runs = []
        for rows, width in ((5, tables.shape[1]), (1, -(-first // bs) + 2)):
            c = cache.clone()
            runs.append(_attn().rope_paged_attention(q[:rows], k[:rows], v[:rows], cos_sin, positions[:rows], c,
                                                     slots[:rows], tables[:rows, :width], 1, scale)[:1])
        assert torch.equal(runs[0], runs[1])


def _lin():
    from trtgraph.kernels import linear

    return linear


def run_linear(device, dtype, m=5, n=40, k=48, seed=0):
    """The Triton linear (with and without bias; k, n not multiples of the blocks) against torch."""
    g = _gen(seed)
    x = torch.randn((m, k), generator=g).to(device, dtype)
    w = (torch.randn((n, k), generator=g) / k ** 0.5).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    _close(_lin().triton_linear(x, w), ref.linear(x, w), dtype)
    _close(_lin().triton_linear(x, w, bias), ref.linear(x, w, bias), dtype)
    _close(_lin().triton_linear(x.view(m, 1, k), w), ref.linear(x, w).view(m, 1, n), dtype)
    # residual + x @ W.T in one kernel, into the residual's storage: the Triton epilogue, and
    # on the GPU cuBLAS's in-place addmm_ (the two backends linear_residual picks between)
    res = torch.randn((m, n), generator=g).to(device, dtype)
    want = res.float() + ref.linear(x.float(), w.float())
    backends = [None, "cublas"] if device.type == "cuda" else [None]
    for backend in backends:
        lin = _lin()
        saved = dict(lin._BACKENDS)
        if backend:
            lin._BACKENDS[(n, k)] = backend
        try:
            out = res.clone()
            got = lin.linear_residual(x, w, out)
        finally:
            lin._BACKENDS.clear()
            lin._BACKENDS.update(saved)
        assert got.data_ptr() == out.data_ptr()
        _close(got, want, dtype)


def run_linear_batch_invariance(device, dtype, sizes=(1, 3, 8, 17), n=40, k=48):
    """Each row's output is bitwise the same whatever the number of rows around it."""
    g = _gen(1)
    x = torch.randn((max(sizes), k), generator=g).to(device, dtype)
    w = (torch.randn((n, k), generator=g) / k ** 0.5).to(device, dtype)
    full = _lin().triton_linear(x, w)
    for m in sizes:
        assert torch.equal(_lin().triton_linear(x[:m], w), full[:m]), m


CPU = torch.device("cpu")


@needs_triton
@pytest.mark.parametrize("device,dtype", _cases(CPU))
def test_norms(device, dtype):
    run_norms(device, dtype)


@needs_triton
@pytest.mark.parametrize("device,dtype", _cases(CPU))
def test_silu_and_mul(device, dtype):
    run_silu(device, dtype)


@needs_triton
@pytest.mark.parametrize("device,dtype", _cases(CPU))
def test_rope_write_kv(device, dtype):
    run_rope_kv(device, dtype)


@needs_triton
@pytest.mark.parametrize("invariant", [True, False], ids=["fixed-splits", "adaptive-splits"])
@pytest.mark.parametrize("q_len,batch", [(1, 1), (1, 3), (3, 2), (8, 2)])
def test_paged_attention(q_len, batch, invariant):
    """Both split-KV modes (deterministic: true / false) equal the torch reference."""
    from trtgraph.kernels.attention import set_attention_invariant

    set_attention_invariant(invariant)
    try:
        run_attention(CPU, torch.float32, q_len, batch, seed=q_len * 10 + batch)
    finally:
        set_attention_invariant(True)


@needs_triton
@pytest.mark.parametrize("invariant", [True, False], ids=["fixed-splits", "adaptive-splits"])
@pytest.mark.parametrize("q_len,batch", [(1, 1), (1, 3), (3, 2)])
def test_rope_paged_attention(q_len, batch, invariant):
    """RoPE + KV write inside the attention kernel (decode), the two ops otherwise, equal the
    reference op in both split modes."""
    from trtgraph.kernels.attention import set_attention_invariant

    set_attention_invariant(invariant)
    try:
        run_rope_attention(CPU, torch.float32, q_len, batch, seed=q_len * 10 + batch)
    finally:
        set_attention_invariant(True)


@needs_triton
@pytest.mark.parametrize("first", [70, 20], ids=["merged-splits", "one-split"])
def test_paged_attention_is_batch_invariant(first):
    run_attention_batch_invariance(CPU, torch.float32, first=first)


@needs_triton
def test_linear_kernels_match_reference():
    run_linear(CPU, torch.float32)


@needs_triton
def test_linear_kernels_are_batch_invariant():
    run_linear_batch_invariance(CPU, torch.float32)


@needs_triton
def test_model_with_triton_kernels_matches_reference():
    """The whole decoder with the Triton kernel set gives the reference set's logits."""
    from trtgraph.config import Config
    from trtgraph.kernels import get_kernels
    from trtgraph.models import load_model
    from oracle import EagerSequence

    cfg = Config.default()
    outs = []
    for name in ("torch", "triton"):
        lm = load_model(cfg.model, "float32", CPU, 256, get_kernels(name))
        seq = EagerSequence(lm, 64, block_size=16)
        logits = [seq.prefill(list(range(40, 61)), chunk_size=8)]
        logits += [seq.forward([t]) for t in (5, 6)]
        outs.append(torch.cat(logits))
    _close(outs[1], outs[0], torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernels(dtype):
    dev = torch.device("cuda")
    run_norms(dev, dtype)
    run_silu(dev, dtype)
    run_rope_kv(dev, dtype)
    for q_len, batch in ((1, 1), (1, 5), (4, 3), (64, 2)):
        run_attention(dev, dtype, q_len, batch, seed=q_len + batch)
    for q_len, batch in ((1, 1), (1, 7), (1, 64), (3, 2)):
        run_rope_attention(dev, dtype, q_len, batch, seed=q_len + batch)
    from trtgraph.kernels.attention import set_attention_invariant

    llama = dict(hq=32, hkv=8, d=64, bs=16, blocks=40)  # Llama-3.2-1B's heads: each decode config of both modes
    for invariant in (True, False):
        set_attention_invariant(invariant)
        try:
            for batch in (1, 8, 64):
                run_attention(dev, dtype, 1, batch, seed=batch, **llama)
                run_rope_attention(dev, dtype, 1, batch, seed=batch, **llama)
        finally:
            set_attention_invariant(True)
    run_linear(dev, dtype, m=70, n=3072, k=2048)  # more rows than one block
    run_linear(dev, dtype, m=3, n=300, k=200)  # ragged edges
    for first in (70, 700):  # one KV split on the GPU (256-token pieces), and three merged
        run_attention_batch_invariance(dev, dtype, first=first)
    run_linear_batch_invariance(dev, dtype, sizes=(1, 2, 3, 8, 17, 64, 65, 200, 2048), n=2048, k=8192)
    from trtgraph.kernels import sampler_reference as sampler

    seeds, positions = torch.arange(7, device=dev) * 977, torch.arange(7, device=dev) + 100
    ids = torch.stack([torch.randperm(50000, device=dev) for _ in range(7)])
    want = -torch.log(-torch.log(sampler._uniform_at(sampler.row_hash(seeds, positions), ids)))
    torch.testing.assert_close(_tri().gumbel_noise(sampler.row_hash(seeds, positions), ids), want,
                               rtol=1e-5, atol=1e-5)


@needs_triton
def test_gumbel_noise_kernel_matches_the_sampler_hash():
    """The fused Triton noise computes the torch sampler's bits (identical uniforms; the
    logs agree to rounding)."""
    from trtgraph.kernels import sampler_reference as sampler

    g = torch.Generator().manual_seed(3)
    seeds = torch.randint(0, 2**62, (5,), generator=g)
    positions = torch.randint(0, 4096, (5,), generator=g)
    ids = torch.stack([torch.randperm(3000, generator=g) for _ in range(5)])
    got = _tri().gumbel_noise(sampler.row_hash(seeds, positions), ids)
    want = -torch.log(-torch.log(sampler.uniform_noise(seeds, positions, 3000).gather(1, ids)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    from trtgraph.kernels import get_kernels

    # chosen once, with its kernel set: `kernels: torch` runs the reference wherever it runs
    assert get_kernels("triton").gumbel_noise is _tri().gumbel_noise
    torch.testing.assert_close(get_kernels("torch").gumbel_noise(sampler.row_hash(seeds, positions), ids), want,
                               rtol=1e-6, atol=1e-6)


def test_deterministic_is_a_checked_boolean_and_cpu_gemms_stay_triton():
    """`deterministic` must be a boolean; off a GPU every GEMM shape keeps the Triton kernel."""
    from trtgraph.config import Config
    from trtgraph.errors import ConfigError
    from trtgraph.kernels import linear

    d = Config.default().to_dict()
    assert d["deterministic"] is False
    with pytest.raises(ConfigError, match="deterministic"):
        Config.from_dict({**d, "deterministic": "yes"})
    assert linear.choose_backends({(40, 48): [1, 3]}, torch.float32, CPU, True) == {"40x48": "triton"}
    assert linear.choose_backends({(40, 48): [1, 3]}, torch.float32, CPU, False) == {"40x48": "triton"}


def test_rope_runs_in_attention_exactly_where_the_qkv_is_not_one_fused_kernel():
    """The Triton set's choice per step (shapes only): decode steps past the fused qkv's rows,
    or of a shape the build left composed, or with Qwen3's q/k norms, rotate inside attention;
    steps the fused qkv takes (it writes the cache in its epilogue) and q > 1 steps do not. The
    torch set takes the one op at every decode step."""
    from trtgraph.kernels import _rope_in_attention, decode_linear as dl, get_kernels
    from trtgraph.kernels.composed import QKVHeads

    w, plain = torch.empty(3072, 2048), QKVHeads(32, 8, 64)
    normed = QKVHeads(32, 8, 64, torch.ones(64), torch.ones(64), 1e-6)
    saved = dict(dl._CHOICE)
    try:
        dl._CHOICE.clear()
        dl._CHOICE[("norm_qkv_rope", 3072, 2048)] = dl.FUSED
        top = dl.max_rows("norm_qkv_rope", 3072, 2048)
        assert not _rope_in_attention(w, 1, 1, plain) and not _rope_in_attention(w, top, 1, plain)
        assert _rope_in_attention(w, top + 1, 1, plain) and _rope_in_attention(w, 1, 1, normed)
        assert not _rope_in_attention(w, top + 2, 2, plain)  # verification rows: rope_write_kv, then attention
        dl._CHOICE[("norm_qkv_rope", 3072, 2048)] = dl.COMPOSED
        assert _rope_in_attention(w, 1, 1, plain)
    finally:
        dl._CHOICE.clear()
        dl._CHOICE.update(saved)
    ref_set = get_kernels("torch")
    assert ref_set.rope_in_attention(w, 64, 1, plain) and not ref_set.rope_in_attention(w, 4, 2, plain)
