"""One response's engine outputs: those of its requests (one per prompt of a /v1/completions
body that holds several, as OpenAI's batch; one otherwise), gathered into the whole answer or
written as Server-Sent Events. Prompt i's n completions are the response's choices
i*n .. i*n+n-1, as OpenAI numbers them; its usage sums every prompt's."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from ..formats import openai as oa
from ..runtime.serving.requests import Request, Result
from ..runtime.serving.streaming import RequestOutput
from .engine_thread import Aborted


class Group:
    """The requests of one response, in prompt order, and the Results of those finished."""

    def __init__(self, requests: list[Request]):
        self.ids = [r.id for r in requests]
        self._base, at = {}, 0
        for r in requests:
            self._base[r.id] = at
            at += r.n
        self._results: dict[str, Result] = {}

    def index(self, item: RequestOutput) -> int:
        """The response's choice index of an output's completion."""
        return self._base[item.id] + item.index

    def take(self, item) -> bool:
        """Note a finished request's Result; true once every request has finished."""
        if isinstance(item, RequestOutput) and item.finished:
            self._results[item.id] = item.result
        return len(self._results) == len(self.ids)

    def result(self) -> Result:
        """The whole response as one Result: the request's own, or every prompt's choices in order."""
        if len(self.ids) == 1:
            return self._results[self.ids[0]]
        results = [self._results[rid] for rid in self.ids]
        choices = [c for r in results for c in (r.choices or [r])]
        return Result(id=self.ids[0], prompt_tokens=sum(r.prompt_tokens for r in results), choices=choices)


async def events(first, queue: asyncio.Queue, shapes: oa.Response, include_usage: bool, group: Group,
                 refusal: Callable[[object], "dict | None"], abort: Callable[[], None]):
    """Server-Sent Events: a chunk per step's delta of each completion (naming it by `index`;
    each completion's last carries its finish_reason, and its logprobs when asked), usage if
    asked, then [DONE]. An abort or a refusal after the stream began (`refusal(item)`: its
    error body, or None) ends it with OpenAI's error object, then [DONE]. Leaving early (the
    client disconnected, the server stopping) aborts every request of the response."""
    done, failed, items = False, False, [first]
    try:
        while not done:
            for item in coalesced(items):
                error = refusal(item)
                if error is not None:
                    yield sse(error)
                    done = failed = True
                    break
                if not gathered(item):
                    yield sse(shapes.chunk(item.text, item.token_ids, item.finish_reason, group.index(item),
                                           item.logprobs, include_usage))
                if group.take(item):
                    if include_usage:
                        yield sse(shapes.usage_chunk(group.result()))
                    done = True
                    break
            if not done:
                items = await waiting(queue)
        yield "data: [DONE]\n\n"
    finally:
        if not done or failed:  # (one prompt refused: the others are still running)
            abort()


async def waiting(queue: asyncio.Queue) -> list:
    """The queue's next item and every one already behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def gathered(item) -> bool:
    """An n > 1 request's last output: its completions' Result, every token of which came before."""
    return isinstance(item, RequestOutput) and item.finished and item.result.choices is not None


def coalesced(items: list) -> list:
    """Outputs that waited together, as fewer: each completion's deltas joined into one, in the
    order of its first (a reader slower than the engine gets fewer, larger chunks instead of a
    backlog); anything else (an n > 1 request's end, an abort) after the deltas before it."""
    out, joined = [], {}
    for item in items:
        if isinstance(item, RequestOutput) and not gathered(item):
            key = (item.id, item.index)
            before = joined.get(key)
            joined[key] = item if before is None else _join(before, item)
            continue
        out += [*joined.values(), item]
        joined = {}
    return out + list(joined.values())


def _join(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two deltas of one completion, `b` after `a`, as one."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(a.id, a.token_ids + b.token_ids, a.text + b.text, b.finished, b.finish_reason, b.result,
                         a.index, logprobs)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
