"""The manifest: what was captured and proven, as versioned JSON.

A CUDA graph cannot outlive its process, so the manifest records *what* was captured
(keys, token counts, buffer layout, memory, timings, eager parity, model and environment
fingerprints); the runtime re-records exactly those graphs and checks them against it.
It is plain JSON, written atomically; nothing loaded from artifacts executes code, and
every artifact path inside it is relative and stays inside the artifacts directory.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import manifest_schema as schema
from .buckets import BucketPlan, GraphKey, uncovered_shapes
from .config import Config
from .errors import ManifestError, OutputPathError
from .inputs import InputTooLarge, JSONProblem, is_int, loads_json, path_problem, read_bounded, short
from .manifest_schema import FieldReader

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of thousands of keys is under 2 MiB
TRITON_CACHE_DIR = "triton-cache"

# Format versions, one line each. Bump on any change a reader must know about.
FORMAT_VERSION = 2
FORMAT_CHANGELOG = {
    1: "first format: environment, model fingerprint, config, limits, kv_cache, buffers, keys "
       "(capture order, seconds, pool bytes, replay and eager ms, parity), totals, artifact paths, "
       "tensor-parallel ranks, digest",
    2: "checkpoint file records carry mtime_ns: a start whose file sizes and times match skips the sha256",
}


def trtgraph_version() -> str:
    from . import __version__

    return __version__


def environment(device: torch.device, backend: str) -> dict:
    """The versions and device a manifest was made with (and a load is checked against)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {"python": platform.python_version(), "torch": torch.__version__.split("+")[0],
           "cuda": torch.version.cuda, "triton": triton_version, "backend": backend,
           "device_name": "cpu", "capability": None}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


@dataclass
class KeyRecord:
    key: GraphKey
    num_tokens: int
    capture_index: int  # position in the capture order (largest pool first); the runtime repeats it
    capture_seconds: float
    pool_bytes: int
    replay_ms: float
    eager_ms: float
    max_abs_logit_diff: float
    tokens_equal: bool

    def to_json(self) -> dict:
        return {"key": self.key.as_dict(), "num_tokens": self.num_tokens, "capture_index": self.capture_index,
                "capture_seconds": round(self.capture_seconds, 6), "pool_bytes": self.pool_bytes,
                "replay_ms": round(self.replay_ms, 4), "eager_ms": round(self.eager_ms, 4),
                "parity": {"max_abs_logit_diff": self.max_abs_logit_diff, "tokens_equal": self.tokens_equal}}


@dataclass
class Manifest:
    """A manifest, parsed once: `load_manifest` builds it with its Config and BucketPlan, so
    nothing that holds one parses its config again."""
    environment: dict
    model: dict
    config: dict
    kv_cache: dict  # block_size, num_blocks (resolved), bytes
    buffers: list
    keys: list[KeyRecord]
    totals: dict
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    trtgraph_version: str = field(default_factory=trtgraph_version)
    format_version: int = FORMAT_VERSION
    paths: dict = field(default_factory=dict)  # resolved artifact paths (after load), all inside the directory
    parallel: dict = field(default_factory=lambda: {"tensor_parallel_size": 1, "ranks": []})
    file: Path | None = None  # the manifest.json it was read from (None: built by capture)
    _config: Config | None = field(default=None, repr=False, compare=False)
    _plan: BucketPlan | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        body = {
            "format_version": self.format_version,
            "format_changelog": {str(k): v for k, v in FORMAT_CHANGELOG.items()},
            "trtgraph_version": self.trtgraph_version,
            "created": self.created,
            "environment": self.environment,
            "model": self.model,
            "config": self.config,
            "limits": self.config["limits"],
            "kv_cache": self.kv_cache,
            "buffers": self.buffers,
            "keys": [k.to_json() for k in self.keys],
            "totals": self.totals,
            "paths": {"triton_cache": TRITON_CACHE_DIR},  # relative to the artifacts directory
            "parallel": self.parallel,  # tensor-parallel size and each rank's shard
        }
        body["digest"] = _digest(body)
        return body

    def app_config(self) -> Config:
        """The config section as a Config (built at most once)."""
        if self._config is None:
            self._config = Config.from_dict(self.config, source="manifest config", check_paths=False)
        return self._config

    def plan(self) -> BucketPlan:
        """The bucket plan with exactly the recorded keys (built at most once)."""
        if self._plan is None:
            self._plan = BucketPlan.from_config(self.app_config()).with_keys(self.graph_keys)
        return self._plan

    @property
    def graph_keys(self) -> list[GraphKey]:
        return [k.key for k in self.keys]

    @property
    def capture_order(self) -> list[GraphKey]:
        return [k.key for k in sorted(self.keys, key=lambda k: k.capture_index)]


def _digest(body: dict) -> str:
    blob = json.dumps({k: v for k, v in body.items() if k != "digest"}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def write_manifest(out_dir: Path, manifest: Manifest) -> Path:
    """Atomically: write a temporary file in the same directory, fsync, rename. The file
    gets the permissions a new file gets under the umask (mkstemp's would be 0600)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MANIFEST_NAME
    text = json.dumps(manifest.to_json(), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def use_triton_cache(cache: Path) -> bool:
    """Triton compiles and autotunes into the artifacts directory, so a warm start compiles
    nothing. Returns True if this call created the directory (a failed capture removes it)."""
    cache = Path(cache)
    check_triton_cache(cache)
    created = not cache.exists()
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(cache.resolve())
    return created


def check_manifest_target(path: Path) -> None:
    """A capture replaces DIR/manifest.json: an earlier trtgraph manifest (whole or damaged) may
    go, but a manifest.json of something else (a browser extension's, a web app's) must not be
    silently overwritten. Any trtgraph manifest names `format_version` in its first bytes."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return  # unreadable: the write itself reports it
    if b'"format_version"' not in head and b'"trtgraph_version"' not in head:
        raise OutputPathError(f"{path}: exists and is not a trtgraph manifest; capturing would overwrite it. "
                              f"Choose another --out (or `output` in the config), or move the file away.")


def check_triton_cache(cache: Path) -> None:
    """The Triton cache must be a directory inside the artifacts directory: capture must not
    write a manifest whose cache a run then refuses."""
    cache = Path(cache)
    base = Path(os.path.realpath(cache.parent))
    target = Path(os.path.realpath(cache))
    if cache.is_symlink() and base not in target.parents:
        raise OutputPathError(f"{cache}: the Triton cache is a symlink to {target}, outside the artifacts "
                              f"directory {cache.parent}, where a run refuses to read it. Replace the link "
                              f"with a directory (or remove it) and capture again.")
    if cache.exists() and not cache.is_dir():
        raise OutputPathError(f"{cache}: the Triton cache must be a directory, but this is a file. Move the "
                              f"file away (the cache is recreated) and try again.")


def manifest_path(path: "str | Path | Manifest") -> Path:
    """PATH may be the artifacts directory, the manifest file itself, or a loaded Manifest."""
    if isinstance(path, Manifest):
        return path.file
    p = Path(path)
    return p / MANIFEST_NAME if p.is_dir() else p


def artifact_path(artifacts_dir: Path, relative: str) -> Path:
    """Resolve a path read from a manifest; it must stay inside the artifacts directory."""
    base = artifacts_dir.resolve()
    target = (base / relative).resolve()
    if Path(relative).is_absolute() or (target != base and base not in target.parents):
        raise ManifestError(f"{Path(artifacts_dir) / MANIFEST_NAME}: path {relative!r} leaves the artifacts "
                            f"directory; refusing to use it. Recapture to get a clean manifest.")
    return target


RECAPTURE = "Recapture with `trtgraph capture --config <your model.yaml>`."


def load_manifest(path: "str | Path | Manifest") -> Manifest:
    """Read and validate a manifest: every field (types, ranges, names) and every agreement
    between sections (keys vs the bucket plan, totals vs keys, config vs the rest). Any
    problem is a ManifestError naming the field. A Manifest already loaded is returned as it
    is: a file is read and checked once per process."""
    if isinstance(path, Manifest):
        return path
    mpath = manifest_path(path)
    body = _read_body(mpath)
    v = FieldReader(mpath, RECAPTURE)
    config = _sections(v, body)
    paths = _paths(v, mpath, body["paths"])
    keys = _keys(v, mpath, body["keys"], config)
    schema.check_totals(v, body["totals"], [k.pool_bytes for k in keys])
    unknown = [n for n in body["totals"].get("warmup_keys") or () if n not in {str(k.key) for k in keys}]
    if unknown:  # inspect (and inspect --check) passed it; only a run's start refused it
        raise ManifestError(f"{mpath}: totals.warmup_keys names {unknown[0]!r}, which is not one of the manifest's "
                            f"keys. {RECAPTURE}")
    schema.check_parallel(v, body["parallel"], config)
    manifest = Manifest(environment=body["environment"], model=body["model"], config=body["config"],
                        kv_cache=body["kv_cache"], buffers=body["buffers"], keys=keys, totals=body["totals"],
                        created=body["created"], trtgraph_version=body["trtgraph_version"],
                        format_version=body["format_version"], paths=paths, parallel=body["parallel"],
                        file=mpath, _config=config)
    misses = uncovered_shapes(manifest.plan())
    if misses:
        raise ManifestError(f"{mpath}: recorded keys do not cover {'; '.join(misses)}. {RECAPTURE}")
    remember_file_hashes(manifest)
    return manifest


def _sections(v: FieldReader, body: dict) -> Config:
    """The header, environment, config, model, KV cache and buffer sections, each checked
    alone and against the config; returns the config."""
    schema.check_header(v, body)
    schema.check_environment(v, body["environment"])
    config = schema.config_section(v, body["config"])
    if body["limits"] != body["config"].get("limits"):  # (a config without limits is valid: defaults)
        v.fail("limits", body["limits"], "the same as config.limits")
    schema.check_model(v, body["model"], config)
    schema.check_kv_cache(v, body["kv_cache"], config)
    schema.check_buffers(v, body["buffers"])
    return config


def _read_body(mpath: Path) -> dict:
    """The manifest's JSON object, of a version this trtgraph reads, with a matching digest."""
    if not mpath.is_file():
        raise ManifestError(f"{mpath}: no manifest here. Run `trtgraph capture` first, or pass the "
                            f"artifacts directory it wrote.")
    try:
        body = loads_json(read_bounded(mpath, MAX_MANIFEST_BYTES).decode("utf-8"), allow_nonfinite=False)
    except (JSONProblem, UnicodeDecodeError) as exc:
        raise ManifestError(schema.foreign_file(mpath, None) or
                            f"{mpath}: not valid JSON ({exc}); the file may be truncated. {RECAPTURE}") from None
    except (OSError, InputTooLarge) as exc:
        raise ManifestError(f"{mpath}: cannot read the manifest ({getattr(exc, 'strerror', None) or exc}). "
                            f"{RECAPTURE}") from None
    if not isinstance(body, dict):
        raise ManifestError(f"{mpath}: expected a JSON object. {RECAPTURE}")
    if schema.foreign_file(mpath, body):
        raise ManifestError(schema.foreign_file(mpath, body))
    version = body.get("format_version")
    if not is_int(version) or version not in FORMAT_CHANGELOG:  # every version is still read
        known = ", ".join(f"{k} ({v.split(':')[0]})" for k, v in FORMAT_CHANGELOG.items())
        raise ManifestError(f"{mpath}: format_version {short(version)} is not one this trtgraph "
                            f"{trtgraph_version()} reads (known: {known}). {RECAPTURE}")
    if body.get("digest") != _digest(body):
        raise ManifestError(f"{mpath}: the manifest was edited after capture (its digest does not match "
                            f"its content). Its numbers and keys can no longer be trusted. {RECAPTURE}")
    return body


def _paths(v: FieldReader, mpath: Path, raw) -> dict[str, Path]:
    """Artifact paths, resolved; each must stay inside the artifacts directory."""
    if not isinstance(raw, dict) or set(raw) != {"triton_cache"}:
        v.fail("paths", raw, "an object with triton_cache, a path relative to the artifacts directory")
    paths = {}
    for name, rel in raw.items():
        if path_problem(rel):
            v.fail(f"paths.{name}", rel, f"a path relative to the artifacts directory: {path_problem(rel)}")
        paths[name] = artifact_path(mpath.parent, rel)
        if os.path.realpath(paths[name]) in (os.path.realpath(mpath), os.path.realpath(mpath.parent)):
            # a run told to "move the file away" would have moved the manifest
            v.fail(f"paths.{name}", rel, "a directory of its own inside the artifacts directory (not the manifest, "
                                         "not the artifacts directory itself)")
    return paths


def _keys(v: FieldReader, mpath: Path, raw, config: Config) -> list[KeyRecord]:
    """The key records: each valid, none twice, exactly the config's bucket plan, and the
    capture order a permutation."""
    if not isinstance(raw, list):
        v.fail("keys", raw, "a JSON list")
    keys = [KeyRecord(**schema.key_record_fields(v, i, rk)) for i, rk in enumerate(raw)]
    if len({k.key for k in keys}) != len(keys):
        raise ManifestError(f"{mpath}: keys lists a graph key twice. {RECAPTURE}")
    expected = set(BucketPlan.from_config(config).keys)
    got = {k.key for k in keys}
    if got != expected:
        extra = ", ".join(str(k) for k in sorted(got - expected)) or "none"
        missing = ", ".join(str(k) for k in sorted(expected - got)) or "none"
        raise ManifestError(f"{mpath}: keys do not match the manifest's bucket plan (not in the plan: {extra}; "
                            f"missing: {missing}). {RECAPTURE}")
    if sorted(k.capture_index for k in keys) != list(range(len(keys))):
        raise ManifestError(f"{mpath}: keys' capture_index values are not 0..{len(keys) - 1}. {RECAPTURE}")
    return keys


# Checkpoint files a loaded manifest vouches for: (name, bytes, mtime_ns) -> sha256. A start
# whose files still have the recorded size and modification time uses the recorded sha256
# instead of hashing gigabytes again; `inspect --check` always hashes in full.
_RECORDED_SHA256: dict[tuple[str, int, int], str] = {}


def remember_file_hashes(manifest: Manifest) -> None:
    for group in ("weight_files", "files"):
        for w in manifest.model.get(group, []):
            if "mtime_ns" in w:
                _RECORDED_SHA256[(w["name"], w["bytes"], w["mtime_ns"])] = w["sha256"]


def recorded_sha256(name: str, size: int, mtime_ns: int) -> str | None:
    """The sha256 a loaded manifest recorded for a file of this name, size and time, if any."""
    return _RECORDED_SHA256.get((name, size, mtime_ns))


def compare_environment(manifest: Manifest, env: dict) -> list[tuple[str, object, object]]:
    """Fields that differ between the manifest's environment and this one: (field, manifest, here)."""
    fields = ("backend", "device_name", "capability", "torch", "cuda", "triton")
    out = [(f"environment.{f}", manifest.environment.get(f), env.get(f)) for f in fields
           if manifest.environment.get(f) != env.get(f)]
    if manifest.trtgraph_version != trtgraph_version():
        out.insert(0, ("trtgraph_version", manifest.trtgraph_version, trtgraph_version()))
    return out


def compare_model(manifest: Manifest, fingerprint: dict) -> list[tuple[str, object, object]]:
    """Fields that differ between the manifest's model fingerprint and the model found now."""
    out = []
    for f in ("source", "architecture", "config_hash", "dtype", "parameter_count", "seed"):
        if manifest.model.get(f) != fingerprint.get(f):
            out.append((f"model.{f}", manifest.model.get(f), fingerprint.get(f)))
    for group in ("weight_files", "files"):  # the weights, then config, tokenizer and template files
        old = {w["name"]: w for w in manifest.model.get(group, []) if isinstance(w, dict)}
        new = {w["name"]: w for w in fingerprint.get(group, [])}
        for name in sorted(set(old) | set(new)):
            a, b = old.get(name), new.get(name)
            if a is None or b is None:
                out.append((f"model.{group}[{name}]", "present" if a else "absent", "present" if b else "absent"))
            elif (a.get("bytes"), a.get("sha256")) != (b["bytes"], b["sha256"]):
                out.append((f"model.{group}[{name}].sha256", a.get("sha256"), b["sha256"]))
    return out
