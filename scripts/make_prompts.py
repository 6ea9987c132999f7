"""Write a prompts JSONL of random token ids: `python scripts/make_prompts.py --n 256 --in 128 --out 128`."""

import argparse
import json
import random

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--n", type=int, default=256)
p.add_argument("--in", dest="prompt_len", type=int, default=128)
p.add_argument("--in-min", dest="prompt_min", type=int, default=None,
               help="mixed lengths: each prompt's length drawn uniformly from --in-min..--in")
p.add_argument("--out", dest="max_tokens", type=int, default=128)
p.add_argument("--vocab", type=int, default=128000, help="token ids are drawn below this")
p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
rng = random.Random(a.seed)
for i in range(a.n):
    n = a.prompt_len if a.prompt_min is None else rng.randint(a.prompt_min, a.prompt_len)
    print(json.dumps({"id": f"p{i}", "prompt_token_ids": [rng.randrange(a.vocab) for _ in range(n)],
                      "max_tokens": a.max_tokens, "temperature": a.temperature, "seed": i}))
