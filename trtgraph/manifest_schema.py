"""Every field of a manifest, checked on load: types, ranges, names, and agreement between
sections. The digest only proves the file was not edited by accident; a forged manifest
whose digest was recomputed must still be refused field by field, before anything reads it.

`artifacts.load_manifest` reads the file and calls these; each problem is a ManifestError
naming the manifest, the field (`keys[3].pool_bytes`), the value and what was expected.
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path
from typing import Any

from .buckets import GraphKey
from .config import DTYPE_NAMES, SAMPLING_MODES, Config
from .errors import ConfigError, ManifestError, TrtgraphError
from .fields import FieldChecker
from .inputs import int_problem, is_int, is_number, short, text_problem

TOP_LEVEL = ("format_version", "format_changelog", "trtgraph_version", "created", "environment", "model",
             "config", "limits", "kv_cache", "buffers", "keys", "totals", "paths", "parallel", "digest")
ENVIRONMENT = ("python", "torch", "cuda", "triton", "backend", "device_name", "capability")
BACKENDS = ("cuda", "static")
MODEL = ("source", "architecture", "config_hash", "dtype", "parameter_count", "seed", "weight_files")
BUFFER_DTYPES = ("int64", "int32", "float32", "float16", "bfloat16")
MAX_BYTES = 1 << 44  # 16 TiB: more than any host or device holds
MAX_SECONDS = 86400.0
MAX_TEXT = 256  # versions, names, devices
_HEX = re.compile(r"[0-9a-f]+")


class FieldReader(FieldChecker):
    """The manifest's checks: ManifestError naming the manifest and the dotted field path.
    In the `*_field` readers `name` is the full path; the value is looked up under its last
    part in `d`."""

    def __init__(self, path: Path, recapture: str):
        self.path, self.recapture = path, recapture

    def fail(self, field_name: str, value: Any, expected: str):
        raise ManifestError(f"{self.path}: {field_name} = {short(value)}; expected {expected}. {self.recapture}")

    def obj(self, value: Any, name: str, allowed: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        """A JSON object with exactly the `allowed` keys (those in `optional` may be absent)."""
        if not isinstance(value, dict):
            self.fail(name, value, "a JSON object")
        unknown = sorted(short(k) for k in value if k not in allowed)
        missing = [k for k in allowed if k not in value and k not in optional]
        if unknown or missing:
            problem = "; ".join(([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
                                + ([f"missing {', '.join(missing)}"] if missing else []))
            raise ManifestError(f"{self.path}: {name} has {problem}; a manifest holds exactly "
                                f"{', '.join(allowed)} there. {self.recapture}")
        return value

    def typed(self, body: dict, name: str, kind):
        if not isinstance(body.get(name), kind):
            self.fail(name, body.get(name), f"a JSON {'object' if kind is dict else 'list'}")
        return body[name]

    def int_field(self, d: dict, name: str, lo: int = 0, hi: int = 1 << 40) -> int:
        return self.integer(d.get(_last(name)), name, lo, hi)

    def number_field(self, d: dict, name: str, hi: float = 1e9) -> float:
        return self.number(d.get(_last(name)), name, 0, hi, expected=f"a number in [0, {hi:g}]")

    def text_field(self, d: dict, name: str, nullable: bool = False,
                   choices: tuple[str, ...] | None = None) -> str | None:
        """Short printable text (one of `choices` when given; null too with `nullable`)."""
        val = d.get(_last(name))
        if val is None and nullable:
            return None
        problem = text_problem(val) or (None if 0 < len(val) <= MAX_TEXT else f"1 to {MAX_TEXT} characters")
        if not problem and any(ord(c) < 32 or 127 <= ord(c) < 160 for c in val):
            problem = "text without control characters (they would reach the terminal)"
        if problem or (choices is not None and val not in choices):
            self.fail(name, val, f"one of {', '.join(choices)}" if choices else
                      problem + (" or null" if nullable else ""))
        return val

    def hex_digest(self, d: dict, name: str, length: int) -> str:
        val = d.get(_last(name))
        if not isinstance(val, str) or len(val) != length or not _HEX.fullmatch(val):
            self.fail(name, val, f"{length} lowercase hex digits")
        return val


def _last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def check_header(v: FieldReader, body: dict) -> None:
    """Top-level keys, the version strings and the creation time."""
    v.obj(body, "its top level", TOP_LEVEL)
    if not isinstance(body["format_changelog"], dict):
        v.fail("format_changelog", body["format_changelog"], "a JSON object")
    v.text_field(body, "trtgraph_version")
    v.hex_digest(body, "digest", 64)
    created = v.text_field(body, "created")
    try:
        _dt.datetime.fromisoformat(created)
    except ValueError:
        v.fail("created", created, "an ISO 8601 time such as 2026-11-29T13:32:49+00:00")


def check_environment(v: FieldReader, env: Any) -> None:
    v.obj(env, "environment", ENVIRONMENT)
    for name in ("python", "torch", "device_name"):
        v.text_field(env, f"environment.{name}")
    for name in ("cuda", "triton", "capability"):
        v.text_field(env, f"environment.{name}", nullable=True)
    v.text_field(env, "environment.backend", choices=BACKENDS)


def config_section(v: FieldReader, raw: Any) -> Config:
    """The embedded config, through the same validator as a model.yaml. Its model.path is
    absolute (capture resolved it); whether the checkpoint is still there is the runtime's
    question (`run --model` serves a checkpoint that moved), so `inspect` works either way."""
    model = raw.get("model") if isinstance(raw, dict) else None
    path = model.get("path") if isinstance(model, dict) else None
    if path is not None and (text_problem(path) or not Path(path).is_absolute()):
        v.fail("config.model.path", path, "an absolute checkpoint directory (capture writes it resolved)")
    try:
        return Config.from_dict(raw, source=f"{v.path} config", check_paths=False)
    except ConfigError as exc:
        raise ManifestError(f"{v.path}: its config section is invalid: {exc} {v.recapture}") from None


def check_model(v: FieldReader, model: Any, config: Config) -> None:
    """The model fingerprint: what the weights were (compared with the weights found at run).
    A synthetic model is known from the config alone: its spec is complete and matches."""
    from .models.config import SEED_MAX, SUPPORTED_ARCHITECTURES

    v.obj(model, "model", MODEL + ("files", "generation_config", "hub"),
          optional=("seed", "files", "generation_config", "hub"))
    v.text_field(model, "model.source")
    v.text_field(model, "model.architecture", choices=SUPPORTED_ARCHITECTURES)
    v.hex_digest(model, "model.config_hash", 16)
    if v.text_field(model, "model.dtype", choices=DTYPE_NAMES) != config.dtype:
        v.fail("model.dtype", model["dtype"], f"{config.dtype!r}, the config's dtype")
    v.int_field(model, "model.parameter_count", lo=1, hi=MAX_BYTES)
    if "seed" in model:
        v.int_field(model, "model.seed", lo=0, hi=SEED_MAX)
    for group in ("weight_files", "files"):  # the weights; config, tokenizer and template files
        if group in model:
            _check_file_records(v, model[group], f"model.{group}")
    if "generation_config" in model:
        _check_generation_config(v, model["generation_config"])
    if "hub" in model:
        v.obj(model["hub"], "model.hub", ("repo", "revision", "snapshot"))
        for name in ("repo", "revision", "snapshot"):
            v.text_field(model["hub"], f"model.hub.{name}")
    if config.model.is_synthetic:
        _check_synthetic_model(v, model, config)


def _check_file_records(v: FieldReader, files: Any, where_list: str) -> None:
    if not isinstance(files, list):
        v.fail(where_list, files, "a JSON list")
    names = set()
    for i, entry in enumerate(files):
        where = f"{where_list}[{i}]"
        v.obj(entry, where, ("name", "bytes", "sha256", "mtime_ns"), optional=("mtime_ns",))  # format 1: none
        name = v.text_field(entry, f"{where}.name")
        if "/" in name or "\\" in name or name in (".", "..") or name in names:
            v.fail(f"{where}.name", name, "a file name of the checkpoint directory, listed once")
        names.add(name)
        v.int_field(entry, f"{where}.bytes", lo=0, hi=MAX_BYTES)
        v.hex_digest(entry, f"{where}.sha256", 64)
        if "mtime_ns" in entry:
            v.int_field(entry, f"{where}.mtime_ns", lo=0, hi=1 << 64)


def _check_generation_config(v: FieldReader, gen: Any) -> None:
    """What capture read from generation_config.json (models.config.GenerationDefaults)."""
    from .models.config import GenerationDefaults

    v.obj(gen, "model.generation_config", ("eos_token_ids", "do_sample", "temperature", "top_p", "top_k"))
    try:
        GenerationDefaults.from_hf({**gen, "eos_token_id": gen["eos_token_ids"]}, source="generation_config")
    except TrtgraphError as exc:
        v.fail("model.generation_config", gen, f"valid generation defaults ({exc})")


def _check_synthetic_model(v: FieldReader, model: dict, config: Config) -> None:
    from .models.config import synthetic_model_config

    try:
        seed, cfg = synthetic_model_config(config.model.synthetic, config.limits.max_seq_len,
                                           source=f"{v.path} config")
    except TrtgraphError as exc:
        raise ManifestError(f"{v.path}: its config section is invalid: {exc} {v.recapture}") from None
    expected = {"source": "synthetic", "architecture": cfg.architecture, "config_hash": cfg.fingerprint(),
                "parameter_count": cfg.parameter_count(), "seed": seed, "weight_files": []}
    for name, want in expected.items():
        if model.get(name) != want:
            v.fail(f"model.{name}", model.get(name), f"{short(want)}, from the synthetic spec in its config")


def check_kv_cache(v: FieldReader, kv: Any, config: Config) -> None:
    v.obj(kv, "kv_cache", ("block_size", "num_blocks", "bytes"))
    for name in ("block_size", "num_blocks"):
        want = getattr(config.kv_cache, name)
        if kv[name] != want or not is_int(kv[name]):
            v.fail(f"kv_cache.{name}", kv[name], f"{want}, as the config section says")
    v.int_field(kv, "kv_cache.bytes", lo=1, hi=MAX_BYTES)


def check_buffers(v: FieldReader, buffers: Any) -> None:
    """The persistent buffer layout (the runtime compares it with the one it builds)."""
    if not isinstance(buffers, list) or not buffers:
        v.fail("buffers", buffers, "a non-empty JSON list")
    names = set()
    for i, buf in enumerate(buffers):
        where = f"buffers[{i}]"
        v.obj(buf, where, ("name", "shape", "dtype"))
        name = v.text_field(buf, f"{where}.name")
        if name in names:
            v.fail(f"{where}.name", name, "a name not listed before")
        names.add(name)
        shape = buf["shape"]
        if not isinstance(shape, list) or not 1 <= len(shape) <= 4 or any(int_problem(n, 0, 1 << 32) for n in shape):
            v.fail(f"{where}.shape", shape, "a list of 1 to 4 sizes in [0, 2**32]")
        v.text_field(buf, f"{where}.dtype", choices=BUFFER_DTYPES)


def key_record_fields(v: FieldReader, i: int, raw: Any) -> dict:
    """The fields of keys[i], checked; GraphKey and num_tokens agree."""
    where = f"keys[{i}]"
    v.obj(raw, where, ("key", "num_tokens", "capture_index", "capture_seconds", "pool_bytes", "replay_ms",
                       "eager_ms", "parity"))
    k = v.obj(raw["key"], f"{where}.key", ("batch_size", "draft_len", "chunk_size", "sampling"))
    key = GraphKey(v.int_field(k, f"{where}.key.batch_size", lo=1, hi=1 << 16),
                   v.int_field(k, f"{where}.key.draft_len", lo=0, hi=1 << 10),
                   v.int_field(k, f"{where}.key.chunk_size", lo=0, hi=1 << 22),
                   v.text_field(k, f"{where}.key.sampling", choices=SAMPLING_MODES))
    n = v.int_field(raw, f"{where}.num_tokens", lo=1, hi=1 << 24)
    if n != key.num_tokens:
        v.fail(f"{where}.num_tokens", n, f"{key.num_tokens} for {key}")
    parity = v.obj(raw["parity"], f"{where}.parity", ("max_abs_logit_diff", "tokens_equal"))
    v.flag(parity["tokens_equal"], f"{where}.parity.tokens_equal")
    return dict(key=key, num_tokens=n, capture_index=v.int_field(raw, f"{where}.capture_index", hi=1 << 20),
                capture_seconds=v.number_field(raw, f"{where}.capture_seconds", hi=MAX_SECONDS),
                pool_bytes=v.int_field(raw, f"{where}.pool_bytes", lo=0, hi=MAX_BYTES),
                replay_ms=v.number_field(raw, f"{where}.replay_ms", hi=1e7),
                eager_ms=v.number_field(raw, f"{where}.eager_ms", hi=1e7),
                max_abs_logit_diff=v.number_field(parity, f"{where}.parity.max_abs_logit_diff", hi=1e30),
                tokens_equal=parity["tokens_equal"])


def check_totals(v: FieldReader, totals: Any, pool_bytes: list[int]) -> None:
    """Totals agree with the keys they sum up."""
    v.obj(totals, "totals", ("num_keys", "warmup_seconds", "capture_seconds", "pool_bytes",
                             "largest_key_pool_bytes", "all_parity_ok", "linear_backends", "fused_ops", "notes",
                             "warmup_keys", "replay_timing", "linear_times_us"),
          optional=("all_parity_ok", "linear_backends", "fused_ops", "notes", "warmup_keys", "replay_timing",
                    "linear_times_us"))
    if v.int_field(totals, "totals.num_keys", lo=1, hi=1 << 20) != len(pool_bytes):
        v.fail("totals.num_keys", totals["num_keys"], f"{len(pool_bytes)}, the number of keys")
    if v.int_field(totals, "totals.pool_bytes", lo=0, hi=MAX_BYTES) != sum(pool_bytes):
        v.fail("totals.pool_bytes", totals["pool_bytes"], f"{sum(pool_bytes)}, the sum of the keys' pool_bytes")
    if v.int_field(totals, "totals.largest_key_pool_bytes", lo=0, hi=MAX_BYTES) != max(pool_bytes):
        v.fail("totals.largest_key_pool_bytes", totals["largest_key_pool_bytes"],
               f"{max(pool_bytes)}, the largest of the keys' pool_bytes")
    v.number_field(totals, "totals.warmup_seconds", hi=MAX_SECONDS)
    v.number_field(totals, "totals.capture_seconds", hi=MAX_SECONDS)
    if "all_parity_ok" in totals:  # written by earlier captures (always true); read by nothing
        v.flag(totals["all_parity_ok"], "totals.all_parity_ok")
    notes = totals.get("notes", [])
    if not isinstance(notes, list) or len(notes) > 16 or any(not isinstance(n, str) or text_problem(n) for n in notes):
        v.fail("totals.notes", notes, "a list of at most 16 strings (what capture decided, e.g. max_seq_len auto)")
    backends = totals.get("linear_backends", {})
    if not isinstance(backends, dict) or len(backends) > 64 or any(
            not isinstance(k, str) or not re.fullmatch(r"[0-9]{1,7}x[0-9]{1,7}", k) or not isinstance(b, str)
            or not re.fullmatch(r"triton|cublas(\+triton:[0-9]{1,7}(,[0-9]{1,7}){0,4095})?", b)
            for k, b in backends.items()):
        v.fail("totals.linear_backends", backends, 'an object {"NxK": "triton" | "cublas" | "cublas+triton:M1,M2,..." '
               '(cuBLAS, Triton at those row counts)} per GEMM shape')
    times = totals.get("linear_times_us", {})  # capture's timing behind linear_backends; read by inspect
    if not isinstance(times, dict) or len(times) > 64 or any(
            k not in backends or not isinstance(t, dict) or set(t) != {"cublas", "chosen"}
            or any(not is_number(us) or not 0 <= us < 1e9 for us in t.values()) for k, t in times.items()):
        v.fail("totals.linear_times_us", times, 'an object {"NxK": {"cublas": us, "chosen": us}} (over the plan\'s '
               'row counts: cuBLAS alone, the recorded choice) per timed GEMM shape of totals.linear_backends')
    warm = totals.get("warmup_keys")  # the keys a start warms, each named by str(GraphKey); absent: all
    if warm is not None and (not isinstance(warm, list) or not 0 < len(warm) <= len(pool_bytes) or any(
            not isinstance(k, str) or text_problem(k) or len(k) > 200 for k in warm)):
        v.fail("totals.warmup_keys", warm, "a list of 1 to num_keys key names (the keys a start warms up)")
    timing = totals.get("replay_timing", {})
    if not isinstance(timing, dict) or len(timing) > 8 or any(
            not isinstance(k, str) or not is_number(x) for k, x in timing.items()):
        v.fail("totals.replay_timing", timing, "an object of numbers (repeats and spread of the replay timings)")
    fused = totals.get("fused_ops", {})
    if not isinstance(fused, dict) or len(fused) > 64 or any(
            not isinstance(k, str) or not re.fullmatch(r"[a-z_]{1,32}:[0-9]{1,7}x[0-9]{1,7}", k)
            or not isinstance(b, str)
            or not re.fullmatch(r"composed|fused(<=[0-9]{1,4})?(\+light<=[0-9]{1,4})?(\+tail<=[0-9]{1,4})?"
                                r"|(split[0-9]{1,2}|tma):[0-9]{1,4}-[0-9]{1,4}", b)
            for k, b in fused.items()):
        v.fail("totals.fused_ops", fused, 'an object {"op:NxK": "fused" | "fused<=ROWS" | "composed"} per fused op '
               'and weight shape (a fused name may end in "+light<=ROWS" and / or "+tail<=ROWS"; the split down '
               'projection: "linear_residual_norm:NxK": "splitS:LO-HI"; the TMA-fed LM head: '
               '"norm_linear_tma:VxK": "tma:LO-HI")')


def check_parallel(v: FieldReader, par: Any, config: Config) -> None:
    """The tensor-parallel size (as the config says) and one record per rank, in order."""
    v.obj(par, "parallel", ("tensor_parallel_size", "ranks"))
    n = v.int_field(par, "parallel.tensor_parallel_size", lo=1, hi=64)
    if n != config.parallel.tensor_parallel_size:
        v.fail("parallel.tensor_parallel_size", n, f"{config.parallel.tensor_parallel_size}, as its config says")
    ranks = par["ranks"]
    if not isinstance(ranks, list) or len(ranks) != n:
        v.fail("parallel.ranks", ranks, f"a list of {n} rank records")
    for i, rank in enumerate(ranks):
        where = f"parallel.ranks[{i}]"
        v.obj(rank, where, ("rank", "device", "parameter_count", "kv_cache_bytes"))
        if rank["rank"] != i or not is_int(rank["rank"]):
            v.fail(f"{where}.rank", rank["rank"], str(i))
        v.text_field(rank, f"{where}.device")
        v.int_field(rank, f"{where}.parameter_count", lo=1, hi=MAX_BYTES)
        v.int_field(rank, f"{where}.kv_cache_bytes", lo=1, hi=MAX_BYTES)


def foreign_file(path: Path, body: Any) -> str | None:
    """Where a file passed as a manifest plainly is something else, what it is and what to pass
    instead: a model config (YAML), a JSONL file, a JSON object of no trtgraph format (a prompts
    line, another tool's manifest.json). `body`: its JSON value (None: not JSON)."""
    instead = "Pass the artifacts directory `trtgraph capture` wrote (or its manifest.json)."
    if body is None and path.suffix.lower() in (".yaml", ".yml"):
        return (f"{path}: a model config (YAML), not a manifest. Capture it first (`trtgraph capture --config "
                f"{path}`), then pass the artifacts directory it writes.")
    if body is None and path.suffix.lower() == ".jsonl":
        return f"{path}: a JSONL file (prompts or results?), not a trtgraph manifest. {instead}"
    if isinstance(body, dict) and "format_version" not in body and "trtgraph_version" not in body:
        return f"{path}: not a trtgraph manifest (it has no format_version). {instead}"
    return None
