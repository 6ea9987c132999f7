"""Decode attention launched with programmatic dependent launch (kernels/attention.py,
ATTENTION_PDL): which launches take it (CPU), and on the GPU a chain of qkv -> attention -> o
over three layers, recorded in a CUDA graph with the PDL edges, replays bitwise what the
PDL-free eager launches compute (the early launch, the pre-wait block-table reads and the L2
prefetch change no arithmetic), with block-table entries past every context pointing far
outside the cache (no pre-wait read may follow them)."""

import pytest
import torch
import torch.nn.functional as F

from test_decode_linear import _inputs, _light_1b, _weight
from test_kernels import _paged_case, _slots
from trtgraph.kernels import attention, reference
from trtgraph.kernels import attention_config as acfg
from trtgraph.kernels import decode_linear as dl
from trtgraph.kernels.composed import QKVHeads


def test_pdl_launch_is_for_decode_keys_on_pdl_devices(monkeypatch):
    """Decode keys (q = 1) of at most ATTENTION_PDL[path] sequences launch attention with PDL on a
    PDL-capable device; verification and prefill (q > 1) and the CPU never."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(acfg, "ATTENTION_PDL", {"decode": 8, "rope": 64})
    assert not acfg.launches_with_pdl(1, False, 1, cpu) and not acfg.launches_with_pdl(1, True, 1, cpu)
    monkeypatch.setattr(acfg, "pdl_capable", lambda device: device.type == "cuda")
    assert [acfg.launches_with_pdl(1, False, b, cuda) for b in (1, 8, 9, 64)] == [True, True, False, False]
    assert [acfg.launches_with_pdl(1, True, b, cuda) for b in (1, 40, 64, 65)] == [True, True, True, False]
    for rope in (False, True):
        assert not acfg.launches_with_pdl(2, rope, 1, cuda) and not acfg.launches_with_pdl(64, rope, 1, cuda)
    monkeypatch.setattr(acfg, "ATTENTION_PDL", {"decode": 0, "rope": 0})
    assert not acfg.launches_with_pdl(1, False, 1, cuda) and not acfg.launches_with_pdl(1, True, 1, cuda)


def test_attention_runs_without_pdl_in_the_interpreter():
    """On the CPU (the interpreter: no griddepcontrol, no inline asm) a decode launch takes the
    PDL-free path and still matches the reference."""
    import test_kernels

    test_kernels.run_attention(torch.device("cpu"), torch.float32, 1, 3, seed=5)
    test_kernels.run_rope_attention(torch.device("cpu"), torch.float32, 1, 3, seed=6)


def _chain_replays_eager(monkeypatch, rows: int, dtype: torch.dtype, rope_in_attention: bool, invariant: bool,
                         trigger: int, prefetch: bool):
    """Three layers of qkv -> attention -> o at `rows` rows on the 1B shapes (32 q / 8 kv heads of
    64, page 16). The qkv is the fused kernel (light at one row), or with `rope_in_attention` a
    cuBLAS GEMM and RoPE + KV write inside attention (bs 40-64's path). Eager with every PDL
    table empty, then with them on (attention's trigger at `trigger`, its L2 prefetch per
    `prefetch`), eagerly and recorded and replayed: outputs and caches bitwise equal."""
    dev = torch.device("cuda")
    H, heads, eps, scale = 2048, QKVHeads(32, 8, 64), 1e-5, 64 ** -0.5
    monkeypatch.setattr(acfg, "_INVARIANT_ATTENTION", [invariant])
    if rows == 1:
        _light_1b(monkeypatch)
    g, x, nw = _inputs(rows, H, dtype, dev, seed=rows)
    cache, tables, positions = _paged_case(g, dev, dtype, 1, rows, hq=32, hkv=8, d=64, bs=16, blocks=24)
    tables = tables[:rows].clone()
    past = torch.arange(tables.shape[1], device=dev)[None, :] * 16 > positions[:, None]
    tables[past] = 1 << 30  # past every context: never read (a read would fault)
    slots = _slots(tables, positions, 1, bs=16)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    ang = torch.arange(int(positions.max()) + 1).float()[:, None] * inv[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1).to(dev)
    n_qkv = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    layers = [(_weight(g, n_qkv, H, dtype, dev), _weight(g, H, H, dtype, dev), torch.randn_like(cache))
              for _ in range(3)]
    caches0 = [c.clone() for _, _, c in layers]

    def step(h):
        for wqkv, wo, kv in layers:
            if rope_in_attention:
                qkv = F.linear(reference.rms_norm(h, nw, eps), wqkv)
                q, k, v = (t.view(rows, -1, 64) for t in qkv.split([32 * 64, 8 * 64, 8 * 64], dim=-1))
                a = attention.rope_paged_attention(q, k, v, cos_sin, positions, kv, slots, tables, 1, scale)
            else:
                q = dl.norm_qkv_rope(h, nw, eps, wqkv, None, heads, cos_sin, positions, kv, slots)
                a = attention.paged_attention(q, kv, tables, positions, 1, scale)
            h = dl.linear_residual(a.view(rows, -1), wo, h)
        return h

    def reset():
        for (_, _, kv), c0 in zip(layers, caches0):
            kv.copy_(c0)

    def pdl(on: bool):
        monkeypatch.setattr(acfg, "PREFETCH_KV", prefetch)
        monkeypatch.setattr(acfg, "ATTENTION_PDL", {"decode": 64 if on else 0, "rope": 64 if on else 0})
        monkeypatch.setattr(acfg, "ATTENTION_TRIGGER", trigger if on else 0)
        monkeypatch.setattr(dl, "_TRIGGER_MODES", frozenset({dl._ROPE} if on else ()))
        monkeypatch.setattr(dl, "_LIGHT_PDL", frozenset({dl._RESIDUAL, dl._SILU, dl._ROPE} if on else ()))

    pdl(False)
    want = step(x.clone())
    want_caches = [kv.clone() for _, _, kv in layers]
    reset()
    pdl(True)
    assert acfg.launches_with_pdl(1, rope_in_attention, rows, dev)
    eager_pdl = step(x.clone())  # also compiles outside the capture
    assert torch.equal(eager_pdl, want)
    h = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(h)
    reset()
    h.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    for (_, _, kv), w in zip(layers, want_caches):
        assert torch.equal(kv, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pdl_attention_chain_in_a_cuda_graph_gpu(monkeypatch, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cases = ((1, False, False, 2, False), (1, False, False, 1, True), (8, False, dtype == torch.float32, 2, True),
             (48, True, False, 2, True))
    for rows, rope, invariant, trigger, prefetch in cases:
        with monkeypatch.context() as m:
            _chain_replays_eager(m, rows, dtype, rope, invariant, trigger, prefetch)
