"""A capture in a process that had loaded trtgraph's Triton kernels before (the Python API after
other work; a GPU test after others), then its manifest started in a fresh process. Before the
nineteenth session's fix its totals.warmup_keys held the first key alone and the fresh start
refused a later key's recording ("loaded N Triton kernel(s) that the warm-up ... had not").
Captures twice: with the fix (`fixed`), and with the history hidden from the capture (`old`,
as before); starts each in a fresh process and prints its warm-up key count and the outcome.
Usage (CUDA): PYTHONPATH=$PWD python3 scripts/history_capture_probe.py [OUT_DIR]"""

import subprocess
import sys

sys.path.insert(0, "tests")
from conftest import tiny_config  # noqa: E402

import trtgraph  # noqa: E402
from trtgraph.artifacts import load_manifest  # noqa: E402
from trtgraph.compiler import pipeline  # noqa: E402

START = "import sys, trtgraph; llm = trtgraph.LLM(sys.argv[1]); print(len(llm.generate('hello')[0].token_ids))"


def main(out: str) -> None:
    cfg = tiny_config(device="cuda")
    pipeline.capture(cfg, f"{out}/first")
    with trtgraph.LLM(f"{out}/first") as llm:  # this process now holds the kernels
        llm.generate("warm")
    pipeline.capture(cfg, f"{out}/fixed")
    real = pipeline.loaded_kernels
    calls = []
    pipeline.loaded_kernels = lambda: 0 if not calls.append(1) and len(calls) == 1 else real()
    pipeline.capture(cfg, f"{out}/old")
    pipeline.loaded_kernels = real
    for name in ("fixed", "old"):
        m = load_manifest(f"{out}/{name}")
        p = subprocess.run([sys.executable, "-c", START, f"{out}/{name}"], capture_output=True, text=True)
        tail = p.stderr.strip().splitlines()[-1][:160] if p.returncode else p.stdout.strip()
        print(f"{name}: {len(m.totals['warmup_keys'])} of {len(m.graph_keys)} keys warmed; fresh start rc={p.returncode} {tail}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/history_probe")
