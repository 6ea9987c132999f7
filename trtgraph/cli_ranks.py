"""The commands' work on each tensor-parallel rank: `capture` and `run` start one function per
rank (or call it in this process when there is one), rank 0 prints and writes, the others
follow. Split out of cli.py, which parses, prints and maps errors to exit codes."""

from __future__ import annotations

import json
import signal
import sys

import click

from . import startup
from .cli_exits import EXIT_INTERRUPTED, is_utf8


def on_ranks(world: int, device: str, fn, *args):
    """fn(tp, *args) in this process (world 1, tp None) or on `world` tensor-parallel ranks
    (rank 0's result)."""
    if world == 1:
        return fn(None, *args)
    startup.resume_gc()  # this process only launches and waits: no capture or engine begins here
    import torch

    from .runtime.distributed import launch

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return launch(world, fn, *args, use_cuda=use_cuda)


def capture_rank(tp, config, out):
    """One rank's capture (tp None: the only process). Returns (manifest path, totals)."""
    from .compiler.pipeline import capture as run_capture
    from .models.parallel import TPGroup

    tp = tp or TPGroup()
    bar = KeyProgress() if tp.rank == 0 else None
    try:
        result = run_capture(config, out, progress=bar, tp=tp)
    finally:
        if bar:
            bar.close()
    return str(result.path), result.manifest.totals


class KeyProgress:
    """A progress bar on stderr over the keys of each stage."""

    def __init__(self):
        self._bar, self._stage = None, None

    def __call__(self, stage, key, done, total):
        if stage != self._stage:
            self.close()
            self._stage = stage
            self._bar = click.progressbar(length=total, label=f"{stage:<8}", file=sys.stderr,
                                          show_pos=True, item_show_func=lambda k: str(k) if k else None)
            self._bar.__enter__()
        self._bar.update(1, key)

    def close(self):
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None


def run_rank(tp, requests, manifest, output, eager, summary_json, resume, speculative, model=None,
             verbose=False, program=False) -> int:
    """One rank of `run` (tp None: the only process); rank 0 serves and writes, the others
    replay what it broadcasts. `program`: this process is the `trtgraph` program, which exits
    at once after the summary (cli.entry). Returns the exit code."""
    from .models.parallel import TPGroup
    from .report import run_summary
    from .runtime.serving.engine import Engine
    from .runtime.serving.file_run import serve_file, write_summary_json

    tp = tp or TPGroup()
    if tp.rank == 0:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops like Ctrl-C
    else:  # followers stop when rank 0 says so, or when the launcher ends them
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    engine = Engine(manifest, eager=eager, speculative=speculative, tp=tp, model=model)
    startup.freeze_heap(engine.executor.device)
    if tp.rank != 0:
        engine.follow()
        return 0
    stats = None
    try:
        ascii_only = not output and not is_utf8(sys.stdout)  # JSON escapes what the terminal cannot show
        with click.progressbar(length=len(requests.ids), label="requests", file=sys.stderr, show_pos=True) as bar:
            stats = serve_file(engine, requests, output, resume, ascii_only, on_result=lambda: bar.update(1),
                               log=lambda msg: click.echo(msg, err=True))
    finally:
        # After an interrupt, rank 0 may have stopped between two broadcasts of a step: the
        # launcher ends the followers instead of a stop message they would misread.
        if stats is not None or not tp.active:
            engine.close()
    if stats is None:
        return EXIT_INTERRUPTED
    stats = with_refused_lines(stats, len(requests.refused))
    if summary_json == "-":  # standard output (the results went to --output)
        click.echo(json.dumps(stats, indent=2))
    elif summary_json:
        write_summary_json(summary_json, stats)
    click.echo(run_summary(stats, eager), err=True)
    if verbose:
        startup.lap("summary")  # the summary JSON written and printed (the JSON's phases end before it)
        click.echo(startup.CLOCK.text() + "\n  (then the process exits at once: nothing after this is unmeasured)"
                   if program else startup.CLOCK.text(), err=True)
    return 0


def with_refused_lines(stats: dict, refused: int) -> dict:
    """The run's stats counting the OpenAI batch bodies refused as the file was read (each
    written as a 400 output line; the engine counts only what it was given, and those it refused)."""
    if not refused:
        return stats
    return {**stats, "requests": stats["requests"] + refused, "refused": stats["refused"] + refused}
