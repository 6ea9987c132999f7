"""Write a prompts JSONL of random token ids: `python scripts/make_prompts.py --n 256 --in 128 --out 128`.

The mixed workload of issue 14 (prompts 8-1,500 tokens, outputs 16-256, a third sampled):
`python scripts/make_prompts.py --n 512 --in-min 8 --in 1500 --out-min 16 --out 256 --sampled 0.333`."""

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
p.add_argument("--out-min", dest="max_tokens_min", type=int, default=None,
               help="mixed outputs: each max_tokens drawn uniformly from --out-min..--out")
p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--sampled", type=float, default=0.0,
               help="this share of the requests (drawn at random) samples at temperature 0.8 (the rest: --temperature)")
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
rng = random.Random(a.seed)
for i in range(a.n):
    n = a.prompt_len if a.prompt_min is None else rng.randint(a.prompt_min, a.prompt_len)
    out = a.max_tokens if a.max_tokens_min is None else rng.randint(a.max_tokens_min, a.max_tokens)
    temperature = 0.8 if a.sampled and rng.random() < a.sampled else a.temperature
    print(json.dumps({"id": f"p{i}", "prompt_token_ids": [rng.randrange(a.vocab) for _ in range(n)],
                      "max_tokens": out, "temperature": temperature, "seed": i}))
