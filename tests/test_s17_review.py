"""Review of the seventeenth session's speculation changes (the probe budget, the unmeasured
verify key's price): regression tests for what the review found."""

from __future__ import annotations

import pytest

from test_s17_probe_budget import _policy, _run
from trtgraph.runtime.serving import speculation
from trtgraph.runtime.serving.requests import Request
from trtgraph.runtime.serving.scheduler import Sequence
from trtgraph.runtime.serving.speculation import MAX_FLOOR


def test_one_slow_probe_holds_hope_back_for_max_floor_steps_at_most():
    """A probe that hope calls waits while the budget is in debt, MAX_FLOOR steps at most: one
    slow probe (a GC pause of 100 ms against plain steps of 1 ms, which earn 10 us each) must
    not keep every hope-called probe after it at MAX_FLOOR for the 10,000 steps its debt would
    take to earn back. Once a hope-called probe has waited MAX_FLOOR steps, the next one waits
    only for what the probe made then cost, and a batch whose rows then copy drafts about
    MAX_FLOOR steps later than it would have without the pause (the pause's row_ms is its own
    matter: it moves the floor a quarter of the way, as before)."""
    firsts = []
    for pause_ms in (0.0, 100.0):
        pol = _policy(3.4)
        _run(pol, [True, False], 50)  # a batch that does not draft: hope probes within the budget
        if pause_ms:
            rows = [Sequence(Request(id=f"x{i}", prompt_token_ids=(1, 2)), i, [1, 2], seed=0) for i in range(2)]
            pol.full_probe = True  # (a hopeful probe, slow)
            pol.spaced(pause_ms / 1e3, rows, rows)
            assert pol.wait == pol.interval == MAX_FLOOR
            pol._gap = MAX_FLOOR  # the next hope-called probe, MAX_FLOOR steps on (50 us)
            pol.spaced(0.05 / 1e3, rows, rows)
            assert pol.wait <= 0.05 / (speculation.PROBE_SHARE * 1.0) + 1, pol.wait  # (5 steps earn 50 us)
            pol = _policy(3.4)
            _run(pol, [True, False], 50)
            pol.full_probe = True
            pol.spaced(pause_ms / 1e3, rows, rows)
        firsts.append(_run(pol, [True, True], 5000)[3])
    assert firsts[0] is not None and firsts[1] is not None, firsts
    assert firsts[1] <= firsts[0] + MAX_FLOOR + 4 * 8, firsts


def test_spec_host_refuses_a_policy_constant_that_speculation_only_re_exports(tmp_path):
    """spec_host.py's --policy is "as spec_bench.py's": JUDGE_STEPS and MAX_LOSSES are episodes.py's,
    read there, so setting them on speculation.py changes nothing; spec_bench.py refuses them, and
    spec_host.py accepted them silently (an A/B of two identical policies)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "scripts/spec_host.py"), str(tmp_path), "--policy",
                          "JUDGE_STEPS=3", "--batches", "1", "--tokens", "2", "--repeats", "1"],
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "JUDGE_STEPS" in run.stderr, (run.returncode, run.stderr[-500:])


def test_a_policy_constant_is_set_where_it_is_read():
    """The benches' --policy sets a constant in the module that reads it: HOST_STEP_ROWS lives in
    step_prices.py (set on speculation.py's re-export, the pricing would not change); episodes.py's
    constants and non-numbers are refused with the name."""
    from trtgraph.runtime.serving import speculation, step_prices

    old, share = step_prices.HOST_STEP_ROWS, speculation.PROBE_SHARE
    try:
        assert speculation.set_constant("HOST_STEP_ROWS", "0") == 0 and step_prices.HOST_STEP_ROWS == 0
        assert speculation.set_constant("PROBE_SHARE", "0.004") == 0.004 and speculation.PROBE_SHARE == 0.004
    finally:
        step_prices.HOST_STEP_ROWS, speculation.PROBE_SHARE = old, share
    for bad in (("JUDGE_STEPS", "3"), ("Episodes", "1"), ("NOPE", "1"), ("PROBE_SHARE", "abc"),
                ("PROBE_SHARE", "nan"), ("PROBE_SHARE", "-0.01")):
        with pytest.raises(ValueError, match=bad[0]):
            speculation.set_constant(*bad)
