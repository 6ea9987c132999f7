"""The persistent layer tail (kernels/decode_persistent.py: o + residual, norm + gate_up + SiLU,
down + residual in one launch) against the composition of the torch references, under
TRITON_INTERPRET=1 on the CPU (a grid of one program) and on the GPU (a grid of one program per
SM, with its grid-wide arrivals), and its choice and manifest record."""

import pytest
import torch

from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels import decode_occupancy as occ
from trtgraph.kernels import decode_persistent as dp
from trtgraph.kernels import decode_tuned, reference
from trtgraph.kernels.composed import compose
from trtgraph.kernels.triton_ops import arrival_counters

REF = compose(reference.rms_norm, reference.linear, reference.silu_and_mul, reference.rope_write_kv)
BF16 = torch.bfloat16
TINY = (48, 32, 40)  # hidden 48, attention output 32 (4 heads of 8), intermediate 40
LLAMA_1B = (2048, 2048, 8192)


def _case(T, shapes, dtype, device, seed=0, layers=1):
    """(attn [T, Ko], residual [T, H], norm weight, [(Wo, Wgu, Wd)] * layers)."""
    H, ko, inter = shapes
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return (torch.randn((n, k), generator=g) / k ** 0.5).to(device, dtype)
    a = torch.randn((T, ko), generator=g).to(device, dtype)
    h = torch.randn((T, H), generator=g).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(device, dtype)
    return a, h, nw, [(w(H, ko), w(2 * inter, H), w(H, inter)) for _ in range(layers)]


def _close(got, want, dtype):
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def _tiny_tables(monkeypatch, split, stack):
    monkeypatch.setattr(dl, "_TUNED", {(48, 32): (16, 16, split, 1, 1), (80, 48): (16, 16, split, 1, 1, stack),
                                       (48, 40): (16, 16, split, 1, 1)})


@pytest.mark.parametrize("split,stack", [(1, False), (3, True), (2, False)])
@pytest.mark.parametrize("T", [1, 17, 40, 64])
def test_layer_tail_matches_the_reference(monkeypatch, T, split, stack):
    """The kernel (one program working through every item of each phase) against the three
    reference ops: split-K 1, 2 and 3 on o and down (and gate_up), paired rows stacked or not,
    16 / 32 / 64-row tiles, columns and K not multiples of the tiles; written into the residual's
    storage; every arrival counter back to 0 afterwards (a CUDA-graph replay needs no reset)."""
    _tiny_tables(monkeypatch, split, stack)
    a, h, nw, [(wo, wgu, wd)] = _case(T, TINY, torch.float32, torch.device("cpu"), seed=T)
    want = REF.layer_tail(a, wo, h.clone(), nw, 1e-5, wgu, wd)
    got = dp.layer_tail(a, wo, h, nw, 1e-5, wgu, wd)
    assert got.data_ptr() == h.data_ptr()
    _close(got, want, torch.float32)
    assert not arrival_counters(1, torch.device("cpu")).any()


def test_reference_is_the_three_ops_in_order():
    """tail_op is exactly o + residual, then the MLP, in the references' rounding (the torch set)."""
    a, h, nw, [(wo, wgu, wd)] = _case(5, TINY, BF16, torch.device("cpu"))
    h1 = REF.linear_residual(a, wo, h)
    want = REF.linear_residual(REF.norm_gate_up_silu(h1, nw, 1e-5, wgu), wd, h1)
    assert torch.equal(REF.layer_tail(a, wo, h, nw, 1e-5, wgu, wd), want)


def _installed(monkeypatch, shapes=TINY):
    H, ko, inter = shapes
    monkeypatch.setattr(decode_tuned, "TAIL", True)
    monkeypatch.setattr(dl, "_SLOWER", set())
    ops = [("norm_qkv_rope", 3 * ko, H), ("linear_residual", H, ko), ("norm_gate_up_silu", 2 * inter, H),
           ("linear_residual", H, inter), ("norm_linear", 72, H)]
    return ops


def test_choice_records_the_tail_and_the_manifest_accepts_it(monkeypatch, tmp_path):
    """choose_fused installs the tail for the layer's o, gate_up and down shapes on CUDA, bf16, one
    GPU, deterministic off (decode_tuned.TAIL); the manifest records "+tail<=64" on those three, and
    the schema accepts every such name (the sixth session shipped a name the schema refused)."""
    from trtgraph.errors import ManifestError
    from trtgraph.manifest_schema import FieldReader, check_totals

    shapes = _installed(monkeypatch)
    cuda = torch.device("cuda")
    try:
        got = dl.choose_fused(shapes, {}, cuda, False, False, dtype=BF16)
        assert dp._TAIL_ON == {((48, 32), (80, 48), (48, 40))}
        assert got == {"linear_residual:48x32": "fused<=16+tail<=64", "linear_residual:48x40": "fused<=16+tail<=64",
                       "norm_gate_up_silu:80x48": "fused<=16+tail<=64", "norm_linear:72x48": "fused<=16",
                       "norm_qkv_rope:96x48": "fused<=16"}
        v = FieldReader(tmp_path / "manifest.json", "Recapture.")
        totals = {"num_keys": 1, "warmup_seconds": 0.5, "capture_seconds": 0.5, "pool_bytes": 0,
                  "largest_key_pool_bytes": 0, "fused_ops": got}
        check_totals(v, totals, [0])
        monkeypatch.setattr(dl, "_LIGHT_ON", {(48, 32)})
        monkeypatch.setattr(dl, "_WIDE", {("norm_gate_up_silu", 80, 48)})
        names = dl.installed_choice()
        assert names["linear_residual:48x32"] == "fused<=16+light<=1+tail<=64"
        assert names["norm_gate_up_silu:80x48"] == "fused<=64+tail<=64"
        check_totals(v, {**totals, "fused_ops": names}, [0])
        with pytest.raises(ManifestError, match=r"totals.fused_ops .*Recapture"):
            check_totals(v, {**totals, "fused_ops": {"linear_residual:48x32": "fused<=16+tail"}}, [0])
        for args, kw in (((cuda, True, False), {}), ((cuda, False, True), {}), ((torch.device("cpu"), False, False), {}),
                         ((cuda, False, False), {"dtype": torch.float32})):
            dl.choose_fused(shapes, {}, *args, dtype=kw.get("dtype", BF16))  # deterministic, TP, CPU, fp32
            assert not dp._TAIL_ON and "tail" not in str(dl.installed_choice())
        monkeypatch.setattr(dl, "_SLOWER", {("linear_residual", 48, 40)})  # down composed: no tail
        dl.choose_fused(shapes, {}, cuda, False, False, dtype=BF16)
        assert not dp._TAIL_ON
        monkeypatch.setattr(decode_tuned, "TAIL", False)
        monkeypatch.setattr(dl, "_SLOWER", set())
        dl.choose_fused(shapes, {}, cuda, False, False, dtype=BF16)
        assert not dp._TAIL_ON
    finally:
        dl.choose_fused([], {}, torch.device("cpu"), False, False, dtype=BF16)
        dl._LIGHT_ON.clear()


def test_dispatch_runs_the_tail_for_33_to_64_rows_only(monkeypatch):
    """The Triton set's layer_tail: the persistent kernel for steps of 33-64 rows where installed,
    the composition of the dispatched ops elsewhere (and everywhere when not installed); both
    give the references' results."""
    _tiny_tables(monkeypatch, 2, True)
    calls = []
    kernel = dp._tail_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]
    monkeypatch.setattr(dp, "_tail_kernel", Spy())
    ops = dl.dispatch(REF)
    monkeypatch.setattr(dp, "_TAIL_ON", {((48, 32), (80, 48), (48, 40))})
    for T, runs in ((32, False), (33, True), (64, True), (65, False)):
        calls.clear()
        a, h, nw, [(wo, wgu, wd)] = _case(T, TINY, torch.float32, torch.device("cpu"), seed=T)
        want = REF.layer_tail(a, wo, h.clone(), nw, 1e-5, wgu, wd)
        _close(ops.layer_tail(a, wo, h, nw, 1e-5, wgu, wd), want, torch.float32)
        assert bool(calls) == runs, T
    monkeypatch.setattr(dp, "_TAIL_ON", set())
    calls.clear()
    a, h, nw, [(wo, wgu, wd)] = _case(40, TINY, torch.float32, torch.device("cpu"))
    ops.layer_tail(a, wo, h, nw, 1e-5, wgu, wd)
    assert not calls


def test_grid_is_at_most_one_program_per_sm(monkeypatch):
    """Every program must be resident at once (a program waiting at an arrival for one that has
    no SM would wait forever): at most the SM count, one on the interpreter."""
    monkeypatch.setattr(occ, "sm_resources", lambda index: (132, 233472))
    cuda = torch.device("cuda", 0)
    assert [dp._programs(n, cuda) for n in (1, 128, 132, 133, 1002)] == [1, 128, 132, 132, 132]
    assert dp._programs(128, torch.device("cpu")) == 1


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_layer_tail_gpu(dtype):
    """The 1B shapes with the tuned configs (a grid of one program per SM, the arrivals between
    phases) against the references at 33, 48 and 64 rows, twice (the counters reset themselves)."""
    dev = _gpu()
    for T in (33, 48, 64, 64):
        a, h, nw, [(wo, wgu, wd)] = _case(T, LLAMA_1B, dtype, dev, seed=T)
        want = REF.layer_tail(a, wo, h.clone(), nw, 1e-5, wgu, wd)
        _close(dp.layer_tail(a, wo, h, nw, 1e-5, wgu, wd), want, dtype)
    torch.cuda.synchronize()
    assert not arrival_counters(1, dev).any()


@pytest.mark.gpu
def test_layer_tail_replays_eager_and_is_row_invariant_gpu():
    """Four layers of the tail recorded in a CUDA graph replay bitwise what the eager launches
    compute, replay after replay; row 0's result is bitwise the same for T = 33 .. 64."""
    dev = _gpu()
    a, h, nw, layers = _case(64, LLAMA_1B, BF16, dev, layers=4)

    def step(x):
        for wo, wgu, wd in layers:
            x = dp.layer_tail(a[:x.shape[0]], wo, x, nw, 1e-5, wgu, wd)
        return x
    want = step(h.clone())
    x = h.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x)
    for _ in range(3):
        x.copy_(h)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    first = want[0]
    for T in range(33, 65):
        assert torch.equal(step(h[:T].clone())[0], first), f"row 0 differs at T={T}"
