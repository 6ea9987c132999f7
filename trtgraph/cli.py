"""The trtgraph command line: parse, print, map errors to exit codes. No logic here.

Exit codes:
  0    success
  1    an internal error (a bug: please report it)
  2    a TrtgraphError (bad input, mismatch, refusal) or running out of memory, with a
       one-paragraph message naming the file, line or field and what to do
  3    `inspect --check`: this machine, its libraries or the weights differ from the manifest
  130  interrupted (SIGINT or SIGTERM); what finished is kept and named
  141  stdout or stderr closed early (a broken pipe, e.g. `| head -1`), quietly
TRTGRAPH_RAISE_ERRORS=1 (not 0, false, no or off) shows tracebacks.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import click

from . import __version__, startup
from .cli_exits import EXIT_INTERRUPTED, Group
from .cli_ranks import capture_rank, on_ranks, run_rank

MiB = 1 << 20
_PROGRAM = False  # set by entry(): this process is the `trtgraph` program, not a caller of main()


def entry():
    """The `trtgraph` program (console script, `python -m trtgraph`). A `run` or `capture` of
    one process that succeeds ends at once after its last output (startup.exit_now): the
    interpreter's and CUDA's teardown would be seconds no phase measures. Its imports run
    without the cyclic collector (startup.defer_gc; resumed when a capture or engine begins)."""
    global _PROGRAM
    _PROGRAM = True
    startup.defer_gc()
    main()


def _done() -> None:
    """A command of one process finished with exit code 0 and closed its files."""
    if _PROGRAM:
        startup.exit_now(0)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtgraph")
def main():
    """trtgraph: ahead-of-time CUDA graphs for LLM decoding.

    \b
      trtgraph capture --config model.yaml   warm up, capture every bucket, write a manifest
      trtgraph inspect trtgraph-artifacts    what was captured, what it cost, does it fit here
      trtgraph run --prompts prompts.jsonl   replay-only serving of a batch of prompts
      trtgraph serve                         an OpenAI-compatible server on the same engine
    """
    startup.cache_bytecode()  # before any command imports torch


def _load_config(path: str | None):
    from .config import Config

    _not_empty("--config", path, "a YAML file, or leave --config out to use the embedded default")
    return Config.from_yaml(path, for_capture=True) if path else Config.default()


def _not_empty(option: str, value: str | None, what: str) -> None:
    """An option given as "" (an unset shell variable) must not mean its default: `--config ""`
    captured the embedded default over the artifacts of the config meant."""
    if value is not None and not value.strip():
        raise click.UsageError(f"{option} is empty; give {what}.")


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
      trtgraph capture --config examples/stdlib-llama.yaml    # the shipped model, CPU in seconds
      trtgraph capture --config examples/llama-3.2-1b-synthetic.yaml   # on a GPU
    """
    from .outputs import check_outputs, place

    _not_empty("--out", out_dir, "a directory, or leave --out out to use the config's `output`")
    config = _load_config(config_path)
    if device:
        config = config.replace(device=device)
    startup.start_cuda_early(config.device, config.parallel.tensor_parallel_size)  # beside torch's import
    out = Path(out_dir or config.output)
    label = "--out" if out_dir else f"`output` of {config.source}"
    check_outputs(_artifact_outputs(out, label), [place("the config (--config)", config_path), _checkpoint(config)])
    with _ranks_leave_nothing(out, config.parallel.tensor_parallel_size):
        path, t = on_ranks(config.parallel.tensor_parallel_size, config.device, capture_rank, config, out)
    phases = startup.CLOCK.to_json()  # the process's phases, from its start to the manifest written
    if as_json:
        click.echo(json.dumps({"manifest": str(path), **t, "phases": phases}, indent=2))
    else:
        _capture_summary(path, t)
        if config.parallel.tensor_parallel_size > 1:  # this process only launched the ranks
            click.echo(f"phases: not measured at tensor_parallel_size {config.parallel.tensor_parallel_size} (each "
                       f"rank captures in a process of its own; warm-up and capture seconds above are rank 0's)")
        else:
            click.echo("phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases["phases_seconds"].items())
                       + f" ({phases['total_seconds']:.2f} s)")
    if config.parallel.tensor_parallel_size == 1:
        _done()


@contextlib.contextmanager
def _ranks_leave_nothing(out: Path, world: int):
    """A failed capture leaves no directory it made. One process cleans up after itself; of
    several ranks, each cleans up what it made, but the launcher stops the others mid-way (a
    rank finds the directory another rank's cache still fills): the launcher finishes it."""
    from .artifacts import TRITON_CACHE_DIR

    made = [d for d in (out, *out.parents) if not d.exists()] if world > 1 else []
    cache = out / TRITON_CACHE_DIR
    made_cache = world > 1 and not cache.exists()
    try:
        yield
    except BaseException:
        if made_cache:
            shutil.rmtree(cache, ignore_errors=True)
        for d in made:  # innermost first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise


def _capture_summary(path, t: dict) -> None:
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


@main.command()
@click.argument("path", type=click.Path(), default="trtgraph-artifacts")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--check", is_flag=True, help="Check this machine, library versions and weights against the manifest; exit 3 on any difference.")
def inspect(path, as_json, check):
    """Show what a manifest recorded: model, environment and a table of keys (tokens,
    capture ms, pool MiB, replay ms, eager ms, parity). PATH is the artifacts directory or
    the manifest file.

    \b
    Examples:
      trtgraph inspect                                  # ./trtgraph-artifacts
      trtgraph inspect out/ --check                     # does it fit this machine? (exit 3 if not)
      trtgraph inspect out/manifest.json --json | jq .totals
    """
    from .artifacts import load_manifest, manifest_path
    from .report import check_text, manifest_text
    from .runtime.step.checks import check_manifest

    _not_empty("PATH", path, "the artifacts directory or its manifest, or leave it out for trtgraph-artifacts")
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
            click.echo("\n" + check_text(diffs))
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
@click.option("--summary-json", type=click.Path(dir_okay=False, allow_dash=True),
              help="Also write the closing summary as JSON here ('-': standard output, with --output FILE).")
@click.option("--resume", is_flag=True, help="Skip the ids already in --output (from an interrupted run) and append "
                                              "the rest; a result whose request was edited since is refused.")
@click.option("--no-speculative", is_flag=True, help="Plain decode steps even if the manifest has verify keys.")
@click.option("--model", "model", type=click.Path(file_okay=False),
              help="The checkpoint directory, where it has moved since capture (checked against the manifest's sha256).")
@click.option("--verbose", "-v", is_flag=True, help="Also print the start-up phases (imports, weights, KV cache, "
                                                    "warm-up, re-record, first token).")
def run(prompts_path, manifest, output, eager, summary_json, resume, no_speculative, model, verbose):
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
    from .outputs import check_outputs, manifest_inputs, output_locked, place, stdin_place, stdout_place
    from .runtime.serving.resume import refuse_unfinished, resume_point

    output = _run_options(prompts_path, manifest, model, output, summary_json, resume)
    outputs = [place("--output", output), stdout_place("--summary-json - (standard output)") if summary_json == "-"
               else place("--summary-json", summary_json)]
    inputs = [stdin_place("the prompts file (--prompts -, standard input)") if prompts_path == "-" else
              place("the prompts file (--prompts)", prompts_path),
              place("the checkpoint directory (--model)", model, is_dir=True)]
    check_outputs(outputs, inputs)
    requests = read_requests(prompts_path)  # the whole file (native or OpenAI batch), before any model work
    loaded = load_manifest(manifest)  # read and validated; no model work yet
    check_outputs(outputs, [*inputs, *manifest_inputs(loaded, manifest_path(manifest))])
    config = loaded.app_config()
    with output_locked("--output", output) as release:  # a second run on the same file is refused, not interleaved
        if not resume and output:
            refuse_unfinished(output, requests.id_field, set(requests.ids), requests.name)
        if resume:
            found = resume_point(output, key=requests.id_field, expected=set(requests.ids), prompts=requests.name,
                                 sources=requests.sources,  # refuses results of requests edited since
                                 stale=requests.cut_by_old_default(config.limits.max_seq_len))
            requests = requests.without(found.done)
            click.echo(f"resume: {len(found.done)} requests already in {output}, {len(requests.ids)} to run", err=True)
            if found.unchecked:
                click.echo(f"resume: {found.unchecked} of them written by an older trtgraph, without a request "
                           f"fingerprint: not checked against {requests.name} (an edited request keeps its old "
                           f"result)", err=True)
        if config.parallel.tensor_parallel_size > 1:
            release()  # rank 0 writes; the launcher holds nothing open (its SIGKILL must leave no writer)
        args = (requests, loaded, output, eager, summary_json, resume, not no_speculative, model, verbose, _PROGRAM)
        try:
            code = on_ranks(config.parallel.tensor_parallel_size, config.device, run_rank, *args)
        except KeyboardInterrupt:  # from the ranks' launcher: rank 0 has already said what finished
            if config.parallel.tensor_parallel_size == 1:
                raise
            code = EXIT_INTERRUPTED
        if code:
            sys.exit(code)
        if config.parallel.tensor_parallel_size == 1:
            _done()


def _run_options(prompts_path, manifest, model, output, summary_json, resume) -> str | None:
    """`run`'s path options checked together; returns --output (None: standard output)."""
    _not_empty("--prompts", prompts_path, "a JSONL file, or - for standard input")
    _not_empty("--manifest", manifest, "the artifacts directory, or leave --manifest out for trtgraph-artifacts")
    _not_empty("--model", model, "the checkpoint directory, or leave --model out for the manifest's model.path")
    _not_empty("--output", output, "a file, or leave --output out for standard output")
    _not_empty("--summary-json", summary_json, "a file, or leave --summary-json out")
    output = None if output == "-" else output
    if resume and not output:
        raise click.UsageError("--resume needs --output: the results file of the interrupted run")
    if summary_json == "-" and not output:  # the indented summary would land among the JSONL results
        raise click.UsageError("--summary-json - and the results (no --output, or --output -) would both go to "
                               "standard output; give --output FILE, or write the summary to a file")
    return output


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

    _not_empty("--manifest", manifest, "the artifacts directory, or leave --manifest out for trtgraph-artifacts")
    _not_empty("--model", model, "the checkpoint directory, or leave --model out for the manifest's model.path")
    if api_key is not None and (not api_key or api_key != api_key.strip()):
        # (HTTP strips a header's surrounding spaces: no client could send such a key; every call would get 401)
        raise click.UsageError(f"--api-key (or TRTGRAPH_API_KEY) = {api_key!r}: give a non-empty key without "
                               f"leading or trailing spaces, or leave it out to serve without one")
    run_server(manifest, host, port, max_waiting, api_key, model)


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Capture this config first (default: the embedded one).")
@click.option("--manifest", type=click.Path(), help="Benchmark an existing capture instead.")
@click.option("--out", "out_dir", default="trtgraph-bench", show_default=True, type=click.Path(file_okay=False),
              help="Where bench.md, bench.json and bench.png go (and the capture, with --config).")
@click.option("--context-len", default=128, show_default=True, type=click.IntRange(min=0),
              help="Cached tokens per sequence in the decode timings (below limits.max_seq_len).")
@click.option("--prompts", "num_prompts", default=256, show_default=True, type=click.IntRange(0, 1 << 20),
              help="Prompts in the end-to-end run (0 skips it).")
@click.option("--prompt-len", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--attention-batch", default=64, show_default=True, type=click.IntRange(0, 1 << 16),
              help="Batch of the attention-alone timing (0 skips it).")
@click.option("--attention-context", default=4096, show_default=True, type=click.IntRange(1, 1 << 24))
@click.option("--mixed", "mixed_prompts", default=512, show_default=True, type=click.IntRange(0, 1 << 20),
              help="Requests of the mixed workload (prompts 8-1500, outputs 16-256, a third sampled; 0 skips it).")
@click.option("--no-hf", is_flag=True, help="Skip the Hugging Face transformers baseline.")
def bench(config_path, manifest, out_dir, context_len, num_prompts, prompt_len, max_tokens, attention_batch,
          attention_context, mixed_prompts, no_hf):
    """Decode step time (replay and eager) per batch size against the memory-bandwidth
    floor, capture cost per key, paged attention alone, the transformers eager baseline,
    end-to-end tokens/s (GPU idle per step, against the step-time bound), a mixed workload
    and the start-up phases. Writes OUT/bench.md, OUT/bench.json and OUT/bench.png.

    \b
    Examples:
      trtgraph bench --config examples/llama-3.2-1b-synthetic.yaml   # on a GPU
      trtgraph bench --manifest trtgraph-artifacts --prompts 64 --no-hf
    """
    from .bench import BenchOptions, check_options, run_bench

    _not_empty("--config", config_path, "a YAML file, or leave --config out to use the embedded default")
    _not_empty("--manifest", manifest, "the artifacts directory, or leave --manifest out to capture the config")
    _not_empty("--out", out_dir, "a directory, or leave --out out for trtgraph-bench")
    if config_path and manifest:
        raise click.UsageError("give --config or --manifest, not both")
    opts = BenchOptions(context_len=context_len, run_prompts=num_prompts, run_prompt_len=prompt_len,
                        run_max_tokens=max_tokens, attention_batch=attention_batch,
                        attention_context=attention_context, hf=not no_hf, mixed_prompts=mixed_prompts)
    out = Path(out_dir)
    config, loaded = _bench_paths(config_path, manifest, out)
    check_options(opts, config.limits)
    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    if loaded is None:
        with _ranks_leave_nothing(out / "artifacts", config.parallel.tensor_parallel_size):
            on_ranks(config.parallel.tensor_parallel_size, config.device, capture_rank, config, out / "artifacts")
        loaded = out / "artifacts"
    run_bench(loaded, out, opts, log)
    click.echo((out / "bench.md").read_text(encoding="utf-8"))


def _bench_paths(config_path, manifest, out: Path):
    """Check bench's outputs against what it reads, before any work; return the config and
    the loaded manifest (None with --config: it is captured first)."""
    from .artifacts import load_manifest, manifest_path
    from .outputs import check_outputs, manifest_inputs, place

    outputs = [place(f"--out {name}", out / name, makedirs=True) for name in ("bench.json", "bench.md", "bench.png")]
    loaded = None
    if manifest is None:
        config = _load_config(config_path)
        outputs += _artifact_outputs(out / "artifacts", "--out artifacts")
        inputs = [place("the config (--config)", config_path), _checkpoint(config)]
    else:
        loaded = load_manifest(manifest)
        config = loaded.app_config()
        inputs = manifest_inputs(loaded, manifest_path(manifest))
    check_outputs(outputs, inputs)
    return config, loaded


if __name__ == "__main__":  # pragma: no cover
    main()
