"""The Python API: `LLM(manifest_path).generate(requests)`, the same fields as the JSONL.

    import trtgraph
    llm = trtgraph.LLM("trtgraph-artifacts")
    for out in llm.generate([{"id": "a", "prompt": "Hello", "max_tokens": 8}]):
        print(out["id"], out["text"], out["finish_reason"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from .engine import Engine
from .requests import Request


class LLM:
    def __init__(self, manifest_path: str | Path = "trtgraph-artifacts", eager: bool = False,
                 model: str | Path | None = None):
        """Load and check the manifest, re-record its graphs, lock. `eager=True` runs the same
        scheduler without graphs, for A/B checks. `model`: the checkpoint directory where it has
        moved since capture (checked against the manifest's file sizes and sha256)."""
        self.engine = Engine(manifest_path, eager=eager, model=model)

    def stream(self, requests: Iterable[dict | Request]) -> Iterator[dict]:
        """Yield one result dict per request, as each finishes."""
        for result in self.engine.generate(requests):
            yield result.to_json()

    def generate(self, requests: Iterable[dict | Request]) -> list[dict]:
        """All results, in the order of `requests`."""
        requests = list(requests)
        by_id = {r["id"]: r for r in self.stream(requests)}
        return [by_id[str(r.id if isinstance(r, Request) else r["id"])] for r in requests]

    @property
    def stats(self) -> dict:
        """The last generate()'s summary: tokens/s, steps per key, padding waste, ..."""
        return self.engine.stats.to_json()
