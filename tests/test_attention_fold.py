"""RoPE + KV write inside decode attention with the step's key folded in from registers (the
adaptive mode's `fold`, kernels/attention_config.py): against the torch reference at contexts
where the cached keys fill no tile, end on a tile's edge, span several split pieces, alone and
in a crowd; the cache written as the reference writes it; the invariant mode never folds."""

import pytest
import torch

import test_kernels
from test_kernels import _close, needs_triton
from trtgraph.kernels import attention, reference
from trtgraph.kernels import attention_config as acfg

CONTEXTS = (1, 17, 33, 40, 64, 128)  # keys including the step's own (CPU tile: 16 keys, pieces of 2 tiles)


def _fold_case(device, dtype, contexts, hq=8, hkv=2, d=16, page=4, width=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(contexts)
    cache = torch.randn((2, batch * width + 1, page, hkv, d), generator=g).to(device, dtype)
    tables = (torch.randperm(batch * width, generator=g) + 1).view(batch, width).to(device)
    positions = torch.tensor([c - 1 for c in contexts], device=device)
    qkv = torch.randn((batch, (hq + 2 * hkv) * d), generator=g).to(device, dtype)
    q, k, v = (t.view(batch, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    cos_sin = torch.randn((page * width, d), generator=g).to(device)
    slots = tables[torch.arange(batch, device=device), positions // page] * page + positions % page
    return cache, tables, positions, q, k, v, cos_sin, slots


def _check(device, dtype, contexts, **shape):
    cache, tables, positions, q, k, v, cos_sin, slots = _fold_case(device, dtype, contexts, **shape)
    d = q.shape[-1]
    got_cache, want_cache = cache.clone(), cache.clone()
    got = attention.rope_paged_attention(q, k, v, cos_sin, positions, got_cache, slots, tables, 1, d ** -0.5)
    want = reference.rope_paged_attention(q, k, v, cos_sin, positions, want_cache, slots, tables, 1, d ** -0.5)
    _close(got, want, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got_cache, want_cache, rtol=1e-6, atol=1e-6)
    else:  # the rotation's rounding may differ in the last bit
        _close(got_cache, want_cache, dtype)
    assert not torch.equal(got_cache, cache)


@needs_triton
def test_fold_is_the_adaptive_modes_and_never_the_invariant_modes(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(acfg, "_INVARIANT_ATTENTION", [False])
    assert acfg.fold_mode(2, cpu) == 1 and acfg.loads_first_tile_early(2, cpu)
    monkeypatch.setattr(acfg, "_INVARIANT_ATTENTION", [True])
    assert acfg.fold_mode(2, cpu) == 0 and not acfg.loads_first_tile_early(2, cpu)
    monkeypatch.setattr(acfg, "DECODE_OVERRIDE", {"fold": 2, "early": True})  # a sweep's override cannot change that
    assert acfg.fold_mode(2, cpu) == 0 and not acfg.loads_first_tile_early(2, cpu)


def test_adaptive_bands_fold_past_one_row_program_per_sm(monkeypatch):
    """The adaptive decode config by the key's (sequence, kv head) programs on a 132-SM device: no
    fold up to one per SM (the 1B's fused-qkv steps, bs <= 16), fold 1 up to three (bs 17-49: the
    fifteenth session's sweep), fold 2 with 2 warps past that; the invariant mode never folds."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(acfg._NUM_SMS, gpu, 132)
    monkeypatch.setattr(acfg, "_INVARIANT_ATTENTION", [False])
    picks = {n: (acfg.fold_mode(n, gpu), acfg.decode_config(n, gpu)["warps"]) for n in (8, 132, 133, 256, 396, 397, 512)}
    assert picks == {8: (0, 4), 132: (0, 4), 133: (1, 4), 256: (1, 4), 396: (1, 4), 397: (2, 2), 512: (2, 2)}
    monkeypatch.setattr(acfg, "_INVARIANT_ATTENTION", [True])
    assert all(acfg.fold_mode(n, gpu) == 0 for n in (8, 256, 512))


@needs_triton
@pytest.mark.parametrize("fold,early", [(1, True), (1, False), (2, True), (2, False), (0, True), (0, False)],
                         ids=["fold-early", "fold", "fold2-early", "fold2", "write-then-read-early", "write-then-read"])
def test_rope_attention_folds_the_new_key(monkeypatch, fold, early):
    """Each context alone (a table of 32 pages: 4 pieces of 2 tiles, so 128 keys are merged from
    4 pieces) and all of them in one crowd (one piece each), with the fold and without it, with
    the first tile loaded early and taken last and without (never with the write-then-read: the
    early load would miss the step's own key), and plain decode attention with `early`."""
    monkeypatch.setattr(acfg, "_INVARIANT_ATTENTION", [False])
    monkeypatch.setattr(acfg, "DECODE_OVERRIDE", {"fold": fold, "early": early})
    cpu = torch.device("cpu")
    assert acfg.fold_mode(2, cpu) == fold and acfg.loads_first_tile_early(2, cpu) == early
    assert acfg.attention_launch_shape(1, 1, 4, 2, 128, cpu)[3] == 4  # one sequence alone: 4 pieces
    for i, ctx in enumerate(CONTEXTS):
        _check(cpu, torch.float32, (ctx,), seed=i)
    _check(cpu, torch.float32, CONTEXTS, seed=99)
    if fold:
        test_kernels.run_attention(cpu, torch.float32, 1, 5, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_attention_folds_the_new_key_gpu(monkeypatch, dtype):
    """The shipped adaptive configs on Llama-3.2-1B's heads (32 / 8 of 64, page 16), with the
    fold (the shipped mode, then each), with and without the early first tile: contexts at tile
    edges of both tile sizes, at 1, 8, 48 and 64 sequences."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(acfg, "_INVARIANT_ATTENTION", [False])
    dev = torch.device("cuda")
    shape = dict(hq=32, hkv=8, d=64, page=16, width=40)
    assert acfg.fold_mode(64 * 8, dev) > 0 and acfg.fold_mode(48 * 8, dev) > 0 and acfg.fold_mode(8, dev) == 0
    edges = (1, 2, 64, 65, 128, 129, 257, 640)
    for override in ({}, {"fold": 1, "early": True}, {"fold": 2}):
        monkeypatch.setattr(acfg, "DECODE_OVERRIDE", override)
        for batch in (1, 8, 48, 64):
            contexts = tuple(edges[i % len(edges)] for i in range(batch))
            _check(dev, dtype, contexts, seed=batch, **shape)
