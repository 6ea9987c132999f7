"""Consumers of one engine (`Consumers`, mixed into the Engine): callers that each wait for
their own requests (LLM.generate / stream / chat calls, Engine.generate), stepping the
engine and leaving every other request's outputs in place for their own consumer (`step(take)`),
from one thread or several.

Every change to the engine runs under its lock (`locked`: step, submit, add_request, abort),
never across a yield. A request is
known by its id and by the submission that made it (`_owners`): a consumer whose request was
aborted while another reused the id neither takes the newer request's outputs nor aborts it
when it closes. An id is free for a new request as soon as its abort is asked for.
"""

from __future__ import annotations

import copy
import functools
from typing import Iterable, Iterator

from .requests import Request, Result, parse_request
from .streaming import RequestOutput


def locked(method):
    """The engine method runs holding the engine's (reentrant) lock."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class Consumers:
    """The engine's waiting side: outputs_of, generate, abort_unfinished."""

    def owners(self, ids: Iterable[str]) -> dict[str, object]:
        """Which submission each id's live request is, for outputs_of and abort_unfinished:
        taken right after submit()."""
        return {rid: self._owners.get(rid) for rid in ids}

    def outputs_of(self, ids: Iterable[str], owners: dict[str, object] | None = None) -> Iterator[RequestOutput]:
        """Step until every request in `ids` has finished (or was aborted: none comes for it),
        yielding their outputs as they come and leaving every other request's to its own
        consumer. owners: `owners(ids)` taken at submit (else now)."""
        remaining = set(ids)
        mine = self.owners(remaining) if owners is None else owners
        aborts = -1  # (the first step checks too: aborts may have been applied since the submit)

        def ours(out) -> bool:  # (an id aborted and reused: the newer request's outputs are not ours)
            return out.id in remaining and self._owners.get(out.id) is mine[out.id]
        while remaining:
            with self._lock:
                outputs = self.step(ours)  # every other request's stay for its own consumer
                if self._aborts_applied != aborts:  # requests were aborted: none of ours among them comes
                    aborts, here = self._aborts_applied, {o.id for o in outputs}
                    remaining = {rid for rid in remaining if (rid in here or self._is_live(rid))
                                 and self._owners.get(rid) is mine[rid]}
            for out in outputs:
                if out.id in remaining:
                    if out.finished:
                        remaining.discard(out.id)
                        with self._lock:  # (its id is free now: a newer request may take it)
                            if self._owners.get(out.id) is mine[out.id]:
                                del self._owners[out.id]
                    yield out

    def generate(self, requests: Iterable[Request | dict], gpu_timing: bool = False) -> Iterator[Result]:
        """Serve `requests`; yield each Result as soon as it finishes (refusals first).
        gpu_timing: record CUDA events around every step to report the GPU's idle time."""
        reqs = [copy.copy(r) for r in self.parsed(requests)]  # (each call's submission its own: owners)
        ids, owners, finished = [r.id for r in reqs], {r.id: r for r in reqs}, set()
        try:  # (known before it is submitted: a Ctrl-C as submit returns leaves none served for nobody)
            self.submit(reqs, gpu_timing, stream=False)
            for out in self.outputs_of(ids, owners):
                if out.finished:
                    finished.add(out.id)
                    yield out.result
        finally:  # interrupted or left early: what did not finish goes (nobody would read it)
            self.abort_unfinished(ids, finished, owners)

    @locked
    def abort_unfinished(self, ids: Iterable[str], finished: set[str], owners: dict[str, object] | None = None) -> None:
        """A consumer of `ids` stops (an exception, a generator left early): abort those not in
        `finished`, which would otherwise be served and their outputs held for nobody. An id
        whose request is no longer the consumer's (`owners`: it finished, or was aborted and
        the id reused) is left alone."""
        for rid in ids:
            mine = owners is None or self._owners.get(rid) is owners.get(rid)
            if rid not in finished and mine:
                self.abort(rid)
            if owners is not None and mine:
                self._owners.pop(rid, None)

    def parsed(self, requests: Iterable[Request | dict]) -> list[Request]:
        """Each request as a Request (dicts validated: PromptError naming `request i`)."""
        self.check_open()
        vocab = self.vocab_size
        return [r if isinstance(r, Request) else parse_request(r, f"request {i}", vocab) for i, r in enumerate(requests)]

    def _settle_aborts(self, ids: Iterable[str]) -> None:
        """Aborts asked for these ids applied now rather than at the next step, so the ids are
        free for the requests being submitted; all of them where nothing else is left (an idle engine:
        the submission starts a run of its own). (A Ctrl-C there: recovered as in a failed step.)"""
        if self._aborts and (not self._aborts.isdisjoint(ids) or (not self._flight and self._only_aborted())):
            try:
                self._apply_aborts()
            except BaseException:
                self._reading = []
                self._recover()
                raise
