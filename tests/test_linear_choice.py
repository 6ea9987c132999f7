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
    tables = (linear._BACKENDS, linear._TRITON_ROWS, linear._ROW_TIMES)
    saved = [dict(t) for t in tables]
    yield
    for t, before in zip(tables, saved):
        t.clear(), t.update(before)


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
    got = linear.choose_backends(counts, torch.float32, CPU, False, frozenset({(48, 40)}), timer=lambda work: 0.0)
    # Triton timed and taken at the suspect row counts only (40x48 at 1 and 4: cuBLAS 100 against its 10 at 16)
    assert got == {"40x48": "cublas+triton:1,4", "96x48": "cublas", "48x40": "cublas"}
    assert linear.installed_times() == {"40x48": {"cublas": 210.0, "chosen": 110.0},
                                        "48x40": {"cublas": 100.0, "chosen": 100.0},
                                        "96x48": {"cublas": 200.0, "chosen": 200.0}}
    assert [linear.runs_cublas((40, 48), m) for m in (1, 4, 16)] == [False, False, True]
    # distinct row counts, sorted; the residual shapes in linear_residual's form; Triton only where suspect
    assert ("cublas", 40, 48, (1, 4, 16), False) in calls and ("cublas", 48, 40, (2,), True) in calls
    assert [c for c in calls if c[0] == "triton"] == [("triton", 40, 48, (1, 4), False)]

    calls.clear()  # with `deterministic` nothing is timed: the choice stays a function of the plan
    assert linear.choose_backends(counts, torch.float32, CPU, True, timer=lambda work: 0.0) == {
        "40x48": "cublas", "96x48": "cublas", "48x40": "cublas"}
    assert calls == [] and linear.installed_times() == {}

    record = {"40x48": "cublas", "96x48": "triton", "48x40": "cublas"}
    assert linear.choose_backends(counts, torch.float32, CPU, False, recorded=record, timer=lambda work: 0.0) == record
    assert calls == [] and linear.installed_times() == {}  # the record is installed, never re-timed
    assert linear.choose_backends(counts, torch.float32, CPU, False) == {
        "40x48": "cublas", "96x48": "cublas", "48x40": "cublas"}  # untimed: cuBLAS wherever allowed
    assert calls == []
    # a record that lacks a shape, or names cuBLAS where this build does not allow it: Triton
    # there, which the runtime's comparison with the record then refuses
    assert linear.choose_backends(counts, torch.float32, CPU, True, recorded={"40x48": "cublas"}) == {
        "40x48": "cublas", "96x48": "triton", "48x40": "triton"}
    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: False)
    assert linear.choose_backends(counts, torch.float32, CPU, True, recorded=record) == {
        "40x48": "triton", "96x48": "triton", "48x40": "triton"}


def test_a_start_loads_the_triton_kernels_its_record_runs(monkeypatch, restore_backends):
    """Capture's timing loaded the Triton GEMM's variants (one per kind of row count: 1, a multiple of 16,
    other) before its warm-up chose the keys a start warms; a start that installs the record loads them
    too (on CUDA), so no key's recording is the first to load one."""
    loads, launched = [], []
    monkeypatch.setattr(linear, "cublas_allowed", lambda *a: True)
    monkeypatch.setattr(linear, "_load_triton", lambda n, k, rows, dtype, device, residual: loads.append(
        ((n, k), tuple(rows), residual)))
    counts = {(40, 48): [1, 2, 8, 16, 32, 256], (96, 48): [1, 3, 16, 48], (48, 40): [1, 8]}
    record = {"40x48": "cublas+triton:2,8,16,32", "96x48": "triton", "48x40": "cublas"}
    cuda = torch.device("cuda")  # (nothing touches a device: the loads are the spy above)
    assert linear.choose_backends(counts, torch.float32, cuda, False, frozenset({(96, 48)}), recorded=record) == record
    assert sorted(loads) == [((40, 48), (2, 8, 16, 32), False), ((96, 48), (1, 3, 16, 48), True)]
    loads.clear()
    linear.choose_backends(counts, torch.float32, CPU, False, recorded=record)
    assert loads == []  # the interpreter loads nothing
    monkeypatch.undo()
    monkeypatch.setattr(linear, "triton_linear", lambda x, w, bias=None, residual=None: launched.append(
        (len(x), residual is not None)))
    linear._load_triton(40, 48, [2, 8, 16, 32], torch.float32, CPU, False)
    linear._load_triton(96, 48, [1, 3, 16, 48], torch.float32, CPU, True)
    assert launched == [(2, False), (16, False), (1, True), (3, True), (16, True)]  # one per kind of row count


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
    assert "cuBLAS is not allowed here where the capture ran it" in res.output
    assert "Recapture" in res.output and "Traceback" not in res.output


@pytest.mark.gpu
def test_gpu_timing_picks_by_the_measured_times(restore_backends):
    """On CUDA (fp32, the stdlib model's shapes, where cuBLAS's heuristic is slow at 8-16 rows): cuBLAS
    timed at each distinct row count, Triton where cuBLAS is suspect; the record follows the times;
    linear_residual through the mixed choice stays correct; with `deterministic` nothing is timed;
    timing again holds no more device memory."""
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
    assert linear.choose_backends(counts, torch.float32, cuda, True, timer=executor.linear_timer(cuda)) and \
        linear.installed_times() == {}  # with `deterministic` nothing is timed
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(cuda)
    for _ in range(3):
        linear.choose_backends(counts, torch.float32, cuda, False, timer=executor.linear_timer(cuda))
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(cuda) == before


@pytest.mark.gpu
def test_gpu_graph_timer_measures_the_device_work():
    """The timer measures the GPU's time for the recorded work, not the host's: a spin of N cycles
    reads about twice a spin of N / 2, and ten short kernels well under the host's time to launch them."""
    from trtgraph.runtime.step.cuda_graph import graph_time_us

    cuda = torch.device("cuda")
    long, short = (graph_time_us(lambda c=c: torch.cuda._sleep(c), cuda) for c in (2_000_000, 1_000_000))
    assert 1.7 < long / short < 2.3 and short > 100, (long, short)
    x = torch.ones(8, device=cuda)
    tiny = graph_time_us(lambda: [x.add_(1) for _ in range(10)], cuda)
    assert tiny < 40, tiny  # ten element-wise kernels replayed: a few us each at most


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


@pytest.mark.gpu
def test_gpu_a_capture_with_a_timed_record_starts_in_a_fresh_process(tmp_path):
    """The shipped stdlib model (fp32) at 1-16 rows, where cuBLAS's heuristic is slow at 8-16 rows on the
    H200: capture (timing, record), then `trtgraph run` in another process, which installs the record,
    loads the Triton kernels it runs before its warm-up, re-records every key and generates."""
    import subprocess
    import sys

    import yaml

    cfg = yaml.safe_load(open("examples/stdlib-llama.yaml"))
    cfg["model"]["path"] = os.path.abspath("trtgraph/assets/stdlib-llama")
    cfg.update(device="cuda", limits={"max_batch_size": 16, "max_num_tokens": 256},
               buckets={"batch_sizes": [1, 8, 12, 16], "context_batch_sizes": [1, 2], "chunk_sizes": [64],
                        "sampling": ["greedy"]}, output=str(tmp_path / "art"))
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cap = subprocess.run([sys.executable, "-m", "trtgraph", "capture", "--config", str(tmp_path / "m.yaml")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert cap.returncode == 0, cap.stderr[-2000:]
    totals = json.loads((tmp_path / "art" / MANIFEST_NAME).read_text())["totals"]
    print("record", totals["linear_backends"], totals.get("linear_times_us"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": "def f(x):", "max_tokens": 8}) + "\n" for i in range(16)))
    run = subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", str(prompts), "--manifest",
                          str(tmp_path / "art"), "--output", str(tmp_path / "out.jsonl")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 16
