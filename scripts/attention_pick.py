"""The adaptive decode configs for the RoPE-inside path from an attention_sweep.py result (SWEEP_SET
2): per row-program band the variant of the least mean time over both passes and contexts 128 / 512
(bs 48 for up to 3 row programs per SM, bs 64 past), written as attention_ab.py's `picked`
variant (DECODE_ADAPTIVE with the band of at most 2 per SM unchanged).
Usage: python scripts/attention_pick.py SWEEP.json OUT.json"""

import json
import sys

sys.path.insert(0, "scripts")
from attention_sweep import SETS  # noqa: E402

from trtgraph.kernels import attention_config as acfg  # noqa: E402


def mean_time(res, name, bs):
    times = [res[f"{name}#{p}"][f"{bs}x{ctx}"] for p in (1, 2) for ctx in (128, 512) if f"{name}#{p}" in res]
    return sum(times) / len(times) if times and all(isinstance(t, float) for t in times) else float("inf")


def main():
    res = json.load(open(sys.argv[1]))
    names = [n for n in SETS[2] if n.startswith("rope/") and n != "rope/before"]
    pick = {}
    for bs in (48, 64):
        best = min(names, key=lambda n: mean_time(res, n, bs))
        pick[bs] = (best, mean_time(res, best, bs), mean_time(res, "rope/before", bs))
        print(f"bs {bs}: {best} {pick[bs][1]:.1f} us per 16 launches (before {pick[bs][2]:.1f})")
    cfg = lambda n: {k: v for k, v in SETS[2][n][2].items() if k != "early"}  # noqa: E731
    adaptive = [[2, acfg.DECODE_ADAPTIVE[0][1]], [3, cfg(pick[48][0])], [None, cfg(pick[64][0])]]
    json.dump({"adaptive": adaptive, "pick": pick}, open(sys.argv[2], "w"), indent=1)
    print(json.dumps(adaptive))


if __name__ == "__main__":
    main()
