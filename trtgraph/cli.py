"""The trtgraph command line: parse, print, map errors to exit codes. No logic here.

Exit codes: 0 success; 2 a TrtgraphError (bad input, mismatch, refusal) or running out of
memory, with a one-paragraph message; 130 interrupted (SIGINT or SIGTERM); 141 stdout or
stderr closed early (a broken pipe, e.g. `| head -1`), quietly; 1 anything else.
TRTGRAPH_RAISE_ERRORS=1 (not 0, false, no or off) shows tracebacks.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
from pathlib import Path

import click

from . import __version__
from .errors import TrtgraphError

MiB = 1 << 20
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141


class UserError(click.ClickException):
    exit_code = 2

    def show(self, file=None):
        click.echo(f"error: {self.format_message()}", err=True)


def _raise_errors() -> bool:
    return os.environ.get("TRTGRAPH_RAISE_ERRORS", "").strip().lower() not in ("", "0", "false", "no", "off")


def _out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)))


class _Group(click.Group):
    def invoke(self, ctx):
        _tolerate_terminal_encoding()
        restore = _sigterm_interrupts()
        try:
            return super().invoke(ctx)
        except TrtgraphError as exc:
            if _raise_errors():
                raise
            raise UserError(str(exc)) from None
        except KeyboardInterrupt:  # SIGINT, or SIGTERM: the command said what it kept, if anything
            click.echo("\ninterrupted: stopped before finishing.", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # the reader went away (`| head -1`): stop quietly
            _silence_stdio()
            ctx.exit(EXIT_BROKEN_PIPE)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:  # an internal error: say so briefly, exit 1
            if _raise_errors():
                raise
            if _out_of_memory(exc):  # the environment, not a bug
                raise UserError(f"out of memory ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). "
                                f"Free memory, or capture a smaller plan (kv_cache.num_blocks, "
                                f"limits.max_seq_len / max_batch_size).") from None
            click.echo(f"internal error: {type(exc).__name__}: {exc}\n(set TRTGRAPH_RAISE_ERRORS=1 for the "
                       f"traceback, and please report it)", err=True)
            ctx.exit(1)
        finally:
            restore()


def _ignore_interrupts():
    """Ignore SIGINT and SIGTERM until the returned function restores them."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]


def _sigterm_interrupts():
    """SIGTERM stops a command like Ctrl-C (exit 130, the command's own summary). Returns
    a function that puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _tolerate_terminal_encoding() -> None:
    """A terminal that cannot show a character (PYTHONIOENCODING=ascii, a latin-1 locale)
    gets an escape instead of a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and not _is_utf8(stream):
            stream.reconfigure(errors="backslashreplace")


def _is_utf8(stream) -> bool:
    return (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "") in ("utf8", "utf8sig")


def _silence_stdio() -> None:
    """After a broken pipe: point stdout and stderr at /dev/null, so the interpreter's final
    flush does not print a second error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass
    os.close(devnull)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="trtgraph")
def main():
    """trtgraph: ahead-of-time CUDA graphs for LLM decoding.

    \b
      trtgraph capture --config model.yaml   warm up, capture every bucket, write a manifest
      trtgraph inspect trtgraph-artifacts    what was captured, what it cost, does it fit here
      trtgraph run --prompts prompts.jsonl   replay-only serving of a batch of prompts
      trtgraph serve                         an OpenAI-compatible server on the same engine
    """


def _load_config(path: str | None):
    from .config import Config

    return Config.from_yaml(path) if path else Config.default()


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="model.yaml (default: the embedded tiny synthetic Llama).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Artifacts directory (default: the config's `output`).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Override the config's device.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest's totals as JSON.")
def capture(config_path, out_dir, device, as_json):
    """Warm up, capture every graph key of the bucket plan into one pool, verify each
    against eager, and write DIR/manifest.json.

    \b
    Examples:
      trtgraph capture                                  # embedded default, CPU in seconds
      trtgraph capture --config examples/llama-3.2-1b-synthetic.yaml
    """
    from .outputs import check_outputs, place

    config = _load_config(config_path)
    if device:
        config = config.replace(device=device)
    out = Path(out_dir or config.output)
    check_outputs(_artifact_outputs(out, "--out"), [place("the config (--config)", config_path), _checkpoint(config)])
    world = config.parallel.tensor_parallel_size
    if world > 1:
        from .runtime.distributed import launch

        path, t = launch(world, _capture_rank, config, out, use_cuda=_uses_cuda(config.device))
    else:
        path, t = _capture_rank(None, config, out)
    if as_json:
        click.echo(json.dumps({"manifest": str(path), **t}, indent=2))
        return
    n = t["num_keys"]
    click.echo(f"captured {n} keys in {t['warmup_seconds'] + t['capture_seconds']:.2f} s "
               f"(warm-up {t['warmup_seconds']:.2f} s, capture {t['capture_seconds']:.2f} s, "
               f"{(t['warmup_seconds'] + t['capture_seconds']) / n:.4f} s/key); pool "
               f"{t['pool_bytes'] / MiB:.1f} MiB; parity ok on every key")
    for note in t.get("notes", []):
        click.echo(note)
    click.echo(f"manifest: {path}")


def _artifact_outputs(out: Path, label: str) -> list:
    """What a capture into `out` writes: the manifest and the Triton cache."""
    from .artifacts import MANIFEST_NAME, TRITON_CACHE_DIR
    from .outputs import place

    return [place(f"the manifest ({label})", out / MANIFEST_NAME, makedirs=True),
            place(f"the Triton cache ({label})", out / TRITON_CACHE_DIR, is_dir=True)]


def _checkpoint(config):
    from .outputs import place

    return place("the checkpoint directory (model.path)", config.model.path, is_dir=True)


def _uses_cuda(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _capture_rank(tp, config, out):
    """One rank's capture (tp None: the only process). Returns (manifest path, totals)."""
    from .compiler.pipeline import capture as run_capture
    from .models.parallel import TPGroup

    tp = tp or TPGroup()
    bar = _KeyProgress() if tp.rank == 0 else None
    try:
        result = run_capture(config, out, progress=bar, tp=tp)
    finally:
        if bar:
            bar.close()
    return str(result.path), result.manifest.totals


class _KeyProgress:
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


@main.command()
@click.argument("path", type=click.Path(), default="trtgraph-artifacts")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--check", is_flag=True, help="Check this machine, library versions and weights against the manifest; exit 3 on any difference.")
def inspect(path, as_json, check):
    """Show what a manifest recorded: model, environment and a table of keys (tokens,
    capture ms, pool MiB, replay ms, eager ms, parity). PATH is the artifacts directory or
    the manifest file."""
    from .artifacts import load_manifest, manifest_path
    from .report import manifest_text
    from .runtime.step.checks import check_manifest

    manifest = load_manifest(path)
    diffs = check_manifest(manifest) if check else []
    if as_json:
        body = manifest.to_json()
        if check:
            body["check"] = {"ok": not diffs, "differences": [d.__dict__ for d in diffs]}
        click.echo(json.dumps(body, indent=2, default=str))
    else:
        click.echo(manifest_text(manifest, manifest_path(path)))
        if check:
            click.echo("")
            click.echo("check: this machine matches the manifest" if not diffs else
                       "check: DIFFERS from the manifest; recapture here with `trtgraph capture --config ...`\n"
                       + "\n".join(f"  {d}" for d in diffs))
    if diffs:
        sys.exit(3)


@main.command()
@click.option("--prompts", "prompts_path", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="JSONL, one request per line ('-': standard input): native requests (id, prompt or "
                   "prompt_token_ids or messages, max_tokens, temperature, top_p, top_k, seed, stop, n, ...) "
                   "or OpenAI batch lines.")
@click.option("--manifest", "manifest", default="trtgraph-artifacts", show_default=True, type=click.Path(),
              help="Artifacts directory (or manifest.json) written by `trtgraph capture`.")
@click.option("--output", "output", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write results JSONL here ('-' or not given: standard output).")
@click.option("--eager", is_flag=True, help="Run the same scheduler eagerly instead of replaying graphs (A/B checks).")
@click.option("--summary-json", type=click.Path(dir_okay=False), help="Also write the closing summary as JSON here.")
@click.option("--resume", is_flag=True, help="Skip the ids already in --output (from an interrupted run) and append the rest.")
@click.option("--no-speculative", is_flag=True, help="Plain decode steps even if the manifest has verify keys.")
@click.option("--model", "model", type=click.Path(file_okay=False),
              help="The checkpoint directory, where it has moved since capture (checked against the manifest's sha256).")
def run(prompts_path, manifest, output, eager, summary_json, resume, no_speculative, model):
    """Serve a prompts file by replaying the manifest's graphs: never captures after start-up,
    never falls back to eager, refuses what no recorded key can serve.

    Each result is written and flushed as soon as it finishes. On SIGINT or SIGTERM the run
    stops, everything finished is already in the output, and the summary names what did not
    finish (exit code 130); `--resume` then serves only those.

    \b
    Examples:
      trtgraph run --prompts prompts.jsonl
      trtgraph run --prompts prompts.jsonl --manifest out/ --output results.jsonl
      trtgraph run --prompts prompts.jsonl --output results.jsonl --resume
    """
    from .artifacts import load_manifest, manifest_path
    from .formats.batch import read_requests
    from .outputs import check_outputs, manifest_inputs, place
    from .runtime.serving.requests import finished_ids

    output = None if output == "-" else output
    if resume and not output:
        raise click.UsageError("--resume needs --output: the results file of the interrupted run")
    outputs = [place("--output", output), place("--summary-json", summary_json)]
    inputs = [None if prompts_path == "-" else place("the prompts file (--prompts)", prompts_path),
              place("the checkpoint directory (--model)", model, is_dir=True)]
    check_outputs(outputs, inputs)
    requests = read_requests(prompts_path)  # the whole file (native or OpenAI batch), before any model work
    loaded = load_manifest(manifest)  # read and validated; no model work yet
    check_outputs(outputs, [*inputs, *manifest_inputs(loaded, manifest_path(manifest))])
    if resume:
        done = finished_ids(output, key=requests.id_field)
        requests = requests.without(done)
        click.echo(f"resume: {len(done)} requests already in {output}, {len(requests.ids)} to run", err=True)
    world = loaded.parallel.get("tensor_parallel_size", 1)
    args = (requests, manifest, output, eager, summary_json, resume, not no_speculative, model)
    if world > 1:
        from .runtime.distributed import launch

        try:
            code = launch(world, _run_rank, *args, use_cuda=_uses_cuda(loaded.app_config().device))
        except KeyboardInterrupt:  # rank 0 has already said what finished
            code = EXIT_INTERRUPTED
    else:
        code = _run_rank(None, *args)
    if code:
        sys.exit(code)


def _run_rank(tp, requests, manifest, output, eager, summary_json, resume, speculative, model=None) -> int:
    """One rank of `run` (tp None: the only process); rank 0 serves and writes, the others
    replay what it broadcasts. Returns the exit code."""
    from .models.parallel import TPGroup
    from .runtime.serving.engine import Engine

    tp = tp or TPGroup()
    if tp.rank == 0:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops like Ctrl-C
    else:  # followers stop when rank 0 says so, or when the launcher ends them
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    engine = Engine(manifest, eager=eager, speculative=speculative, tp=tp, model=model)
    if tp.rank != 0:
        engine.follow()
        return 0
    code = EXIT_INTERRUPTED
    try:
        code = _serve(engine, requests, output, eager, summary_json, resume)
        return code
    finally:
        # After an interrupt, rank 0 may have stopped between two broadcasts of a step: the
        # launcher ends the followers instead of a stop message they would misread.
        if code != EXIT_INTERRUPTED or not tp.active:
            engine.close()


def _serve(engine, requests, output, eager, summary_json, resume) -> int:
    out = open(output, "a" if resume else "w", encoding="utf-8") if output else sys.stdout
    ascii_only = not output and not _is_utf8(sys.stdout)  # JSON escapes what the terminal cannot show
    written: set[str] = set()
    ids = requests.ids  # a RequestFile: native requests or OpenAI batch lines
    token_text = lambda t: engine.tokenizer.decode([t])  # noqa: E731
    try:
        with click.progressbar(length=len(ids), label="requests", file=sys.stderr, show_pos=True) as bar:
            for rid, line in requests.lines(engine.generate(requests.requests), token_text):
                _write_line(out, json.dumps(line, ensure_ascii=ascii_only), output, written, ids)
                written.add(rid)
                bar.update(1)
    except KeyboardInterrupt:
        restore = _ignore_interrupts()  # a second signal must not cut this summary short
        try:
            missing = [i for i in ids if i not in written]
            shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            click.echo(f"\ninterrupted: {len(written)} of {len(ids)} requests finished and written"
                       f"{' to ' + output if output else ''}; {len(missing)} did not finish: {shown}."
                       + (f" Continue with --resume --output {output}." if output else ""), err=True)
        finally:
            restore()
        return EXIT_INTERRUPTED
    finally:
        if output:
            try:
                out.close()
            except OSError:  # every line was flushed, or a failed write has said so already
                pass
    stats = engine.stats.to_json()
    if summary_json:
        Path(summary_json).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    click.echo(_run_summary(stats, eager), err=True)
    return 0


def _write_line(out, line: str, output, written: set, requests) -> None:
    """One result, flushed. A file that stops taking data (disk full, I/O error) is an
    environment failure (exit 2) that says how much is safe and how to continue."""
    try:
        out.write(line + "\n")
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        if not output:
            raise
        from .errors import OutputPathError

        raise OutputPathError(f"--output {output}: writing failed ({exc.strerror or exc}) after {len(written)} of "
                              f"{len(requests)} results; the lines before are whole. Free space (or fix the "
                              f"device) and continue with --resume --output {output}.") from None


def _run_summary(s: dict, eager: bool) -> str:
    mode = "eager (no graphs)" if eager else "replay"
    lines = [f"{s['requests']} requests ({s['refused']} refused), {s['completion_tokens']} tokens generated "
             f"in {s['seconds']:.2f} s: {s['tokens_per_second']:.1f} tokens/s [{mode}]",
             f"{s['steps']} steps ({s['fast_path_steps']} on the fast path), padding waste "
             f"{s['padding_waste_pct']:.1f}%, {s['preemptions']} preemptions",
             "steps per key:"]
    lines += [f"  {k}: {v}" for k, v in s["steps_per_key"].items()]
    if "speculative" in s:
        sp = s["speculative"]
        lines.append(f"speculative: {sp['verify_steps']} verify steps, draft acceptance "
                     f"{100 * sp['acceptance_rate']:.1f}%, {sp['mean_tokens_per_row_step']:.2f} tokens per "
                     f"sequence per verify step")
    return "\n".join(lines)


@main.command()
@click.option("--manifest", "manifest", default="trtgraph-artifacts", show_default=True, type=click.Path(),
              help="Artifacts directory (or manifest.json) written by `trtgraph capture`.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(1),
              help="Requests that may wait for their first token; more get HTTP 429.")
@click.option("--api-key", envvar="TRTGRAPH_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 (or set TRTGRAPH_API_KEY).")
@click.option("--model", "model", type=click.Path(file_okay=False),
              help="The checkpoint directory, where it has moved since capture (checked against the manifest's sha256).")
def serve(manifest, host, port, max_waiting, api_key, model):
    """Serve the manifest's graphs over an OpenAI-compatible HTTP API: POST /v1/completions
    and /v1/chat/completions (streaming with `stream: true`), GET /v1/models, /health (200
    once the graphs are locked) and /metrics (Prometheus). Loads, checks, re-records and
    locks exactly as `run` does. SIGTERM stops accepting, lets in-flight requests finish for
    a few seconds, aborts the rest and exits 0.

    \b
    Examples:
      trtgraph serve --manifest trtgraph-artifacts --port 8000
      TRTGRAPH_API_KEY=secret trtgraph serve --host 0.0.0.0
    """
    from .server.app import serve as run_server

    run_server(manifest, host, port, max_waiting, api_key, model)


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Capture this config first (default: the embedded one).")
@click.option("--manifest", type=click.Path(), help="Benchmark an existing capture instead.")
@click.option("--out", "out_dir", default="trtgraph-bench", show_default=True, type=click.Path(file_okay=False),
              help="Where bench.md, bench.json and bench.png go (and the capture, with --config).")
@click.option("--context-len", default=128, show_default=True, type=click.IntRange(min=0),
              help="Cached tokens per sequence in the decode timings (below limits.max_seq_len).")
@click.option("--prompts", "num_prompts", default=256, show_default=True, type=click.IntRange(min=0),
              help="Prompts in the end-to-end run (0 skips it).")
@click.option("--prompt-len", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--attention-batch", default=64, show_default=True, type=click.IntRange(min=0),
              help="Batch of the attention-alone timing (0 skips it).")
@click.option("--attention-context", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--no-hf", is_flag=True, help="Skip the Hugging Face transformers baseline.")
def bench(config_path, manifest, out_dir, context_len, num_prompts, prompt_len, max_tokens, attention_batch,
          attention_context, no_hf):
    """Decode step time (replay and eager) per batch size against the memory-bandwidth
    floor, capture cost per key, paged attention alone, the transformers eager baseline and
    end-to-end tokens/s. Writes OUT/bench.md, OUT/bench.json and OUT/bench.png.

    \b
    Examples:
      trtgraph bench --config examples/llama-3.2-1b-synthetic.yaml
      trtgraph bench --manifest trtgraph-artifacts --prompts 64 --no-hf
    """
    from .bench import BenchOptions, check_options, run_bench

    if config_path and manifest:
        raise click.UsageError("give --config or --manifest, not both")
    opts = BenchOptions(context_len=context_len, run_prompts=num_prompts, run_prompt_len=prompt_len,
                        run_max_tokens=max_tokens, attention_batch=attention_batch,
                        attention_context=attention_context, hf=not no_hf)
    out = Path(out_dir)
    config = _bench_paths(config_path, manifest, out)
    check_options(opts, config.limits)
    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    if manifest is None:
        from .compiler.pipeline import capture as run_capture

        bar = _KeyProgress()
        try:
            run_capture(config, out / "artifacts", progress=bar)
        finally:
            bar.close()
        manifest = out / "artifacts"
    run_bench(Path(manifest), out, opts, log)
    click.echo((out / "bench.md").read_text(encoding="utf-8"))


def _bench_paths(config_path, manifest, out: Path):
    """Check bench's outputs against what it reads, before any work; return the config."""
    from .artifacts import load_manifest, manifest_path
    from .outputs import check_outputs, manifest_inputs, place

    outputs = [place(f"--out {name}", out / name, makedirs=True) for name in ("bench.json", "bench.md", "bench.png")]
    if manifest is None:
        config = _load_config(config_path)
        outputs += _artifact_outputs(out / "artifacts", "--out artifacts")
        inputs = [place("the config (--config)", config_path), _checkpoint(config)]
    else:
        loaded = load_manifest(manifest)
        config = loaded.app_config()
        inputs = manifest_inputs(loaded, manifest_path(manifest))
    check_outputs(outputs, inputs)
    return config


if __name__ == "__main__":  # pragma: no cover
    main()
