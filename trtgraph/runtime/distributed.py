"""Tensor parallelism's process side: start N ranks, agree before every capture, and keep
the followers stepping with rank 0.

`launch` starts one process per rank with torch.multiprocessing (NCCL on GPUs, one GPU per
rank; gloo on CPUs) and returns rank 0's result. A TrtgraphError on any rank stops every
rank and is raised again in the caller with its message, naming the rank; nothing waits
on a collective that will never come.

Every rank runs the same capture in the same order; before each key the ranks exchange a
hash of the key, the key list and their buffer layout and stop with CaptureError on any
disagreement. At run time rank 0 schedules and, each step, broadcasts the step's key and
its packed input buffers; the other ranks replay the same key on them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import signal
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import errors
from ..errors import CaptureError, TrtgraphError
from ..models.parallel import TPGroup

STOP, STEP = 0, 1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_SECONDS = 0.2
INTERRUPT_GRACE_SECONDS = 60  # for rank 0 to finish its step and say what it wrote


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int, use_cuda: bool) -> TPGroup:
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    return TPGroup(rank, world)


def die_with_parent(parent_pid: int) -> None:
    """A rank must not outlive its launcher (a SIGKILLed launcher would leave ranks serving
    and writing): the kernel's parent-death signal where there is one (Linux), and a
    watcher thread that notices the parent is gone everywhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher below is the guard
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="trtgraph-parent-watch", daemon=True).start()


def _entry(rank, world, port, use_cuda, fn, args, results, parent_pid):
    die_with_parent(parent_pid)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C (the launcher passes it on)
    try:
        _rank(rank, world, port, use_cuda, fn, args, results)
    except KeyboardInterrupt:  # the launcher's SIGTERM while this rank reported (it stops every rank when one
        pass  # fails): end quietly, no traceback under the launcher's one-line error


def _rank(rank, world, port, use_cuda, fn, args, results):
    try:
        tp = init(rank, world, port, use_cuda)
        out = fn(tp, *args)
        results.put((rank, "ok", out if rank == 0 else None))
    except TrtgraphError as exc:
        results.put((rank, "error", (type(exc).__name__, str(exc))))
    except KeyboardInterrupt:
        results.put((rank, "interrupted", None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
        results.put((rank, "crash", traceback.format_exc()))
    finally:  # reported: the launcher's SIGTERM now just ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(world: int, fn, *args, use_cuda: bool | None = None):
    """Run fn(tp, *args) on `world` ranks; return rank 0's result, which must be plain Python
    data (a tensor would cross through shared memory that dies with its process)."""
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    if use_cuda and torch.cuda.device_count() < world:
        raise errors.ConfigError(f"parallel.tensor_parallel_size = {world} needs {world} GPUs; this machine has "
                                 f"{torch.cuda.device_count()}.")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, use_cuda, fn, args, results, os.getpid()),
                         daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    outcome, done = None, 0
    try:
        while done < world:
            rank, status, payload = _get(results, procs)
            done += 1
            if status == "ok":
                if rank == 0:
                    outcome = payload
                continue
            _stop(procs)
            if status == "error":
                cls = getattr(errors, payload[0], TrtgraphError)
                raise cls(f"rank {rank}: {payload[1]}")
            if status == "interrupted":
                raise KeyboardInterrupt
            if status == "killed":
                raise errors.RankLostError(payload)
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
    except KeyboardInterrupt:
        _interrupt(procs)
        raise
    for p in procs:
        p.join()
    return outcome


def _killed(rank: int, signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return (f"rank {rank} was ended by {name} from outside trtgraph (the out-of-memory killer, or a kill by "
            f"another process; see `dmesg` or the system log); every other rank was stopped with it. Free "
            f"memory or stop what ended it, then run the command again (`run` keeps what finished: add "
            f"--resume).")


def _get(results, procs):
    """The next rank's report; a rank that died without one is reported as crashed."""
    while True:
        if not results.empty():
            return results.get()
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead and results.empty():
            code = procs[dead[0]].exitcode
            if code < 0:  # ended by a signal: the environment, not a bug (a crash reports its traceback)
                return dead[0], "killed", _killed(dead[0], -code)
            return dead[0], "crash", f"process exited with code {code}"
        time.sleep(0.05)


def _interrupt(procs) -> None:
    """The launcher got SIGINT or SIGTERM: rank 0 stops as a single process would (it keeps
    what finished and says so), then the other ranks are ended. A Ctrl-C from a terminal
    reaches rank 0 itself; a signal sent to the launcher alone is passed on as SIGTERM
    (SIGINT may be ignored, as in a background job)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        lead = procs[0]
        lead.join(1.0)
        if lead.is_alive():
            os.kill(lead.pid, signal.SIGTERM)
            lead.join(INTERRUPT_GRACE_SECONDS)
        _stop(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(procs):
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():  # a rank stuck where SIGTERM cannot reach it
            p.kill()
            p.join(5)


def agree(tp: TPGroup, what: str, value: str) -> None:
    """Every rank must hold the same `value`; otherwise stop every rank with a message."""
    if not tp.active:
        return
    digest = hashlib.sha256(value.encode()).hexdigest()[:16]
    got: list = [None] * tp.world
    dist.all_gather_object(got, digest)
    if len(set(got)) > 1:
        groups = {}
        for rank, d in enumerate(got):
            groups.setdefault(d, []).append(rank)
        shown = "; ".join(f"ranks {r} have {d}" for d, r in groups.items())
        raise CaptureError(f"ranks disagree on {what} ({shown}); every rank must capture the same keys with the "
                           f"same buffers. Is every rank running the same config and trtgraph version?")


def gather(tp: TPGroup, obj) -> list:
    if not tp.active:
        return [obj]
    got: list = [None] * tp.world
    dist.all_gather_object(got, obj)
    return got


class StepBroadcast:
    """Rank 0 sends each step (key index + the packed input buffers); the others receive it."""

    def __init__(self, tp: TPGroup, executor, keys: list):
        self.tp, self.ex = tp, executor
        self.keys = list(keys)
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.header = torch.zeros(2, dtype=torch.int64, device=executor.device)

    def send(self, key) -> None:
        self.header[0], self.header[1] = STEP, self.index[key]
        self._share()

    def stop(self) -> None:
        if self.tp.active and self.tp.rank == 0:
            self.header[0] = STOP
            dist.broadcast(self.header, 0)

    def _share(self) -> None:
        dist.broadcast(self.header, 0)
        dist.broadcast(self.ex.buffers.ints, 0)
        dist.broadcast(self.ex.buffers.floats, 0)

    def follow(self, eager: bool = False) -> int:
        """The loop of ranks other than 0: replay what rank 0 sends until it says stop."""
        steps = 0
        with torch.inference_mode():
            while True:
                dist.broadcast(self.header, 0)
                command, index = self.header.tolist()
                if command == STOP:
                    return steps
                dist.broadcast(self.ex.buffers.ints, 0)
                dist.broadcast(self.ex.buffers.floats, 0)
                self.ex.execute(self.keys[index], eager=eager)
                steps += 1
