"""The scheduler alone (no model, no device) on a prompts file with a config's bucket plan:
padding share of the step tokens and the longest run of steps a decoding row was left out
of, with the engine's order of launches (steps launched ahead included). Fake tokens, never
an EOS, so every request runs to its max_tokens.

Usage: PYTHONPATH=$PWD python3 scripts/mixed_schedule.py examples/llama-3.2-1b-synthetic.yaml PROMPTS.jsonl [NUM_BLOCKS]
"""

import json
import sys

from trtgraph.buckets import BucketPlan
from trtgraph.config import Config
from trtgraph.runtime.serving.requests import parse_request
from trtgraph.runtime.serving.scheduler import Scheduler, Sequence


def main(config_path: str, prompts_path: str, num_blocks: int = 8192) -> None:
    cfg = Config.from_yaml(config_path)
    sched = Scheduler(BucketPlan.from_config(cfg), num_blocks, cfg.kv_cache.block_size,
                      max_seq_len=cfg.limits.max_seq_len)
    for i, line in enumerate(l for l in open(prompts_path) if l.strip()):
        req = parse_request(json.loads(line), f"line {i + 1}", 1 << 30)
        sched.add(Sequence(request=req, arrival=i, prompt_ids=list(req.prompt_token_ids), seed=i))
    tokens = {"prefill": [0, 0, 0], "decode": [0, 0, 0]}  # steps, real tokens, computed tokens
    waited, longest, inflight = {}, 0, None
    while sched.has_work or inflight is not None:
        step = inflight or sched.schedule()
        if sched.retire_ahead(step) or sched.settle_ahead(step):  # as Engine.step: the next needs none of its tokens
            ahead = sched.schedule() if sched.has_work else None
        else:
            ahead = sched.extend_decode(step)
        kind = tokens["prefill" if step.is_prefill else "decode"]
        kind[0], kind[1], kind[2] = kind[0] + 1, kind[1] + sum(step.num_new), kind[2] + step.key.num_tokens
        for s in sched.running:
            if s.output_ids and s.num_pending == 1:
                waited[id(s)] = 0 if s in step.seqs else waited.get(id(s), 0) + 1
                longest = max(longest, waited[id(s)])
        sched.postprocess(step, [(7 * len(s.all_ids)) % 1000 + 1 for s in step.seqs] * step.key.q_len)
        inflight = ahead
    real, computed = sum(v[1] for v in tokens.values()), sum(v[2] for v in tokens.values())
    print(json.dumps({"steps": {k: v[0] for k, v in tokens.items()},
                      "padding_pct": {k: round(100 * (1 - v[1] / v[2]), 2) for k, v in tokens.items() if v[2]},
                      "padding_pct_all": round(100 * (1 - real / computed), 2),
                      "longest_decode_wait_steps": longest}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
