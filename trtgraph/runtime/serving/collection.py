"""Python's cyclic garbage collector, paced by the engine while it serves (issue 14: the GPU
never waits on the host).

CPython collects its youngest generation after every ~700 net allocations, wherever they
happen. A serving engine allocates in bursts — admitting requests, forming a prefill step of
new rows, retiring a wave's rows — which are exactly the moments when the next step is being
formed while the device runs the last ones; a collection there (hundreds of µs for the young
generation, milliseconds for the middle one) delays that launch and the device idles. While an
engine has work to run (outputs only waiting for their consumer are not work: `Engine.step`
lets go then) the automatic collector is off and the engine collects at its safe point instead
(`collect_due`: after the next step was launched, while at least one more step is queued
behind the one it waits for; two, or a prefill, for the older generations), the generation
CPython's thresholds call for. The oldest generation is left to the automatic collector once
no engine is serving (its own heuristic skips most of them), or collected here only when its
count runs far past its threshold, so a server that never idles still frees old cycles.

Nothing changes where the process had switched the collector off itself: it is left alone.
An engine whose every request is being aborted lets go at once (`Engine.abort`): its consumer
may never step it again (a stream left early).
"""

from __future__ import annotations

import gc
import weakref

OLDEST_SLACK = 10  # the oldest generation is collected here once its count passes this many times its threshold
FORCED = 8  # a young collection is made anyway (no safe point) once the count passes this many times the threshold

_holders: set[int] = set()  # the engines serving now (by id), while this module switched the collector off
_watched: dict[int, weakref.finalize] = {}  # the engines that ever held it (by id): one finalizer each
_off = False  # whether this module switched it off


def hold(owner: object) -> None:
    """`owner` (an engine) serves: the automatic collector is off until every owner released it."""
    global _off
    key = id(owner)
    if key in _holders:
        return
    if not _holders:
        if not gc.isenabled():
            return  # the process manages its collections itself
        gc.disable()
        _off = True
    _holders.add(key)
    if key not in _watched:  # an engine dropped while serving lets go too (one finalizer for its life)
        _watched[key] = weakref.finalize(owner, _dropped, key)


def _dropped(key: int) -> None:
    _watched.pop(key, None)
    _release_key(key)


def release(owner: object) -> None:
    """`owner` is idle: the automatic collector is back once no owner serves."""
    _release_key(id(owner))


def _release_key(key: int) -> None:
    global _off
    if key not in _holders:
        return
    _holders.discard(key)
    if not _holders and _off:
        _off = False
        gc.enable()


def held(owner: object) -> bool:
    return id(owner) in _holders


def collect_due(owner: object, queued: int, long: bool = False) -> int | None:
    """At the engine's step, before it waits for the oldest of the `queued` steps in flight:
    make the collection CPython's thresholds call for where the device has work to hide it
    behind — the young generation with a step queued behind the one waited for (queued >= 2),
    an older one (milliseconds) with two queued or a prefill step in flight (`long`) — or
    without that once the young count ran FORCED times past its threshold. The generation
    collected, or None (the counts keep growing until a safe point)."""
    if id(owner) not in _holders:
        return None
    c0, c1, c2 = gc.get_count()
    t0, t1, t2 = gc.get_threshold()
    if t0 <= 0 or c0 <= t0:
        return None
    forced = c0 > FORCED * t0
    gen = 0
    if c1 > t1:  # (a collection of a generation counts one for the next: gc.collect does too)
        gen = 2 if c2 > OLDEST_SLACK * t2 else 1
    if not forced and (queued < 2 or (gen and queued < 3 and not long)):
        return None
    gc.collect(gen)
    return gen
