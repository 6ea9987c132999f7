"""The start-up clock (trtgraph/startup.py): phases from the process's start to its exit, the
bytecode cache for environments that keep none, and `run`'s phases covering its wall time."""

from __future__ import annotations

import importlib
import json
import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trtgraph import startup

ROOT = Path(__file__).resolve().parents[1]


def test_the_first_engine_of_a_process_starts_with_the_interpreter_and_later_ones_with_imports(monkeypatch):
    monkeypatch.setattr(startup, "INTERPRETER", 0.25)
    clock = startup.StartupClock()
    clock.begin()
    clock.lap("re_record")
    clock.first_token(0.5)
    clock.first_token(0.75)  # only the first counts
    body = clock.to_json()
    assert list(body["phases_seconds"]) == ["interpreter", "imports", "re_record"]
    assert body["phases_seconds"]["interpreter"] == 0.25
    assert body["first_token_seconds"] == 0.5  # beside the phases, not in their sum
    assert body["total_seconds"] == pytest.approx(sum(body["phases_seconds"].values()), abs=1e-3)
    clock.begin()  # a second engine in the same process
    assert list(clock.phases) == ["imports"] and clock.first_token_seconds is None
    assert "phases" in clock.text() and "<- largest" in clock.text()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_the_process_age_is_read_from_proc():
    age = startup.process_age()
    assert age is not None and 0 <= age < time.time()  # this process started before the test
    assert startup.INTERPRETER is not None and startup.INTERPRETER >= 0


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package whose bytecode is nowhere yet; the interpreter's bytecode settings restored after."""
    name = f"u5_fake_pkg_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / "src" / name).mkdir(parents=True)
    (tmp_path / "src" / name / "__init__.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(startup.CLOCK, "notes", [])
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def test_bytecode_goes_to_a_cache_where_python_keeps_none_and_may_not_write_it(fake_package, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"})
    prefix = tmp_path / "pyc"
    got = startup.cache_bytecode({"TRTGRAPH_PYCACHE": str(prefix)}, probe=fake_package)
    assert got == str(prefix) and sys.pycache_prefix == str(prefix) and sys.dont_write_bytecode is False
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(prefix)  # spawned ranks read the same cache
    assert startup.CLOCK.notes and "TRTGRAPH_PYCACHE=off" in startup.CLOCK.notes[0]
    assert importlib.import_module(fake_package).VALUE == 42
    assert list(prefix.rglob(f"{fake_package}*/__init__*.pyc")) or list(prefix.rglob("__init__*.pyc"))


def test_bytecode_settings_are_left_alone_when_off_present_writable_or_prefixed(fake_package, tmp_path, monkeypatch):
    env = {"TRTGRAPH_PYCACHE": str(tmp_path / "pyc")}
    assert startup.cache_bytecode({"TRTGRAPH_PYCACHE": "off"}, probe=fake_package) is None
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python writes it beside the sources itself
    assert startup.cache_bytecode(env, probe=fake_package) is None
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))  # PYTHONPYCACHEPREFIX: the user's choice
    assert startup.cache_bytecode(env, probe=fake_package) is None
    monkeypatch.setattr(sys, "pycache_prefix", None)
    spec = importlib.util.find_spec(fake_package)
    py_compile.compile(spec.origin, cfile=spec.cached)  # the bytecode is there
    assert startup.cache_bytecode(env, probe=fake_package) is None
    assert startup.cache_bytecode(env, probe="torch") is None  # already imported: too late to matter
    assert sys.pycache_prefix is None and not (tmp_path / "pyc").exists() and startup.CLOCK.notes == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_run_phases_cover_the_process_from_its_start_to_its_exit(default_artifacts, tmp_path):
    """`python -m trtgraph run`: the phases start at the process's start (interpreter) and end
    after the results are written; the process then exits at once, so the phases hold nearly
    all of the wall time its parent sees."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"hello {i}", "max_tokens": 4}) + "\n"
                               for i in range(3)))
    summary, out = tmp_path / "summary.json", tmp_path / "out.jsonl"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", str(prompts), "--manifest",
                           str(default_artifacts), "--output", str(out), "--summary-json", str(summary), "--verbose"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["r0", "r1", "r2"]
    body = json.loads(summary.read_text())["startup"]
    phases = body["phases_seconds"]
    assert list(phases)[:2] == ["interpreter", "imports"] and list(phases)[-1] == "serving"
    assert body["total_seconds"] <= wall
    assert body["total_seconds"] >= 0.8 * wall - 0.5, (body, wall)  # the rest: the parent's spawn and the exit
    assert "then the process exits at once" in done.stderr and "summary" in done.stderr


def test_bytecode_that_no_longer_matches_its_source_counts_as_none(fake_package, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"})
    spec = importlib.util.find_spec(fake_package)
    py_compile.compile(spec.origin, cfile=spec.cached)
    assert startup._current(spec.cached, spec.origin)
    Path(spec.origin).write_text("VALUE = 43  # edited: another size\n")
    assert not startup._current(spec.cached, spec.origin)
    assert startup.cache_bytecode({"TRTGRAPH_PYCACHE": str(tmp_path / "pyc")}, probe=fake_package) == str(tmp_path / "pyc")


def test_cuda_starts_early_only_for_one_process_on_a_cuda_device_before_torch():
    assert "torch" in sys.modules  # this test process: nothing left to overlap
    assert startup.start_cuda_early("cuda") is None
    code = ("import sys; from trtgraph import startup as s; "
            "assert s.start_cuda_early('cpu') is None and s.start_cuda_early('cuda', processes=2) is None; "
            "assert s.start_cuda_early('cuda:x') is None; t = s.start_cuda_early('cuda:0'); t.join(30); "
            "print(t.is_alive(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "0"})
    # the thread ends (a context made, or no driver here: quietly) and imports nothing
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr


def test_freeze_heap_on_cuda_only_and_unfrozen_at_exit(monkeypatch):
    """A serving process's heap is frozen once its engine is built on CUDA (a full collection
    then walks only what serving makes), lapped as `heap_frozen`, with one exit hook that puts
    it back; on the CPU nothing changes (tests build many engines in one process)."""
    import gc
    import types

    from trtgraph import startup

    hooks = []
    monkeypatch.setattr(startup.atexit, "register", hooks.append)
    monkeypatch.setattr(startup, "_UNFREEZE_AT_EXIT", [])
    before = gc.get_freeze_count()
    try:
        assert not startup.freeze_heap(types.SimpleNamespace(type="cpu"))
        assert gc.get_freeze_count() == before and "heap_frozen" not in startup.CLOCK.phases
        assert startup.freeze_heap(types.SimpleNamespace(type="cuda"))
        assert gc.get_freeze_count() > before and "heap_frozen" in startup.CLOCK.phases
        assert startup.freeze_heap(types.SimpleNamespace(type="cuda"))
        assert hooks == [gc.unfreeze]  # one hook, however many engines
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_programs_imports_run_without_the_collector_and_begin_freezes_them(monkeypatch):
    """`trtgraph` (cli.entry) imports with the cyclic collector off (it walked torch's objects
    about 400 times during the import); the first `begin()` freezes what the imports made and
    turns it back on, with the one exit hook that unfreezes; without `defer_gc` nothing changes
    (a library's caller keeps its collector)."""
    import gc

    hooks = []
    monkeypatch.setattr(startup.atexit, "register", hooks.append)
    monkeypatch.setattr(startup, "_UNFREEZE_AT_EXIT", [])
    monkeypatch.setattr(startup, "_GC_DEFERRED", [])
    monkeypatch.setattr(startup, "CLOCK", startup.StartupClock())
    assert gc.isenabled() and gc.get_freeze_count() == 0
    startup.resume_gc()
    startup.begin()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and hooks == []  # never deferred: left alone
    try:
        startup.defer_gc()
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # what an import makes, kept
        startup.begin()
        assert gc.isenabled() and gc.get_freeze_count() > len(made) and hooks == [gc.unfreeze]
        startup.begin()  # a later engine: nothing more to do
        startup.freeze_heap(type("D", (), {"type": "cuda"})())
        assert hooks == [gc.unfreeze]  # one hook for both freezes
    finally:
        gc.enable()
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_program_defers_the_collector_until_its_capture_begins(tmp_path):
    """`python -m trtgraph capture`: the collector is off while it imports and on (the imports'
    objects frozen) once the capture begins."""
    code = ("import gc, sys; import trtgraph.startup as s; seen = []; real = s.resume_gc\n"
            "def resume():\n"
            "    seen.append((gc.isenabled(), 'torch' in sys.modules)); real(); seen.append((gc.isenabled(), gc.get_freeze_count() > 0))\n"
            "    print(seen, file=sys.stderr, flush=True)\n"
            "s.resume_gc = resume\n"
            "from trtgraph.cli import entry; sys.argv = ['trtgraph', 'capture', '--device', 'cpu', '--out', sys.argv[1]]; entry()")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "art")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "[(False, True), (True, True)]" in out.stderr
