"""One line from `trtgraph capture --json`: the capture's own work (warm-up + capture), the
phases (interpreter to manifest) and the replay timing summary (scripts/u6_gpu.sh)."""
import json
import sys

try:
    b = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"  no JSON: {exc}")
p = b["phases"]["phases_seconds"]
own = b["warmup_seconds"] + b["capture_seconds"]
print(f"  own {own:.3f} (warm-up {b['warmup_seconds']:.3f} + capture {b['capture_seconds']:.3f}); phases "
      f"{b['phases']['total_seconds']:.3f} = " + ", ".join(f"{k} {v:.3f}" for k, v in p.items())
      + f"; ratio phases/own {b['phases']['total_seconds'] / own:.2f}; timing {b.get('replay_timing')}")
