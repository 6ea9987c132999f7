"""Compare two results JSONL files token for token: `python scripts/compare_outputs.py a.jsonl b.jsonl`.
Prints how many requests are identical and, for each divergence, where it starts."""

import json
import sys


def load(path):
    with open(path, encoding="utf-8") as f:
        return {r["id"]: r for r in map(json.loads, f) if r}


a, b = load(sys.argv[1]), load(sys.argv[2])
same = [i for i in a if i in b and a[i]["token_ids"] == b[i]["token_ids"]]
print(f"{len(same)}/{len(a)} requests identical")
for i in sorted(set(a) - set(same)):
    ta, tb = a[i]["token_ids"], b.get(i, {}).get("token_ids", [])
    first = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    print(f"  {i}: first divergence at output token {first} ({ta[first:first+3]} vs {tb[first:first+3]})")
