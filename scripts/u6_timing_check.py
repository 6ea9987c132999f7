"""Each key's manifest replay time (one run for long prefill keys, 2 or more for the rest)
against the median of 5 fresh runs in another process (scripts/u6_gpu.sh): the single run's
error next to the others'."""
import statistics
import sys

import torch

from trtgraph.compiler.timing import PendingTiming, time_step
from trtgraph.runtime.serving.engine import Engine

engine = Engine(sys.argv[1])
ex, rows = engine.executor, []
with torch.inference_mode():
    for rec in engine.manifest.keys:
        t = (PendingTiming(ex, rec.key, eager=False, repeats=5, least=5).timing() if ex.device.type == "cuda"
             else time_step(ex, rec.key, eager=False, repeats=5))
        rows.append((rec.key, rec.replay_ms, t.median_ms, t.spread))
print(f"{'key':<40} {'manifest ms':>11} {'5-run ms':>9} {'spread':>7} {'error':>7}")
for key, m, five, spread in rows:
    print(f"{str(key):<40} {m:11.3f} {five:9.3f} {spread:7.2%} {m / five - 1:+7.2%}")
for name, sel in (("long prefill (>= 5 ms)", lambda k, m: k.is_prefill and m >= 5),
                  ("the rest", lambda k, m: not (k.is_prefill and m >= 5))):
    errs = [abs(m / f - 1) for k, m, f, _ in rows if sel(k, m)]
    spreads = [s for k, m, _, s in rows if sel(k, m)]
    if errs:
        print(f"{name}: {len(errs)} keys, |error| median {statistics.median(errs):.2%} max {max(errs):.2%}; "
              f"5-run spread median {statistics.median(spreads):.2%} max {max(spreads):.2%}")
