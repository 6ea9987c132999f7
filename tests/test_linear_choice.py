"""The GEMM backends' timed choice (kernels/linear.py): where cuBLAS is allowed, capture times it
against the batch-invariant Triton kernel over the plan's row counts and keeps cuBLAS unless Triton
takes at most TRITON_MARGIN of its time; the manifest records the table and the times, and the
runtime installs the record without timing again. On the CPU cuBLAS is never allowed, so these
tests allow it (torch's CPU GEMM stands in) and replace the GPU timer with fixed times."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from trtgraph.artifacts import MANIFEST_NAME
from trtgraph.cli import main
from trtgraph.kernels import linear
from trtgraph.runtime.serving.engine import Engine
from trtgraph.runtime.step import executor

from conftest import tiny_config

CPU = torch.device("cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def restore_backends():
    saved, times = dict(linear._BACKENDS), dict(linear._TIMES)
    yield
    linear._BACKENDS.clear(), linear._BACKENDS.update(saved)
    linear._TIMES.clear(), linear._TIMES.update(times)


def fake_timer(slow_cublas: set[tuple[int, int]], calls: list):
    """cuBLAS 100 us a call, except on `slow_cublas` shapes: 100 below 16 rows and 10 from 16 (so it is suspect
    below 16); Triton 50 on those shapes, 90 elsewhere."""
    def time_backend(backend, n, k, rows, dtype, device, residual, timer):
        calls.append((backend, n, k, tuple(rows), residual))
        slow = (n, k) in slow_cublas
        if backend == linear.CUBLAS:
            return {m: 10.0 if slow and m >= 16 else 100.0 for m in rows}
        return {m: 50.0 if slow else 90.0 for m in rows}
    return time_backend


def test_pick_keeps_cublas_unless_triton_takes_at_most_the_margin():
    assert linear.pick({"cublas": 100.0, "triton": 80.0}) == "triton"
    assert linear.pick({"cublas": 100.0, "triton": 80.1}) == "cublas"
    assert linear.pick({"cublas": 10.0, "triton": 3.0}) == "triton"


def test_suspect_rows_are_where_cublas_is_slower_than_at_more_rows():
    assert linear.suspect_rows({1: 3.0, 4: 5.3, 8: 33.0, 12: 32.9, 16: 33.1, 24: 6.7}) == [8, 12, 16]
    assert linear.suspect_rows({1: 5.1, 8: 5.1, 17: 5.8, 32: 5.5, 64: 5.3}) == []  # within SLOW_FACTOR
    assert linear.suspect_rows({1: 3.0, 64: 10.0, 2048: 500.0}) == []
    assert linear.suspect_rows({8: 40.0, 16: 10.0, 32: 35.0, 64: 20.0}) == [8, 32]


def test_timed_choice_recorded_choice_and_untimed_choice(monkeypatch, restore_backends):
    calls = []
    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: True)
    monkeypatch.setattr(linear, "time_backend", fake_timer({(40, 48)}, calls))
    counts = {(40, 48): [4, 1, 4, 16], (96, 48): [1, 3], (48, 40): [2]}
    got = linear.choose_backends(counts, torch.float32, CPU, True, frozenset({(48, 40)}), timer=lambda work: 0.0)
    # deterministic: one backend a shape, by the sums (40x48: cuBLAS 310, Triton 150 at every row count)
    assert got == {"40x48": "triton", "96x48": "cublas", "48x40": "cublas"}
    assert linear.installed_times() == {"40x48": {"cublas": 210.0, "chosen": 150.0},
                                        "48x40": {"cublas": 100.0, "chosen": 100.0},
                                        "96x48": {"cublas": 200.0, "chosen": 200.0}}
    # distinct row counts, sorted; the residual shapes in linear_residual's form; Triton only where
    # cuBLAS is suspect (then at every row count: the sums decide)
    assert ("cublas", 40, 48, (1, 4, 16), False) in calls and ("cublas", 48, 40, (2,), True) in calls
    assert [c for c in calls if c[0] == "triton"] == [("triton", 40, 48, (1, 4, 16), False)]

    calls.clear()  # without deterministic: Triton timed and taken at the suspect row counts only
    assert linear.choose_backends(counts, torch.float32, CPU, False, timer=lambda work: 0.0) == {
        "40x48": "cublas+triton:1,4", "96x48": "cublas", "48x40": "cublas"}
    assert [c for c in calls if c[0] == "triton"] == [("triton", 40, 48, (1, 4), False)]
    assert linear.installed_times()["40x48"] == {"cublas": 210.0, "chosen": 110.0}

    calls.clear()
    record = {"40x48": "cublas", "96x48": "triton", "48x40": "cublas"}
    assert linear.choose_backends(counts, torch.float32, CPU, True, recorded=record) == record
    assert calls == [] and linear.installed_times() == {}  # the record is installed, never re-timed
    assert linear.choose_backends(counts, torch.float32, CPU, True) == {
        "40x48": "cublas", "96x48": "cublas", "48x40": "cublas"}  # untimed: cuBLAS wherever allowed
    assert calls == []
    # a record that lacks a shape, or names cuBLAS where this build does not allow it: Triton
    # there, which the runtime's comparison with the record then refuses
    assert linear.choose_backends(counts, torch.float32, CPU, True, recorded={"40x48": "cublas"}) == {
        "40x48": "cublas", "96x48": "triton", "48x40": "triton"}
    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: False)
    assert linear.choose_backends(counts, torch.float32, CPU, True, recorded=record) == {
        "40x48": "triton", "96x48": "triton", "48x40": "triton"}


def test_cublas_is_never_allowed_without_cuda():
    assert not linear.cublas_allowed(40, 48, [1, 3], torch.float32, CPU, False, False)
    assert not linear.cublas_allowed(40, 48, [1, 3], torch.float32, CPU, True, True)


def _small(**changes):
    return tiny_config(kernels="triton", limits={"max_batch_size": 2, "max_seq_len": 64, "max_num_tokens": 32},
                       buckets={"batch_sizes": [1, 2], "context_batch_sizes": [1], "chunk_sizes": [16],
                                "sampling": ["greedy"]}, **changes)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (the Triton set on the CPU)")
def test_capture_records_the_timed_table_and_a_start_installs_it_untimed(tmp_path, monkeypatch, restore_backends):
    import yaml

    calls = []
    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: True)
    monkeypatch.setattr(linear, "time_backend", fake_timer({(64, 64)}, calls))  # o: Triton below 16 rows
    monkeypatch.setattr(executor, "linear_timer", lambda device: lambda work: 0.0)  # the CPU has no GPU timer
    cfg = tmp_path / "m.yaml"
    cfg.write_text(yaml.safe_dump(_small().to_dict()))
    art = tmp_path / "art"
    res = CliRunner().invoke(main, ["capture", "--config", str(cfg), "--out", str(art)])
    assert res.exit_code == 0, res.output
    totals = json.loads((art / MANIFEST_NAME).read_text())["totals"]
    backends = totals["linear_backends"]
    assert backends["64x64"] == "cublas+triton:1,2" and set(backends.values()) == {"cublas+triton:1,2", "cublas"}
    assert set(totals["linear_times_us"]) == set(backends)
    assert totals["linear_times_us"]["64x64"] == {"cublas": 210.0, "chosen": 110.0}  # rows 1, 2 and 16
    shown = CliRunner().invoke(main, ["inspect", str(art / MANIFEST_NAME)])
    assert shown.exit_code == 0 and "64x64 cublas+triton:1,2 (110.0 us; cublas alone 210.0 us)" in shown.output, \
        shown.output

    def no_timing(*a, **k):
        raise AssertionError("a start timed the GEMMs again")

    monkeypatch.setattr(linear, "time_backend", no_timing)
    engine = Engine(art)  # re-records every key with the recorded table
    try:
        assert linear.installed_backends() == backends
    finally:
        engine.close()

    # a start on a build that may not run cuBLAS where the capture did: refused, nothing replayed
    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "abc", "max_tokens": 2}) + "\n")
    res = CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest", str(art)])
    assert res.exit_code == 2 and "totals.linear_backends records another kernel choice" in res.output
    assert "Recapture" in res.output and "Traceback" not in res.output


@pytest.mark.gpu
def test_gpu_timing_picks_by_the_measured_times(restore_backends):
    """On CUDA (fp32, the stdlib model's shapes, where cuBLAS's heuristic is slow at 8-16 rows): cuBLAS
    timed at each distinct row count, Triton where cuBLAS is suspect; the record follows the times, per
    row count without `deterministic`, by the sums with it; linear_residual through the mixed choice
    stays correct; timing again holds no more device memory."""
    cuda = torch.device("cuda")
    counts = {(256, 256): [1, 8, 8, 16, 24], (256, 704): [1, 8, 16, 64]}
    got = linear.choose_backends(counts, torch.float32, cuda, False, frozenset({(256, 704)}),
                                 timer=executor.linear_timer(cuda))
    times = linear.installed_times()
    assert set(times) == set(got) == {"256x256", "256x704"}
    for (n, k), rows in linear._ROW_TIMES.items():
        assert sorted(rows["cublas"]) == sorted(set(counts[(n, k)]))
        assert sorted(rows["triton"]) == linear.suspect_rows(rows["cublas"])
        assert all(us > 0 for t in rows.values() for us in t.values())
        fast = sorted(linear.triton_rows(rows))
        want = "triton" if len(fast) == len(rows["cublas"]) else "cublas" + (
            "+triton:" + ",".join(map(str, fast)) if fast else "")
        assert got[f"{n}x{k}"] == want
        assert times[f"{n}x{k}"]["chosen"] <= times[f"{n}x{k}"]["cublas"]
    for m in (1, 8, 16, 64):
        x = torch.randn(m, 704, device=cuda)
        w, r = torch.randn(256, 704, device=cuda), torch.randn(m, 256, device=cuda)
        torch.testing.assert_close(linear.linear_residual(x, w, r.clone()), r + x @ w.t(), rtol=1e-4, atol=1e-3)
    got = linear.choose_backends(counts, torch.float32, cuda, True, timer=executor.linear_timer(cuda))
    for (n, k), rows in linear._ROW_TIMES.items():
        tri = rows["triton"]
        assert not tri or sorted(tri) == sorted(set(counts[(n, k)]))  # timed at every row count, or none
        whole = tri and linear.pick({"cublas": sum(rows["cublas"].values()), "triton": sum(tri.values())})
        assert got[f"{n}x{k}"] == (whole or "cublas")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(cuda)
    for _ in range(3):
        linear.choose_backends(counts, torch.float32, cuda, False, timer=executor.linear_timer(cuda))
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(cuda) == before


def test_without_deterministic_each_row_count_takes_the_faster(monkeypatch, restore_backends):
    """cuBLAS's fp32 tiles at 8-16 rows (the H200's stdlib-model times, us a call): Triton timed there only
    and taken where it needs at most 0.8 of cuBLAS's time; the record names those rows, a start installs
    them, and linear() dispatches by the row count."""
    cublas = {1: 3.0, 4: 5.3, 8: 33.0, 12: 32.9, 16: 33.1, 24: 6.7}
    triton = {1: 6.5, 4: 6.6, 8: 6.6, 12: 6.6, 16: 26.5, 24: 6.6}
    timed = []
    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: True)
    monkeypatch.setattr(linear, "time_backend", lambda b, n, k, rows, *a: timed.append((b, tuple(rows))) or {
        m: (cublas if b == "cublas" else triton)[m] for m in rows})
    counts = {(256, 256): [1, 4, 8, 12, 16, 24]}
    record = {"256x256": "cublas+triton:8,12"}
    assert linear.choose_backends(counts, torch.float32, CPU, False, timer=lambda work: 0.0) == record
    assert timed == [("cublas", (1, 4, 8, 12, 16, 24)), ("triton", (8, 12, 16))]
    assert linear.installed_times() == {"256x256": {"cublas": 114.0, "chosen": 61.3}}
    # with `deterministic`, one backend for every row count: by the sums
    assert linear.choose_backends(counts, torch.float32, CPU, True, timer=lambda work: 0.0) == {"256x256": "triton"}
    assert linear.installed_times() == {"256x256": {"cublas": 114.0, "chosen": 59.4}}
    # the record installed as is; refused (Triton) with `deterministic`, where rows may not switch kernels
    assert linear.choose_backends(counts, torch.float32, CPU, False, recorded=record) == record
    ran = []
    monkeypatch.setattr(linear, "triton_linear", lambda x, w, bias=None, residual=None: ran.append(len(x)) or x @ w.t())
    w = torch.randn(256, 256)
    for m in (1, 8, 12, 24):
        torch.testing.assert_close(linear.linear(torch.ones(m, 256), w), torch.ones(m, 256) @ w.t())
    assert ran == [8, 12]
    assert linear.choose_backends(counts, torch.float32, CPU, True, recorded=record) == {"256x256": "triton"}


@pytest.mark.parametrize("backends, times, ok", [
    ({"64x64": "cublas+triton:8,12"}, {"64x64": {"cublas": 120.5, "chosen": 47}}, True),
    ({"64x64": "triton", "96x64": "cublas"}, {}, True),
    ({"64x64": "cublas+triton:"}, {}, False),
    ({"64x64": "triton+cublas:8"}, {}, False),
    ({"64x64": "cublas"}, {"96x64": {"cublas": 1.0, "chosen": 1.0}}, False),  # times of an unrecorded shape
    ({"64x64": "cublas"}, {"64x64": {"cublas": 1.0}}, False),
    ({"64x64": "cublas"}, {"64x64": {"cublas": 1.0, "triton": 1.0}}, False),
    ({"64x64": "cublas"}, {"64x64": {"cublas": -1.0, "chosen": 2.0}}, False),
    ({"64x64": "cublas"}, {"64x64": [1.0, 2.0]}, False),
])
def test_the_manifest_records_are_checked(default_artifacts, tmp_path, backends, times, ok):
    from trtgraph.artifacts import _digest, load_manifest
    from trtgraph.errors import ManifestError

    body = json.loads((default_artifacts / MANIFEST_NAME).read_text())
    body["totals"]["linear_backends"] = backends
    body["totals"]["linear_times_us"] = times
    body["digest"] = _digest(body)
    path = tmp_path / MANIFEST_NAME
    path.write_text(json.dumps(body))
    if ok:
        assert load_manifest(path).totals["linear_backends"] == backends
    else:
        with pytest.raises(ManifestError, match=r"totals\.linear_"):
            load_manifest(path)


def test_a_shape_whose_timing_runs_out_of_memory_keeps_cublas_untimed(monkeypatch, restore_backends):
    """The timing's weight copies and outputs must not fail a capture whose plan fits: that shape is
    not timed (cuBLAS, no times recorded); the others are."""
    def time_backend(b, n, k, rows, *a):
        if (n, k) == (96, 48):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return {m: (100.0 if m < 2 else 10.0) if b == "cublas" else 5.0 for m in rows}

    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: True)
    monkeypatch.setattr(linear, "time_backend", time_backend)
    got = linear.choose_backends({(40, 48): [1, 2], (96, 48): [1, 2]}, torch.float32, CPU, False,
                                 timer=lambda work: 0.0)
    assert got == {"40x48": "cublas+triton:1", "96x48": "cublas"}
    assert set(linear.installed_times()) == {"40x48"}
