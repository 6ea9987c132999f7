"""The split down projection (kernels/split_residual.py: partial products over K slices, then one
kernel summing them with the residual and taking the next layer's RMSNorm) against the composition
of the references, under TRITON_INTERPRET=1 on the CPU and on the GPU; its dispatch, its choice and
the manifest's record of it; and the model's hoisted norms (each decode layer's tail takes the next
layer's norm) against the unhoisted forward."""

import pytest
import torch

from trtgraph.kernels import composed, get_kernels, reference
from trtgraph.kernels import split_residual as sr
from trtgraph.kernels import triton_ops

REF = composed.compose(reference.rms_norm, reference.linear, reference.silu_and_mul, reference.rope_write_kv)
BF16 = torch.bfloat16


def _case(T, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, k), generator=g).to(device, dtype)
    w = (torch.randn((n, k), generator=g) / k ** 0.5).to(device, dtype)
    r = torch.randn((T, n), generator=g).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dtype)
    return x, w, r, nw


@pytest.mark.parametrize("T,splits", [(1, 2), (5, 4), (40, 4), (7, 1)])
def test_sum_add_norm_is_the_slice_order_sum_then_the_norm_kernel(T, splits):
    """The residual is residual + (p_0 + p_1 + ...) rounded once, in slice order, and the normed
    output is triton_ops.rms_norm of that residual, bit for bit; both near the references."""
    x, w, r, nw = _case(T, 24, 64, torch.float32, "cpu", seed=T)
    parts = sr.partials(x, w, splits)
    acc = torch.zeros(T, 24)
    for p in parts:
        acc = acc + p
    want_h = r + acc
    h, normed = sr.split_linear_residual_norm(x, w, r.clone(), nw, 1e-5, splits=splits)
    assert torch.equal(h, want_h)
    assert torch.equal(normed, triton_ops.rms_norm(want_h, nw, 1e-5))
    ref_h, ref_n = REF.linear_residual_norm(x, w, r.clone(), nw, 1e-5)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, ref_n, atol=1e-5, rtol=1e-5)


def test_the_result_is_written_into_the_residual():
    x, w, r, nw = _case(3, 24, 64, torch.float32, "cpu")
    h, _ = sr.split_linear_residual_norm(x, w, r, nw, 1e-5, splits=2)
    assert h.data_ptr() == r.data_ptr()


def test_partials_are_views_of_one_gemm_per_slice():
    x, w, _, _ = _case(6, 24, 64, torch.float32, "cpu")
    parts = sr.partials(x, w, 4)
    assert parts.shape == (4, 6, 24)
    for s in range(4):
        torch.testing.assert_close(parts[s], x[:, 16 * s:16 * (s + 1)] @ w[:, 16 * s:16 * (s + 1)].t())


def test_dispatch_runs_the_split_only_where_installed_and_in_its_band(monkeypatch):
    calls = []
    monkeypatch.setattr(sr, "split_linear_residual_norm", lambda *a, **k: calls.append(a[0].shape[0]) or (a[2], a[2]))
    monkeypatch.setattr(sr, "_SPLITS", {(24, 64): (4, 17)})
    ops = sr.with_split(REF, reference.rms_norm)
    for T in (1, 16, 17, 32, 33, 48, 64, 65, 128):
        x, w, r, nw = _case(T, 24, 64, torch.float32, "cpu")
        h, normed = ops.linear_residual_norm(x, w, r.clone(), nw, 1e-5)
        if not 17 <= T <= 64:  # the composition: the references' rounding
            want = REF.linear_residual_norm(x, w, r.clone(), nw, 1e-5)
            assert torch.equal(h, want[0]) and torch.equal(normed, want[1])
    assert calls == [17, 32, 33, 48, 64]
    x, w, r, nw = _case(40, 24, 32, torch.float32, "cpu")  # a shape not installed
    ops.linear_residual_norm(x, w, r, nw, 1e-5)
    monkeypatch.setattr(sr, "_SPLITS", {(24, 64): (4, 33)})  # the narrower band: 17-32 rows composed
    for T in (17, 32, 33):
        x, w, r, nw = _case(T, 24, 64, torch.float32, "cpu")
        ops.linear_residual_norm(x, w, r.clone(), nw, 1e-5)
    assert calls == [17, 32, 33, 48, 64, 33]


@pytest.mark.parametrize("why", ["cpu", "deterministic", "tensor_parallel", "fp32", "not_cublas", "no_table",
                                 "no_rows"])
def test_the_split_is_not_installed_off_its_conditions(monkeypatch, why):
    monkeypatch.setattr(sr, "split_is_invariant", lambda *a: True)
    args = dict(down_shape=(2048, 8192), row_counts=[1, 40, 64, 512], cublas=lambda m: True,
                device=torch.device("cuda"), deterministic=False, tensor_parallel=False, dtype=BF16)
    assert sr.choose_split(**args) == {"linear_residual_norm:2048x8192": "split4:17-64"}
    change = {"cpu": dict(device=torch.device("cpu")), "deterministic": dict(deterministic=True),
              "tensor_parallel": dict(tensor_parallel=True), "fp32": dict(dtype=torch.float32),
              "not_cublas": dict(cublas=lambda m: False), "no_table": dict(down_shape=(2048, 4096)),
              "no_rows": dict(row_counts=[1, 8, 16, 512])}[why]
    assert sr.choose_split(**{**args, **change}) == {} and sr.installed_split() == {}


def test_a_shape_whose_partials_differ_by_row_count_is_not_installed(monkeypatch):
    monkeypatch.setattr(sr, "split_is_invariant", lambda *a: False)
    assert sr.choose_split((2048, 8192), [40, 64], lambda m: True, torch.device("cuda"), False, False, BF16) == {}


def test_the_split_takes_the_narrower_band_where_the_wider_one_is_not_invariant(monkeypatch):
    """cuBLAS may round the partials of 17-32 rows otherwise than those of 33-64: then the split serves
    33-64 only (the 17-32-row steps keep the composition), probed over the plan's rows in each band."""
    probed = []

    def invariant(n, k, splits, counts, dtype, device):
        probed.append(counts)
        return min(counts) >= 33

    monkeypatch.setattr(sr, "split_is_invariant", invariant)
    args = ((2048, 8192), [1, 16, 24, 32, 40, 64, 512], lambda m: True, torch.device("cuda"), False, False, BF16)
    assert sr.choose_split(*args) == {"linear_residual_norm:2048x8192": "split4:33-64"}
    assert probed == [[24, 32, 40, 64], [40, 64]]
    assert [sr.runs_split(torch.zeros(2048, 8192), T) for T in (24, 32, 33, 64, 65)] == [False, False, True, True,
                                                                                        False]
    probed.clear()  # rows in 33-64 only: one probe, and the band is the wider one
    assert sr.choose_split((2048, 8192), [1, 40, 64], *args[2:]) == {"linear_residual_norm:2048x8192": "split4:17-64"}
    assert probed == [[40, 64]]
    probed.clear()
    monkeypatch.setattr(sr, "split_is_invariant", lambda *a: probed.append(a[3]) or False)
    assert sr.choose_split(*args) == {} and probed == [[24, 32, 40, 64], [40, 64]]
    # the down GEMM on Triton at 24 rows (linear's timed record "cublas+triton:24"): the 17-64 band is not
    # cuBLAS's everywhere, so not even probed; 33-64 is
    probed.clear()
    monkeypatch.setattr(sr, "_SPLITS", {})  # (what this installs is undone after the test)
    monkeypatch.setattr(sr, "split_is_invariant", lambda *a: probed.append(a[3]) or True)
    assert sr.choose_split(args[0], args[1], lambda m: m != 24, *args[3:]) == {
        "linear_residual_norm:2048x8192": "split4:33-64"}
    assert probed == [[40, 64]]


def test_the_manifest_schema_takes_the_split_record_and_refuses_others():
    import inspect
    import re

    from trtgraph import manifest_schema
    src = inspect.getsource(manifest_schema.check_totals)
    pattern = re.search(r're\.fullmatch\(r"(composed[^"]*)"\s*r"([^"]*)", b\)', src)
    value = re.compile(pattern.group(1) + pattern.group(2))
    assert value.fullmatch("split4:33-64") and value.fullmatch("fused<=64+light<=1")
    assert not value.fullmatch("split:33-64") and not value.fullmatch("split4") and not value.fullmatch("splitx")


def test_layer_tail_norm_is_the_tail_then_the_norm():
    g = torch.Generator().manual_seed(3)
    T, H, ko, inter = 5, 16, 16, 24
    a, h = torch.randn((T, ko), generator=g), torch.randn((T, H), generator=g)
    wo, wgu, wd = (torch.randn(s, generator=g) / 4 for s in ((H, ko), (2 * inter, H), (H, inter)))
    nw, nxt = torch.rand(H, generator=g) + 0.5, torch.rand(H, generator=g) + 0.5
    want = REF.layer_tail(a, wo, h.clone(), nw, 1e-5, wgu, wd)
    got, normed = REF.layer_tail_norm(a, wo, h.clone(), nw, 1e-5, wgu, wd, nxt, 1e-6)
    assert torch.equal(got, want) and torch.equal(normed, reference.rms_norm(want, nxt, 1e-6))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_hoisted_norms_give_the_unhoisted_forward_bit_for_bit(kernels):
    """A decode forward of 3 rows whose tails take the next layers' norms (rope_in_attention holds
    at decode steps off the GPU) equals the forward where each qkv norms its own input, bit for bit."""
    from conftest import tiny_config
    from trtgraph.models.loader import load_model
    from trtgraph.runtime.step.kv_cache import allocate_kv_caches
    from trtgraph.runtime.step.metadata import AttentionMetadata

    cfg = tiny_config()
    model = load_model(cfg.model, "float32", torch.device("cpu"), 64, get_kernels(kernels)).model
    T, bs = 3, 16
    kv = allocate_kv_caches(model.local, 8, bs, torch.float32, torch.device("cpu"))
    for c in kv:
        c.normal_()
    table = torch.tensor([[1, 2], [3, 4], [5, 6]])
    pos = torch.tensor([5, 17, 30])
    meta = AttentionMetadata(q_len=1, batch_size=T, slot_mapping=table[torch.arange(T), pos // bs] * bs + pos % bs,
                             block_tables=table, kv_caches=kv)
    saved = [c.clone() for c in kv]
    ids = torch.tensor([3, 5, 7])
    with torch.inference_mode():
        assert model.ops.rope_in_attention(model.layers[0].self_attn.qkv_proj.weight, T, 1,
                                           model.layers[0].self_attn.heads())
        hoisted, final = model.forward_normed(ids, pos, meta)
        logits = model.compute_logits(hoisted, final)
        after = [c.clone() for c in kv]
        for c, s in zip(kv, saved):
            c.copy_(s)
        h = model.embed(ids)
        for layer, cache in zip(model.layers, kv):
            h, normed = layer(h, None, None, pos, model.cos_sin, cache, meta, model.ops)
            assert normed is None
        want = model.compute_logits(h)
    assert torch.equal(hoisted, h) and torch.equal(logits, want)
    assert all(torch.equal(a, c) for a, c in zip(after, kv))


@pytest.mark.parametrize("T", [1, 5])
def test_embed_norm_kernel_is_the_lookup_then_the_norm_kernel(T):
    g = torch.Generator().manual_seed(T)
    table, nw = torch.randn((50, 24), generator=g), torch.rand(24, generator=g) + 0.5
    ids = torch.randint(0, 50, (T,), generator=g)
    h, normed = triton_ops.embed_norm(ids, table, nw, 1e-5)
    assert torch.equal(h, table[ids]) and torch.equal(normed, triton_ops.rms_norm(table[ids], nw, 1e-5))
    ref = reference.embed_norm(ids, table, nw, 1e-5)
    assert torch.equal(ref[0], h)
    torch.testing.assert_close(ref[1], normed, atol=1e-6, rtol=1e-6)


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
def test_split_down_gpu_matches_the_composition_and_is_row_invariant(monkeypatch):
    """The 1B down shape in bf16 at 17-64 rows: near addmm_ + the norm kernel, row 0 bitwise the
    same at every row count of the band choose_split installs, and a CUDA graph of it replays the
    eager result."""
    dev = _gpu()
    x, w, r, nw = _case(64, 2048, 8192, BF16, dev, seed=1)
    h, normed = sr.split_linear_residual_norm(x, w, r.clone(), nw, 1e-5, splits=4)
    ref_h = r.clone().addmm_(x, w.t())
    torch.testing.assert_close(h.float(), ref_h.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(normed.float(), triton_ops.rms_norm(h, nw, 1e-5).float(), atol=0, rtol=0)
    # the band choose_split installs for a plan of every row count in 17-64 (33-64 where cuBLAS rounds
    # the partials of fewer rows otherwise): row 0 bitwise the same at every row count of it
    monkeypatch.setattr(sr, "_SPLITS", {})  # restored after the test
    assert sr.choose_split((2048, 8192), list(range(1, 65)), lambda m: True, dev, False, False, BF16)
    lo = sr._SPLITS[(2048, 8192)][1]
    assert lo in (17, 33)
    for T in range(lo, 65):
        hT, nT = sr.split_linear_residual_norm(x[:T].contiguous(), w, r[:T].clone(), nw, 1e-5, splits=4)
        assert torch.equal(hT, h[:T]) and torch.equal(nT, normed[:T]), T
    res = r.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sr.split_linear_residual_norm(x, w, res, nw, 1e-5, splits=4)
    for _ in range(2):
        res.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], h) and torch.equal(out[1], normed)


@pytest.mark.gpu
def test_embed_norm_gpu_is_the_lookup_then_the_norm_kernel():
    dev = _gpu()
    g = torch.Generator().manual_seed(5)
    table = torch.randn((128256, 2048), generator=g).to(dev, BF16)
    nw = (torch.rand(2048, generator=g) + 0.5).to(dev, BF16)
    ids = torch.randint(0, 128256, (64,), generator=g).to(dev)
    h, normed = triton_ops.embed_norm(ids, table, nw, 1e-5)
    assert torch.equal(h, table[ids]) and torch.equal(normed, triton_ops.rms_norm(table[ids], nw, 1e-5))

