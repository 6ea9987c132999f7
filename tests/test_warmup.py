"""Start-up warms only the keys the capture found load a kernel or make a buffer
(`totals.warmup_keys`, trtgraph/runtime/warmup.py), and refuses a start where a kernel first
loads while a graph is recorded; the capture's step timings (compiler/timing.py)."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch

from trtgraph.artifacts import MANIFEST_NAME, _digest, load_manifest
from trtgraph.compiler import pipeline
from trtgraph.compiler.timing import time_step
from trtgraph.errors import ManifestError
from trtgraph.runtime import warmup
from trtgraph.runtime.serving.engine import Engine
from trtgraph.buckets import GraphKey
from trtgraph.runtime.step.executor import Executor

from conftest import tiny_config


def _warm_order(manifest) -> list:
    return sorted(manifest.graph_keys, key=lambda k: (-k.num_tokens, k))


def _warmed(monkeypatch) -> list:
    """Every key Executor.warmup runs from now on, in order."""
    seen, real = [], Executor.warmup

    def spy(self, key):
        seen.append(key)
        return real(self, key)

    monkeypatch.setattr(Executor, "warmup", spy)
    return seen


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    body = json.loads((dst / MANIFEST_NAME).read_text())
    edit(body["totals"])
    body["digest"] = _digest(body)
    (dst / MANIFEST_NAME).write_text(json.dumps(body, indent=2))
    return dst


def test_capture_records_the_first_key_and_the_replay_timing(default_artifacts):
    m = load_manifest(default_artifacts)
    # Static backend: no Triton kernel loads, no device memory: the first key of the warm order alone.
    assert m.totals["warmup_keys"] == [str(_warm_order(m)[0])]
    t = m.totals["replay_timing"]
    assert 1 <= t["repeats_min"] <= t["repeats_max"] and 0 <= t["spread_median"] <= t["spread_max"]


def test_capture_records_each_key_that_loaded_a_new_kernel(tmp_path, monkeypatch):
    """A fake kernel count: the decode keys of batch 2 share one kernel, the prefill keys one
    per sampling mode. The first key of the warm order, and each key that loaded one of these
    first, are warmup_keys; the keys that only reuse them are not."""
    loads, real = set(), pipeline.eager_reference

    def kernel_of(key):
        return "prefill " + key.sampling if key.is_prefill else "decode bs2" if key.batch_size == 2 else None

    def warm(ex, key, seed):  # the capture's warm-up run of a key (its eager reference)
        if kernel_of(key):
            loads.add(kernel_of(key))
        return real(ex, key, seed)

    monkeypatch.setattr(pipeline, "eager_reference", warm)
    monkeypatch.setattr(pipeline, "loaded_kernels", lambda: len(loads))
    pipeline.capture(tiny_config(), tmp_path)
    order = _warm_order(load_manifest(tmp_path))
    firsts = {}
    for k in order:
        firsts.setdefault(kernel_of(k), k)
    firsts.pop(None)
    expected = [order[0]] + [k for k in order[1:] if k in firsts.values()]
    assert load_manifest(tmp_path).totals["warmup_keys"] == [str(k) for k in expected]
    assert len(expected) >= 3 and any(not k.is_prefill for k in expected)


def test_a_capture_in_a_process_that_had_loaded_kernels_records_every_key(tmp_path, monkeypatch):
    """A capture after other work in the same process (the Python API, a test suite: on the H200
    a capture after other GPU tests) does not see its keys' first loads: those kernels were loaded
    already. Its warmup_keys held the first key alone, and a fresh process starting the manifest
    refused a later key's recording ("loaded 9 Triton kernel(s) that the warm-up ... had not").
    Now every key is a warm-up key there (a slower start, never a refused one)."""
    monkeypatch.setattr(pipeline, "loaded_kernels", lambda: 7)  # loaded before, none by the keys' runs
    pipeline.capture(tiny_config(), tmp_path)
    m = load_manifest(tmp_path)
    assert m.totals["warmup_keys"] == [str(k) for k in _warm_order(m)]


def test_a_start_warms_only_the_recorded_keys(default_artifacts, monkeypatch):
    seen = _warmed(monkeypatch)
    engine = Engine(default_artifacts)
    assert [str(k) for k in seen] == engine.manifest.totals["warmup_keys"]
    assert len(seen) < len(engine.manifest.keys)
    assert len(engine.executor.runner._graphs) == len(engine.manifest.keys)  # every key re-recorded
    [result] = engine.generate([{"id": "a", "prompt": "warm enough", "max_tokens": 5}])
    assert len(result.token_ids) == 5


def test_a_manifest_without_warmup_keys_warms_every_key(default_artifacts, tmp_path, monkeypatch):
    art = _edited_copy(default_artifacts, tmp_path / "art", lambda t: t.pop("warmup_keys"))
    seen = _warmed(monkeypatch)
    engine = Engine(art)
    assert seen == engine.manifest.capture_order


def test_a_warmup_key_not_in_the_manifest_is_refused(default_artifacts, tmp_path):
    art = _edited_copy(default_artifacts, tmp_path / "art",
                       lambda t: t.__setitem__("warmup_keys", ["(bs=3, decode draft=0, greedy)"]))
    with pytest.raises(ManifestError, match=r"totals\.warmup_keys names '\(bs=3, decode draft=0, greedy\)'"):
        Engine(art)


def test_malformed_warmup_keys_are_refused_by_the_reader(default_artifacts, tmp_path):
    art = _edited_copy(default_artifacts, tmp_path / "art", lambda t: t.__setitem__("warmup_keys", "all"))
    with pytest.raises(ManifestError, match=r"totals\.warmup_keys"):
        load_manifest(art)


def test_a_kernel_first_loaded_while_a_graph_is_recorded_refuses_the_start(default_artifacts, monkeypatch):
    count = iter(range(1000))
    monkeypatch.setattr(warmup, "loaded_kernels", lambda: next(count))  # one more load at every look
    with pytest.raises(ManifestError, match=r"recording its graph loaded 1 Triton kernel\(s\) that the warm-up"):
        Engine(default_artifacts)


def test_loaded_kernels_counts_every_specialisation_of_the_kernels_package(monkeypatch):
    from triton.runtime.jit import JITFunction

    def kernel(x):
        pass

    before = warmup.loaded_kernels()
    fn = JITFunction(kernel)
    fn.device_caches = {0: ({"spec a": object(), "spec b": object()}, None)}
    module = types.ModuleType("trtgraph.kernels._test_fake")
    module.kernel = fn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert warmup.loaded_kernels() == (before or 0) + 2
    fn.device_caches = {0: "another layout"}  # another Triton's: unknown, so every key is warmed
    assert warmup.loaded_kernels() is None


def test_time_step_on_the_cpu_runs_the_asked_repeats(default_artifacts):
    engine = Engine(default_artifacts)
    key = engine.manifest.capture_order[-1]
    with torch.inference_mode():
        t = time_step(engine.executor, key, eager=False, repeats=4)
    assert t.repeats == 4 and 0 < t.min_ms <= t.median_ms <= t.max_ms and t.spread >= 0


class _FakeClock:
    """CUDA events and an executor whose runs take scripted milliseconds (PendingTiming's logic
    without a GPU)."""

    def __init__(self, durations, device: str = "cpu"):
        self.now, self.durations, self.prepared, self.runs = 0.0, list(durations), 0, 0
        self.device, self.calls = torch.device(device), []
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = clock.now
                clock.calls.append("record")

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        self.Event = Event

    def prepare(self, key, rows):
        assert rows == []  # timing runs on padding-only inputs
        self.prepared += 1

    def execute(self, key, eager=False):
        self.runs += 1
        self.now += self.durations.pop(0)
        self.calls.append("run")


@pytest.mark.parametrize("durations, runs, prepared", [
    ([1.0, 1.01], 2, 1),                      # two runs within 3%: that is the timing
    ([1.0, 1.2] + [1.1] * 30, 20, 2),         # noisy: more runs, up to `repeats`, within the budget
    ([24.0, 30.0], 2, 1),                     # noisy but a third run would not fit 25 ms
    ([4.0, 5.0] + [4.5] * 30, 5, 2),          # noisy: runs to fill 25 ms at the median (int(25 / 4.5) = 5 in all)
])
def test_cuda_step_timing_stops_at_two_steady_runs_and_adds_runs_to_noisy_ones(durations, runs, prepared, monkeypatch):
    from trtgraph.compiler import timing

    fake = _FakeClock(durations)
    monkeypatch.setattr(timing.torch.cuda, "Event", fake.Event)
    t = timing.PendingTiming(fake, "key", eager=False, repeats=20, budget_ms=25.0).timing()
    assert (t.repeats, fake.runs, fake.prepared) == (runs, runs, prepared)
    assert t.min_ms == pytest.approx(min(durations[:runs])) and t.max_ms == pytest.approx(max(durations[:runs]))


def test_cuda_step_timing_runs_queue_behind_a_device_spin(monkeypatch):
    """On CUDA each batch of timing runs (the first ones, and further ones) is queued behind a
    spin of the device (SPIN_CYCLES), before its first event: the runs then go back to back on
    the device instead of at the host's pace (h/u10's call: the first run held the launch's gap)."""
    from trtgraph.compiler import timing

    fake = _FakeClock([1.0, 1.2] + [1.1] * 30, device="cuda")
    monkeypatch.setattr(timing.torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: fake.calls.append(("spin", cycles)), raising=False)
    timing.PendingTiming(fake, "key", eager=False, repeats=5, budget_ms=25.0).timing()
    spin = ("spin", timing.SPIN_CYCLES)
    assert fake.calls == [spin, "record", "run", "record", "run", "record",  # the first 2 runs
                          spin, "record", "run", "record", "run", "record", "run", "record"]  # 3 more


@pytest.mark.parametrize("key, by_verification", [
    (GraphKey(4, 0, 256, "greedy"), True),    # a prefill key: its time steers nothing
    (GraphKey(1, 0, 64, "sampled"), True),
    (GraphKey(64, 0, 0, "greedy"), False),    # decode keys' times steer speculation: runs of their own
    (GraphKey(8, 3, 0, "sampled"), False),    # verify keys' too
])
def test_only_prefill_keys_are_timed_by_their_verification_replay(key, by_verification):
    from trtgraph.compiler.timing import timed_by_verification

    assert timed_by_verification(key) is by_verification


def test_a_verification_timing_is_its_replay_clock_read_once_the_verification_is_done(monkeypatch):
    """A prefill key's timing (`VerificationTiming`): ready when its verification is, never
    more runs, one run: the verification replay's clock (CUDA: after its end event passed)."""
    from trtgraph.compiler import timing

    fake = _FakeClock([])

    class Clock:
        cuda, end = True, fake.Event()
        waited = []

        def __init__(self):
            self.end.synchronize = lambda: self.waited.append(True)

        def ms(self):
            return 3.5

    class Parity:
        replay_clock, done = Clock(), False

        def ready(self):
            return self.done

    parity = Parity()
    t = timing.VerificationTiming(parity)
    assert not t.ready() and t.queue_more() is False
    parity.done = True
    assert t.ready()
    got = t.timing()
    assert (got.median_ms, got.min_ms, got.max_ms, got.repeats) == (3.5, 3.5, 3.5, 1) and Clock.waited == [True]


def test_capture_reads_each_key_lag_keys_after_launching_it(monkeypatch, tmp_path):
    """The host never waits on a key's verification before LAG_KEYS more keys are captured and
    their work queued (the last ones: after the loop); each key's verification (against its
    warm-up's eager reference) is launched right after its capture and read once."""
    calls = []
    real, real_capture = pipeline.launch_verify, Executor.capture

    def launch(ex, key, seed, reference=None):
        assert reference is not None and reference.seed == seed  # the warm-up's run, not a second one
        calls.append(("launch", key))
        pending = real(ex, key, seed, reference)
        read = pending.parity
        pending.parity = lambda: (calls.append(("read", key)), read())[1]
        return pending

    def capture(self, key):
        calls.append(("capture", key))
        return real_capture(self, key)

    monkeypatch.setattr(pipeline, "launch_verify", launch)
    monkeypatch.setattr(Executor, "capture", capture)
    monkeypatch.setattr(pipeline, "LAG_KEYS", 5)  # below the tiny plan's key count (the CPU reads at the lag)
    result = pipeline.capture(tiny_config(), tmp_path / "art")
    k, lag = result.manifest.capture_order, pipeline.LAG_KEYS
    n = len(k)
    assert n > lag + 1
    want = [c for i in range(n) for c in (("capture", k[i]), ("launch", k[i]))
            + ((("read", k[i - lag]),) if i >= lag else ())] + [("read", k[i]) for i in range(n - lag, n)]
    assert calls == want


def test_the_kernel_functions_are_scanned_again_only_when_modules_change(monkeypatch):
    pytest.importorskip("triton")
    first = warmup._jit_functions()
    assert warmup._jit_functions() is first  # no module imported since: the same scan
    monkeypatch.setitem(sys.modules, "trtgraph.kernels._test_other", types.ModuleType("trtgraph.kernels._test_other"))
    assert warmup._jit_functions() is not first
