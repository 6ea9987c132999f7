"""The fused decode GEMVs (kernels/decode_linear.py) against the composition of the torch
references (kernels/composed.py), under TRITON_INTERPRET=1 on the CPU and on the GPU."""

import pytest
import torch

from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels import decode_occupancy as occ
from trtgraph.kernels import reference
from trtgraph.kernels.composed import QKVHeads, compose

REF = compose(reference.rms_norm, reference.linear, reference.silu_and_mul, reference.rope_write_kv)


def _inputs(T, K, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, K), generator=g).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(device, dtype)
    return g, x, nw


def _weight(g, n, k, dtype, device):
    return (torch.randn((n, k), generator=g) / k ** 0.5).to(device, dtype)


def _rope_case(g, T, heads, dtype, device, num_blocks=32, block_size=4, max_pos=64):
    D = heads.head_dim
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1).to(device)
    positions = torch.randint(0, max_pos, (T,), generator=g).to(device)
    slots = (torch.randperm(num_blocks * block_size - block_size, generator=g)[:T] + block_size).to(device)
    cache = torch.zeros((2, num_blocks, block_size, heads.num_kv_heads, D), dtype=dtype, device=device)
    return cos_sin, positions, cache, slots


def _close(got, want, dtype):
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def _check_all(T, dtype, device, shapes, bias, seed=0):
    """Each fused op against the references: shapes = (H, I, V, heads)."""
    H, inter, V, heads = shapes
    g, x, nw = _inputs(T, H, dtype, device, seed)
    eps = 1e-5
    # LM head: fp32 logits (and a bf16 output when asked)
    w = _weight(g, V, H, dtype, device)
    b = (0.1 * torch.randn(V, generator=g)).to(device, dtype) if bias else None
    _close(dl.norm_linear(x, nw, eps, w, b, torch.float32), REF.norm_linear(x, nw, eps, w, b, torch.float32), dtype)
    _close(dl.norm_linear(x, nw, eps, w, b), REF.norm_linear(x, nw, eps, w, b), dtype)
    # the greedy LM head: the same logits, the argmax from its epilogue (twice: the maxima reset themselves)
    for _ in range(2):
        tokens = torch.full((T,), -7, dtype=torch.int64, device=device)
        logits = dl.norm_linear_argmax(x, nw, eps, w, tokens)
        _close(logits, REF.norm_linear(x, nw, eps, w, None, torch.float32), dtype)
        assert torch.equal(tokens, logits.argmax(dim=-1))
        # a greedy step's head: the same tokens, no logits (the kernel stores none: MODE -2)
        only = torch.full((T,), -7, dtype=torch.int64, device=device)
        assert dl.norm_linear_argmax(x, nw, eps, w, only, store=False) is None
        assert torch.equal(only, tokens)
    # gate_up + SiLU-and-mul
    w = _weight(g, 2 * inter, H, dtype, device)
    _close(dl.norm_gate_up_silu(x, nw, eps, w), REF.norm_gate_up_silu(x, nw, eps, w), dtype)
    # down + residual (the fused op writes into the residual's storage: pass a copy)
    act = torch.randn((T, inter), generator=g).to(device, dtype)
    w = _weight(g, H, inter, dtype, device)
    want = REF.linear_residual(act, w, x)
    res = x.clone()
    got = dl.linear_residual(act, w, res)
    _close(got, want, dtype)
    assert got.data_ptr() == res.data_ptr()
    # qkv + RoPE + KV write
    n_qkv = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    w = _weight(g, n_qkv, H, dtype, device)
    b = (0.1 * torch.randn(n_qkv, generator=g)).to(device, dtype) if bias else None
    cos_sin, positions, cache, slots = _rope_case(g, T, heads, dtype, device)
    ref_cache = cache.clone()
    want = REF.norm_qkv_rope(x, nw, eps, w, b, heads, cos_sin, positions, ref_cache, slots)
    got = dl.norm_qkv_rope(x, nw, eps, w, b, heads, cos_sin, positions, cache, slots)
    _close(got, want, dtype)
    _close(cache, ref_cache, dtype)


TINY = (48, 40, 72, QKVHeads(4, 2, 8))  # hidden 48, intermediate 40, vocabulary 72, 4 q / 2 kv heads of 8


@pytest.mark.parametrize("split,stack", [(1, False), (3, False), (1, True), (3, True)])
@pytest.mark.parametrize("T,row_tiles", [(1, (16, 32, 64)), (3, (16, 32, 64)), (17, (16, 32, 64)),
                                         (40, (16, 32, 64)), (70, (16, 32, 64)), (40, None)])
def test_fused_ops_match_the_references(monkeypatch, T, row_tiles, split, stack, prenorm=False):
    """Every fused op, with split-K 1 and 3, paired rows in two tiles or stacked in one, row
    tiles of 16 / 32 / 64 and several m-tiles (70 rows in 64-row tiles; 40 rows in 16-row
    tiles), columns not a multiple of BLOCK_N (fp32: the interpreter's dot is exact enough for 1e-4)."""
    tuned = {}
    for n, k in ((72, 48), (80, 48), (48, 40), (64, 48)):  # lm head, gate_up, down, qkv
        tuned[(n, k)] = (16, 16, split, 1, 1, stack, prenorm)
    tuned[(64, 48)] = (32, 16, split, 1, 1, stack, prenorm)  # qkv: 32 pairs of 8 heads x 4 in full tiles (unmasked)
    monkeypatch.setattr(dl, "_TUNED", tuned)
    monkeypatch.setattr(dl, "_ROW_TILES", row_tiles)
    _check_all(T, torch.float32, torch.device("cpu"), TINY, bias=T % 2 == 1, seed=T)


@pytest.mark.parametrize("T,split", [(3, 1), (40, 3)])
def test_fused_ops_with_prenorm_match_the_references(monkeypatch, T, split):
    """PRENORM configs (x normed by the row pass, rstd applied in the epilogue) on the three
    RMSNorm ops: the same results as the references."""
    test_fused_ops_match_the_references(monkeypatch, T, (16, 32, 64), split, True, prenorm=True)


@pytest.mark.parametrize("T,split", [(1, 1), (5, 3), (70, 1)])
def test_fused_argmax_takes_the_first_maximum_and_nan(monkeypatch, T, split):
    """The LM head's epilogue argmax is torch.argmax's: on ties the first column (a weight row
    repeated past the first N-tile), a NaN above every number (its first column), -0.0 == +0.0;
    every m-tile's rows (70 rows in 16-row tiles), with split-K, launch after launch."""
    monkeypatch.setattr(dl, "_TUNED", {(72, 48): (16, 16, split, 1, 1)})
    monkeypatch.setattr(dl, "_ROW_TILES", (16, 32, 64))
    g, x, nw = _inputs(T, 48, torch.float32, torch.device("cpu"), seed=T)
    w = _weight(g, 72, 48, torch.float32, "cpu")
    w[40] = w[3] = w[60]  # ties across N-tiles: column 3 first
    w[3] *= 50
    w[40] *= 50
    w[60] *= 50
    for nan in (False, True):
        if nan:
            w[66, 0], w[70, 0] = float("nan"), float("nan")  # NaN logits in every row: column 66 first
        tokens = torch.empty(T, dtype=torch.int64)
        logits = dl.norm_linear_argmax(x, nw, 1e-5, w, tokens)
        want = logits.argmax(dim=-1)
        assert torch.equal(tokens, want)
        assert (want == 66).all() if nan else True
    zeros = torch.zeros(T, 48)  # every logit +-0.0: column 0
    tokens = torch.empty(T, dtype=torch.int64)
    dl.norm_linear_argmax(zeros, nw, 1e-5, -w.nan_to_num(), tokens)
    assert (tokens == 0).all()


@pytest.mark.parametrize("T", [1, 33])
def test_fused_argmax_over_many_tiles(monkeypatch, T):
    """38 N-tiles: ties between distant tiles go to the first column, a maximum in the last
    (short) tile counts, and the running maxima and the m-tile's counter are back at rest (-1, 0)
    after every launch, so the next launch, on other weights, is exact too."""
    from trtgraph.kernels import triton_ops

    monkeypatch.setattr(dl, "_TUNED", {(600, 48): (16, 16, 1, 1, 1)})
    monkeypatch.setattr(dl, "_ROW_TILES", (16, 32, 64))
    g, x, nw = _inputs(T, 48, torch.float32, torch.device("cpu"), seed=7)
    for tied in ((3, 400, 590), (599, 37), (200,)):
        w = _weight(g, 600, 48, torch.float32, "cpu")
        for c in tied:  # row 0's largest logit, in every tied column
            w[c] = 40 * x[0] * nw / (x[0] * nw).norm()
        tokens = torch.empty(T, dtype=torch.int64)
        logits = dl.norm_linear_argmax(x, nw, 1e-5, w, tokens)
        assert torch.equal(tokens, logits.argmax(dim=-1))
        assert tokens[0] == min(tied)
        assert (triton_ops.argmax_best(T, x.device) == -1).all()
        assert (triton_ops.arrival_counters(38 + 1, x.device)[38:] == 0).all()


def _light_tables(monkeypatch, split, block_k=16, light_rows=(72, 80, 48, 64)):
    """Light configs for TINY's shapes (tensor-core configs for the rows past LIGHT_MAX_ROWS)."""
    tuned = {(n, k): (16, 16, 1, 1, 1) for n, k in ((72, 48), (80, 48), (48, 40), (64, 48))}
    light = {(72, 48): (16, block_k, split, 1), (80, 48): (8, block_k, split, 1), (48, 40): (16, block_k, split, 1),
             (64, 48): (8, block_k, split, 1)}  # qkv 32 pairs: full 8-pair tiles (EVEN when K divides)
    monkeypatch.setattr(dl, "_TUNED", tuned)
    monkeypatch.setattr(dl, "_LIGHT_TUNED", light)
    monkeypatch.setattr(dl, "_LIGHT_ON", {(n, 48 if n != 48 else 40) for n in light_rows})


@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("split,block_k", [(1, 16), (3, 16), (1, 8), (2, 64)])
def test_light_ops_match_the_references(monkeypatch, T, split, block_k):
    """The light CUDA-core kernel (kernels/decode_light.py) for every fused op at one row: split-K
    1, 2 and 3, K tiles that divide the split (EVEN: the next tile's loads ahead) or not (masked),
    columns not a multiple of BLOCK_N; 2 and 3 rows take the tensor-core kernel."""
    _light_tables(monkeypatch, split, block_k)
    _check_all(T, torch.float32, torch.device("cpu"), TINY, bias=T % 2 == 1, seed=T)


def test_light_serves_one_row_only(monkeypatch):
    """Steps of one row take the light kernel, of two the tensor-core one."""
    _light_tables(monkeypatch, 1)
    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]
    monkeypatch.setattr(dl, "_light_kernel", Spy("light", dl._light_kernel))
    monkeypatch.setattr(dl, "_decode_kernel", Spy("tensor-core", dl._decode_kernel))
    g, x, nw = _inputs(2, 48, torch.float32, torch.device("cpu"))
    w = _weight(g, 72, 48, torch.float32, "cpu")
    for T in (1, 2):
        dl.norm_linear(x[:T], nw, 1e-5, w)
    assert launched == ["light", "tensor-core"]


def test_light_choice(monkeypatch):
    """choose_fused installs the light kernel for decode_tuned.LIGHT's shapes: with `deterministic`
    only where the plan never runs more than LIGHT_MAX_ROWS rows (one path for every T), and the
    manifest's name says so."""
    monkeypatch.setattr(dl, "_LIGHT_TUNED", {(64, 32): (8, 32, 1, 1)})
    monkeypatch.setattr(dl, "_SLOWER", set())
    cuda = torch.device("cuda")
    shapes = [("linear_residual", 64, 32), ("linear_residual", 32, 32)]
    got = dl.choose_fused(shapes, {(64, 32): [1, 8, 16], (32, 32): [1]}, cuda, False, False, dtype=torch.bfloat16)
    assert got == {"linear_residual:64x32": "fused<=16+light<=1", "linear_residual:32x32": "fused<=16"}
    assert dl._LIGHT_ON == {(64, 32)}
    got = dl.choose_fused(shapes, {(64, 32): [1, 2], (32, 32): [1]}, cuda, True, False, dtype=torch.bfloat16)
    assert got["linear_residual:64x32"] == "fused" and not dl._LIGHT_ON
    got = dl.choose_fused(shapes, {(64, 32): [1], (32, 32): [1]}, cuda, True, False, dtype=torch.bfloat16)
    assert got["linear_residual:64x32"] == "fused+light<=1" and dl._LIGHT_ON == {(64, 32)}
    got = dl.choose_fused(shapes, {(64, 32): [1]}, cuda, False, True, dtype=torch.bfloat16)  # tensor parallel
    assert got["linear_residual:64x32"] == "composed" and not dl._LIGHT_ON
    dl._LIGHT_ON.clear()


def test_manifest_accepts_every_recorded_choice(monkeypatch, tmp_path):
    """Every name installed_choice() records (fused<=16, fused<=64, either with +light<=1) is a valid
    totals.fused_ops value, so the manifest a capture with the light kernel writes loads (the
    H200 capture at e7f51a9 wrote "fused+light<=1" and `run` refused its own manifest); an
    unknown name is still refused with "Recapture"."""
    from trtgraph.errors import ManifestError
    from trtgraph.manifest_schema import FieldReader, check_totals

    monkeypatch.setattr(dl, "_LIGHT_TUNED", {(64, 32): (8, 32, 1, 1), (72, 48): (8, 16, 1, 1)})
    monkeypatch.setattr(dl, "_SLOWER", set())
    monkeypatch.setattr(dl, "_WIDE", {("norm_linear", 72, 48)})
    shapes = [("linear_residual", 64, 32), ("norm_linear", 72, 48), ("linear_residual", 32, 32)]
    got = dl.choose_fused(shapes, {}, torch.device("cuda"), False, False, dtype=torch.bfloat16)
    dl._LIGHT_ON.clear()
    assert sorted(got.values()) == ["fused<=16", "fused<=16+light<=1", "fused<=64+light<=1"]
    v = FieldReader(tmp_path / "manifest.json", "Recapture.")
    totals = {"num_keys": 1, "warmup_seconds": 0.5, "capture_seconds": 0.5, "pool_bytes": 0,
              "largest_key_pool_bytes": 0, "fused_ops": got}
    check_totals(v, totals, [0])
    with pytest.raises(ManifestError, match=r"totals.fused_ops .*Recapture"):
        check_totals(v, {**totals, "fused_ops": {"norm_linear:72x48": "fused+heavy<=1"}}, [0])


def test_prenorm_row_pass_does_not_depend_on_the_rows_beside():
    """The row pass's output for row 0 is bitwise the same alone and among 40 rows."""
    g, x, nw = _inputs(40, 48, torch.float32, torch.device("cpu"))
    xs1, rs1 = dl._prenorm(x[:1], nw, 1e-5)
    xs, rs = dl._prenorm(x, nw, 1e-5)
    assert torch.equal(xs1[0], xs[0]) and torch.equal(rs1[0], rs[0])
    torch.testing.assert_close(rs, torch.rsqrt(x.pow(2).mean(-1) + 1e-5))
    torch.testing.assert_close(xs, x * nw)


def test_row_tiles():
    assert [dl.row_tile(t) for t in (1, 16, 17, 32, 33, 64, 65, 500)] == [16, 16, 32, 32, 64, 64, 64, 64]


def test_default_config_splits_and_is_row_count_free():
    """The untuned config: a function of (N, K, device) only; the interpreter's default splits K."""
    cpu = torch.device("cpu")
    assert dl.decode_config(40, 96, cpu).split_k == 2 and dl.decode_config(40, 48, cpu).split_k == 1
    cuda = torch.device("cuda")
    assert dl.decode_config(4096, 14336, cuda).split_k > 1  # Llama-3.1-8B's down, not in the H200 table
    assert dl.decode_config(128256, 4096, cuda).split_k == 1


BF16 = torch.bfloat16


def test_choice_and_dispatch(monkeypatch):
    """choose_fused: CUDA only, never with tensor parallelism, and with `deterministic` only for
    shapes whose plan never runs more than max_rows (DETERMINISTIC_MAX_ROWS there, FUSED_MAX_ROWS
    without it; WIDE_MAX_ROWS for the WIDE shapes) rows; dispatch runs the chosen path for steps of
    at most that many rows."""
    shapes = [("norm_linear", 72, 48), ("linear_residual", 48, 40)]
    counts = {(72, 48): [1, 8, dl.FUSED_MAX_ROWS], (48, 40): [1, 8, dl.FUSED_MAX_ROWS + 1]}
    # `deterministic` keeps the fused kernels up to DETERMINISTIC_MAX_ROWS (no split, no hoisted norms there)
    det = {(72, 48): [1, 8, dl.DETERMINISTIC_MAX_ROWS], (48, 40): [1, 8, dl.DETERMINISTIC_MAX_ROWS + 1]}
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert dl.choose_fused(shapes, counts, cpu, False, False, dtype=BF16) == {"linear_residual:48x40": "composed",
                                                                  "norm_linear:72x48": "composed"}
    assert dl.choose_fused(shapes, counts, cuda, False, True, dtype=BF16) == {"linear_residual:48x40": "composed",
                                                                  "norm_linear:72x48": "composed"}
    assert dl.choose_fused(shapes, det, cuda, True, False, dtype=BF16) == {"linear_residual:48x40": "composed",
                                                               "norm_linear:72x48": "fused"}
    assert dl.max_rows("norm_linear", 72, 48) == dl.DETERMINISTIC_MAX_ROWS
    assert dl.choose_fused(shapes, counts, cuda, False, False, dtype=BF16) == {"linear_residual:48x40": "fused<=16",
                                                                   "norm_linear:72x48": "fused<=16"}
    calls = []
    composed = REF._replace(norm_linear=lambda *a: calls.append("composed"))
    monkeypatch.setattr(dl, "FUSED_OPS", REF._replace(norm_linear=lambda *a: calls.append("fused")))
    ops = dl.dispatch(composed)
    w = torch.zeros(72, 48)
    ops.norm_linear(torch.zeros(dl.FUSED_MAX_ROWS, 48), None, 0.0, w)
    ops.norm_linear(torch.zeros(dl.FUSED_MAX_ROWS + 1, 48), None, 0.0, w)
    ops.norm_linear(torch.zeros(1, 48), None, 0.0, torch.zeros(73, 48))
    assert calls == ["fused", "composed", "composed"]
    assert dl.choose_fused([("norm_qkv_rope", 72, 48)], counts, cuda, False, False, qk_norm=True, dtype=BF16) == {
        "norm_qkv_rope:72x48": "composed"}
    assert dl.choose_fused(shapes, counts, cuda, False, False, dtype=torch.float32) == {  # fp32: untuned
        "linear_residual:48x40": "composed", "norm_linear:72x48": "composed"}
    # a WIDE shape (fused faster at 40-64 rows too): fused up to 64 rows, also with `deterministic`
    monkeypatch.setattr(dl, "_WIDE", {("norm_linear", 72, 48)})
    wide = {(72, 48): [1, 8, dl.WIDE_MAX_ROWS], (48, 40): [1, 8, dl.WIDE_MAX_ROWS]}
    assert dl.choose_fused(shapes, wide, cuda, True, False, dtype=BF16) == {"linear_residual:48x40": "composed",
                                                                "norm_linear:72x48": "fused<=64"}
    calls.clear()
    ops.norm_linear(torch.zeros(dl.WIDE_MAX_ROWS, 48), None, 0.0, w)
    ops.norm_linear(torch.zeros(dl.WIDE_MAX_ROWS + 1, 48), None, 0.0, w)
    assert calls == ["fused", "composed"]
    assert dl.max_rows("linear_residual", 48, 40) == dl.DETERMINISTIC_MAX_ROWS  # the last choice's band
    dl.choose_fused([], {}, cpu, False, False, dtype=BF16)
    assert dl.installed_choice() == {}


LLAMA_1B = (2048, 8192, 128256, QKVHeads(32, 8, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for T in (1, 5, 64):
        _check_all(T, dtype, torch.device("cuda"), LLAMA_1B, bias=T == 5, seed=T)


@pytest.mark.gpu
def test_fused_ops_batch_invariant_gpu(monkeypatch):
    """Row 0's outputs are bitwise equal whether the step has 1 or up to 64 rows (the tensor-core
    kernel: the light one, where a plan installs it, serves one row only, with deterministic off)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(dl, "_LIGHT_ON", set())
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, inter, V, heads = LLAMA_1B
    g, x, nw = _inputs(64, H, dt, dev)
    ws = {name: _weight(g, n, k, dt, dev) for name, n, k in (
        ("lm", V, H), ("gu", 2 * inter, H), ("down", H, inter),
        ("qkv", (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim, H))}
    act = torch.randn((64, inter), generator=g).to(dev, dt)
    cos_sin, positions, cache, slots = _rope_case(g, 64, heads, dt, dev, num_blocks=32, block_size=16, max_pos=128)

    def row0(T):
        c = cache.clone()
        q = dl.norm_qkv_rope(x[:T], nw, 1e-5, ws["qkv"], None, heads, cos_sin, positions[:T], c, slots[:T])
        s0 = slots[0].item()
        return (dl.norm_linear(x[:T], nw, 1e-5, ws["lm"], None, torch.float32)[0],
                dl.norm_gate_up_silu(x[:T], nw, 1e-5, ws["gu"])[0],
                dl.linear_residual(act[:T], ws["down"], x[:T].clone())[0],
                q[0], c.view(2, -1, heads.num_kv_heads, heads.head_dim)[:, s0])

    first = row0(1)
    for T in range(2, 65):
        for a, b in zip(first, row0(T)):
            assert torch.equal(a, b), f"row 0 differs at T={T}"


def _pdl_chain_replays_eager(monkeypatch, rows: int, modes: str):
    """Three layers of the fused ops at `rows` rows on the 1B shapes: with the `modes` table of
    decode_linear (which ops launch with PDL) empty, eagerly; with every op in it, recorded in a
    CUDA graph and replayed: outputs and KV cache bitwise equal."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, inter, _, heads = LLAMA_1B
    g, x, nw = _inputs(rows, H, dt, dev)
    n_qkv = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    layers = [(_weight(g, n_qkv, H, dt, dev), _weight(g, H, heads.num_heads * heads.head_dim, dt, dev),
               _weight(g, 2 * inter, H, dt, dev), _weight(g, H, inter, dt, dev)) for _ in range(3)]
    cos_sin, positions, cache, slots = _rope_case(g, rows, heads, dt, dev, num_blocks=32, block_size=16, max_pos=128)

    def step(h):
        for qkv, o, gu, down in layers:
            q = dl.norm_qkv_rope(h, nw, 1e-5, qkv, None, heads, cos_sin, positions, cache, slots)
            h = dl.linear_residual(q.view(rows, -1), o, h)
            h = dl.linear_residual(dl.norm_gate_up_silu(h, nw, 1e-5, gu), down, h)
        return h

    monkeypatch.setattr(dl, modes, frozenset())
    want = step(x.clone())
    want_cache = cache.clone()
    monkeypatch.setattr(dl, modes, frozenset({dl._PLAIN, dl._RESIDUAL, dl._SILU, dl._ROPE}))
    h = x.clone()
    step(h.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(h)
    cache.zero_()
    h.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(cache, want_cache)


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_gpu(monkeypatch):
    """Three layers' fused ops launched with programmatic dependent launch (L2 prefetch before
    the wait) and recorded in a CUDA graph: the replay is bitwise what the eager, PDL-free
    launches compute (the prefetch and the early launch change no arithmetic)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _pdl_chain_replays_eager(monkeypatch, 8, "_PDL_MODES")


def _light_1b(monkeypatch):
    """The light kernel installed for the 1B shapes with decode_tuned.LIGHT's configs."""
    monkeypatch.setattr(dl, "_LIGHT_ON", set(dl._LIGHT_TUNED))
    assert {(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)} <= dl._LIGHT_ON


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_light_ops_gpu(monkeypatch, dtype):
    """The light kernel on the 1B shapes (one row; two rows and the LM head take the tensor-core
    kernel) against the references, PDL-launched as the table says."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _light_1b(monkeypatch)
    for T in (1, 2):
        _check_all(T, dtype, torch.device("cuda"), LLAMA_1B, bias=T == 2, seed=T)


@pytest.mark.gpu
def test_light_pdl_chain_in_a_cuda_graph_gpu(monkeypatch, rows=1):
    """Three layers of light ops, PDL-launched (first weight tile loaded before the wait) and
    recorded in a CUDA graph, replay bitwise what the eager PDL-free launches compute."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _light_1b(monkeypatch)
    _pdl_chain_replays_eager(monkeypatch, rows, "_LIGHT_PDL")


def test_pipeline_depth_fits_shared_memory(monkeypatch):
    """fp32 weights stage twice bf16's bytes: the depth is cut until the tiles fit (the H200 ran
    out of shared memory at 4 stages of 64 x 128 fp32 tiles), and every tuned bf16 config keeps
    its measured depth."""
    monkeypatch.setattr(occ, "shared_memory_bytes", lambda index: 232448)  # the H200's opt-in limit
    cuda = torch.device("cuda", 0)
    cfg = dl.DecodeConfig(64, 128, 2, 4, 4)
    assert occ.fit_stages(cfg, 1, 2, cuda) == 4
    assert occ.fit_stages(cfg, 1, 4, cuda) == 3
    assert occ.fit_stages(dl.DecodeConfig(64, 256, 4, 4, 3), 1, 4, cuda) == 1
    for tuned in dl._TUNED.values():
        c = dl.DecodeConfig(*tuned)
        assert occ.fit_stages(c, 2 if c.stack else 1, 2, cuda) == c.num_stages
    assert occ.fit_stages(cfg, 1, 4, torch.device("cpu")) == 4


def test_two_programs_per_sm_where_the_grid_has_two_waves(monkeypatch):
    """A grid of >= 2 programs per SM (the LM head: 1002 N-tiles) gets the depth at which two
    programs of its row tile share an SM (never under 2 stages); a grid of under two waves keeps
    the tuned depth at every row tile."""
    monkeypatch.setattr(occ, "shared_memory_bytes", lambda index: 232448)
    monkeypatch.setattr(occ, "sm_resources", lambda index: (132, 233472))  # the H200
    cuda = torch.device("cuda", 0)
    lm = dl.DecodeConfig(128, 128, 1, 8, 3)
    assert [occ.fit_stages(lm, 1, 2, cuda, rows, 1002) for rows in (16, 32, 64)] == [3, 2, 2]
    assert [occ.fit_stages(lm, 1, 2, cuda, rows, 200) for rows in (16, 32, 64)] == [3, 3, 3]
    assert occ.fit_stages(dl.DecodeConfig(64, 256, 1, 4, 4), 1, 2, cuda, 64, 1002) == 2  # 3 fit one: never under 2
    monkeypatch.setattr(occ, "TWO_PER_SM", False)
    assert occ.fit_stages(lm, 1, 2, cuda, 64, 1002) == 3
    # _WIDE_PDL's launches (two=True): two programs per SM whatever the grid (o: 4 -> 3 stages of
    # 32 KB; qkv's paired rows 3 -> 2 of 48 KB at 64-row tiles)
    o, qkv = dl.DecodeConfig(64, 128, 4, 4, 4), dl.DecodeConfig(64, 128, 4, 8, 3, True)
    assert [occ.fit_stages(o, 1, 2, cuda, 64, 128, two=t) for t in (False, True)] == [4, 3]
    assert [occ.fit_stages(qkv, 2, 2, cuda, 64, 96, two=t) for t in (False, True)] == [3, 2]


def test_run_refuses_a_manifest_whose_kernel_choice_this_build_does_not_make(tmp_path, monkeypatch):
    """The engine replays exactly the capture's choice: a manifest whose totals record another
    fused-or-composed choice (or GEMM backend) than this build installs is refused with
    "Recapture"; the same choice, or a manifest without the field, passes."""
    from types import SimpleNamespace

    from trtgraph.errors import ManifestError
    from trtgraph.kernels import linear
    from trtgraph.runtime.serving.engine_start import check_kernel_choices

    dl.choose_fused([("norm_linear", 72, 48)], {}, torch.device("cpu"), False, False, dtype=BF16)
    linear.choose_backends({}, BF16, torch.device("cpu"), False)

    def check(totals, path):
        ex = SimpleNamespace(model=SimpleNamespace(ops=SimpleNamespace(name="triton")))
        check_kernel_choices(SimpleNamespace(totals=totals), ex, path)

    path = tmp_path / "manifest.json"
    check({"fused_ops": {"norm_linear:72x48": "composed"}}, path)
    check({}, path)
    with pytest.raises(ManifestError, match=r"manifest.json: totals.fused_ops .*norm_linear:72x48.*Recapture"):
        check({"fused_ops": {"norm_linear:72x48": "fused"}}, path)
    with pytest.raises(ManifestError, match=r"totals.linear_backends .*2048x2048.*Recapture"):
        check({"linear_backends": {"2048x2048": "cublas"}}, path)
    # a shape fused for more rows (WIDE) than when the manifest was captured: refused too
    dl.choose_fused([("norm_linear", 72, 48)], {}, torch.device("cuda"), False, False, dtype=BF16)
    assert dl.installed_choice() == {"norm_linear:72x48": "fused<=16"}
    check({"fused_ops": {"norm_linear:72x48": "fused<=16"}}, path)
    # a manifest of a build that fused up to 32 rows ("fused"): refused by this one's 16
    with pytest.raises(ManifestError, match=r"totals.fused_ops .*norm_linear:72x48.*Recapture"):
        check({"fused_ops": {"norm_linear:72x48": "fused"}}, path)
    dl.choose_fused([("norm_linear", 72, 48)], {}, torch.device("cuda"), True, False, dtype=BF16)
    check({"fused_ops": {"norm_linear:72x48": "fused"}}, path)  # `deterministic`: up to 32, as before
    dl.choose_fused([("norm_linear", 72, 48)], {}, torch.device("cuda"), False, False, dtype=BF16)
    monkeypatch.setattr(dl, "_WIDE", {("norm_linear", 72, 48)})
    check({"fused_ops": {"norm_linear:72x48": "fused<=64"}}, path)
    with pytest.raises(ManifestError, match=r"totals.fused_ops .*norm_linear:72x48.*Recapture"):
        check({"fused_ops": {"norm_linear:72x48": "fused"}}, path)
    dl.choose_fused([], {}, torch.device("cpu"), False, False, dtype=BF16)
