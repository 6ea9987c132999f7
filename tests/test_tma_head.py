"""The TMA-fed LM head (kernels/tma_head.py) for decode steps of 33-64 rows: against the torch
reference under TRITON_INTERPRET=1 on the CPU and on the GPU (fp32 and bf16), the greedy argmax
in its epilogue, a row's logits independent of the rows beside it, its dispatch (only hoisted-norm
fp32 heads of 33-64 rows on an installed shape), its choice and the manifest's record of it."""

import pytest
import torch

from trtgraph.kernels import composed, decode_linear as dl, decode_tuned, reference, sampler_reference
from trtgraph.kernels import tma_head as tma

BF16 = torch.bfloat16
SMALL = (64, 64, 2, 4)  # BLOCK_N, BLOCK_K, stages, warps: small tiles for the interpreter


def _case(T, v, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((64, k), generator=g)[:T].contiguous().to(device, dtype)
    w = (torch.randn((v, k), generator=g) / k ** 0.5).to(device, dtype)
    return x, w


@pytest.mark.parametrize("T,v,k", [(40, 200, 96), (64, 128, 128), (33, 130, 64), (5, 64, 64)])
def test_linear_is_the_reference_product(T, v, k):
    """fp32 logits near x @ W^T, with V and K not multiples of the tile (the descriptor zero-fills)."""
    x, w = _case(T, v, k, torch.float32, "cpu", seed=T)
    out = tma.linear(x, w, config=SMALL)
    assert out.shape == (T, v) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference.linear(x, w).float(), atol=1e-4, rtol=1e-4)


def test_a_rows_logits_do_not_depend_on_the_other_rows():
    """(fp32: the interpreter's bf16 tl.dot is not the GPU's; bf16 is checked on the GPU below.)"""
    x, w = _case(64, 192, 128, torch.float32, "cpu", seed=3)
    full = tma.linear(x, w, config=SMALL)
    for T in (33, 47, 63):
        assert torch.equal(tma.linear(x[:T].contiguous(), w, config=SMALL), full[:T]), T
    torch.testing.assert_close(full, x @ w.t(), atol=1e-4, rtol=1e-4)


def test_the_argmax_epilogue_writes_each_rows_first_maximal_column():
    x, w = _case(40, 256, 64, torch.float32, "cpu", seed=7)
    w[130] = w[3]  # a tie with an earlier column: the first wins
    x[0] = w[3] * 4  # row 0's maximum is column 3 (and its twin 130)
    tokens = torch.full((40,), -5, dtype=torch.int64)
    logits = tma.linear_argmax(x, w, tokens, config=SMALL)
    assert torch.equal(logits, tma.linear(x, w, config=SMALL))
    assert torch.equal(tokens, sampler_reference.greedy(logits)) and tokens[0] == 3
    again = torch.full((40,), -5, dtype=torch.int64)  # the running maxima and counters were put back
    tma.linear_argmax(x, w, again, config=SMALL)
    assert torch.equal(again, tokens)
    only = torch.full((40,), -5, dtype=torch.int64)  # a greedy step's head: the tokens, no logits stored
    assert tma.linear_argmax(x, w, only, config=SMALL, store=False) is None
    assert torch.equal(only, tokens)


def test_dispatch_runs_it_only_for_hoisted_heads_of_33_to_64_rows_on_installed_shapes(monkeypatch):
    calls = []
    monkeypatch.setattr(tma, "_ON", {(192, 64): SMALL})
    monkeypatch.setattr(tma, "linear", lambda x, w: calls.append(("plain", x.shape[0])) or reference.linear(x, w))
    monkeypatch.setattr(tma, "linear_argmax", lambda x, w, tok, store=True: calls.append(("argmax", x.shape[0]))
                        or reference.linear(x, w))
    ref = composed.compose(reference.rms_norm, reference.linear, reference.silu_and_mul, reference.rope_write_kv)
    ref = ref._replace(norm_linear_argmax=composed.argmax_op(ref.norm_linear, sampler_reference.greedy))
    ops = dl.dispatch(ref)
    nw = torch.ones(64)
    for T in (1, 32, 33, 48, 64, 65):
        x, w = _case(min(T, 64), 192, 64, torch.float32, "cpu", seed=T)
        if T == 65:
            x = torch.cat([x, x[:1]])
        ops.norm_linear(x, None, 1e-5, w, out_dtype=torch.float32)
        ops.norm_linear(x, nw, 1e-5, w, out_dtype=torch.float32)  # a norm left to apply: not here
        ops.norm_linear(x, None, 1e-5, w)  # logits in the weight's dtype: not here
        ops.norm_linear_argmax(x, None, 1e-5, w, torch.empty(x.shape[0], dtype=torch.int64))
    assert calls == [("plain", 33), ("argmax", 33), ("plain", 48), ("argmax", 48), ("plain", 64), ("argmax", 64)]
    x, w = _case(40, 128, 64, torch.float32, "cpu")  # a shape not installed
    ops.norm_linear(x, None, 1e-5, w, out_dtype=torch.float32)
    assert len(calls) == 6


@pytest.mark.parametrize("why", ["cpu", "deterministic", "tensor_parallel", "fp32", "no_table", "no_rows", "sm80",
                                 "no_head"])
def test_the_tma_head_is_not_installed_off_its_conditions(monkeypatch, why):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    args = dict(head_shape=(128256, 2048), row_counts=[1, 40, 64, 512], device=torch.device("cuda"),
                deterministic=False, tensor_parallel=False, dtype=BF16)
    assert tma.choose_tma_head(**args) == {"norm_linear_tma:128256x2048": "tma:33-64"}
    if why == "sm80":  # no TMA before Hopper
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    change = {"cpu": dict(device=torch.device("cpu")), "deterministic": dict(deterministic=True),
              "tensor_parallel": dict(tensor_parallel=True), "fp32": dict(dtype=torch.float32),
              "no_table": dict(head_shape=(128256, 4096)), "no_rows": dict(row_counts=[1, 8, 32, 512]),
              "sm80": {}, "no_head": dict(head_shape=None)}[why]
    assert tma.choose_tma_head(**{**args, **change}) == {} and tma.installed_tma_head() == {}


def test_the_choice_and_the_manifest_record_it(monkeypatch):
    import inspect
    import re

    from trtgraph import manifest_schema
    monkeypatch.setattr(tma, "_ON", {(128256, 2048): (128, 128, 4, 4)})
    assert dl.installed_choice()["norm_linear_tma:128256x2048"] == "tma:33-64"
    src = inspect.getsource(manifest_schema.check_totals)
    pattern = re.search(r're\.fullmatch\(r"(composed[^"]*)"\s*r"([^"]*)", b\)', src)
    value = re.compile(pattern.group(1) + pattern.group(2))
    assert value.fullmatch("tma:33-64") and value.fullmatch("split4:33-64") and value.fullmatch("fused<=64")
    assert not value.fullmatch("tma") and not value.fullmatch("tma:33") and not value.fullmatch("tma4:33-64")
    assert re.fullmatch(r"[a-z_]{1,32}:[0-9]{1,7}x[0-9]{1,7}", "norm_linear_tma:128256x2048")


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs TMA (compute capability 9.0+)")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_tma_head_gpu_matches_fp32_rows_invariant_argmax_and_graph_replay(dtype):
    """bf16: the 1B head shape with the shipped config; fp32: a narrower head with small tiles.
    Near the fp32 product; rows 33-64 bitwise those of the 64-row step; the argmax the first
    maximum of its logits; a CUDA graph of it replays the eager result (the descriptors baked in)."""
    dev = _gpu()
    v, cfg = ((128256, None) if dtype == BF16 else (4096, (64, 32, 3, 4)))
    x, w = _case(64, v, 2048, dtype, dev, seed=11)
    cfg = cfg or decode_tuned.TMA_HEAD[(v, 2048)]
    tokens = torch.empty(64, dtype=torch.int64, device=dev)
    full = tma.linear_argmax(x, w, tokens, config=cfg)
    torch.testing.assert_close(full, x.float() @ w.float().t(), atol=2e-3, rtol=2e-3)
    assert torch.equal(tokens, sampler_reference.greedy(full))
    for T in (33, 40, 57, 63):
        assert torch.equal(tma.linear(x[:T].contiguous(), w, config=cfg), full[:T]), T
    xs = x[:40].clone()
    toks = torch.empty(40, dtype=torch.int64, device=dev)
    tma.linear_argmax(xs, w, toks, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tma.linear_argmax(xs, w, toks, config=cfg)
    for _ in range(2):
        toks.fill_(-1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, full[:40]) and torch.equal(toks, tokens[:40])
