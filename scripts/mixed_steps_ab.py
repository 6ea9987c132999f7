"""The bench's mixed workload run twice on one manifest, with the engine forming rows-changing
steps ahead (`Engine.pipeline_changes`, the default) and without (each step formed after the one
before it is read): the number of steps of each, the first step where they differ (with the two
before and after it: key and (request id, tokens fed) per row), and whether every request's
tokens are equal. With `deterministic: false` a different step sequence changes tokens through
the batch-size dependence of the GEMMs, so the steps are what to compare.
Usage: python scripts/mixed_steps_ab.py MANIFEST_DIR [N_REQUESTS]   (N defaults to 512)"""

import sys

import torch

from trtgraph.bench import mixed_prompts
from trtgraph.runtime.serving.engine import Engine


def run(art: str, n: int, pipeline: bool):
    """(the launched steps as (key, rows), tokens by request id) of one run."""
    engine = Engine(art)
    engine.pipeline_changes = pipeline
    log, launch = [], engine.launcher.launch

    def logged(step, *a, **k):
        log.append((str(step.key), tuple((s.request.id, n) for s, n in zip(step.seqs, step.num_new))))
        return launch(step, *a, **k)

    engine.launcher.launch = logged
    prompts = mixed_prompts(n, engine.executor.loaded.config.vocab_size, engine.executor.config.limits.max_seq_len,
                            sampled=True)
    with torch.inference_mode():
        tokens = {r.id: r.token_ids for r in engine.generate(prompts)}
    return log, tokens


def main() -> None:
    art, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 512
    (a, ta), (b, tb) = run(art, n, True), run(art, n, False)
    print(f"steps: formed ahead {len(a)}, formed after the read {len(b)}")
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) == len(b):
        print("the same steps")
    else:
        first = min(len(a), len(b)) if first is None else first
        print(f"first difference at step {first}")
        for j in range(max(0, first - 2), min(max(len(a), len(b)), first + 3)):
            for name, log in (("ahead", a), ("after", b)):
                if j < len(log):
                    print(f"  {name} {j} {log[j][0]} {list(log[j][1])}")
    print(f"tokens equal: {ta == tb} ({sum(ta[k] != tb.get(k) for k in ta)} of {len(ta)} requests differ)")


if __name__ == "__main__":
    main()
