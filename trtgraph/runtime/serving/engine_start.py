"""The engine's start-up: what was built here checked against the manifest (model, buffer
layout, kernel choices), the warm-up and the re-record of exactly the manifest's keys, and
the messages that refuse a manifest that does not match this machine."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ... import startup
from ...artifacts import Manifest, load_manifest, manifest_path, use_triton_cache
from ...errors import ManifestError
from ...models.parallel import TPGroup
from ..distributed import agree
from .. import triton_key
from ..warmup import FirstLoads
from ..step.checks import check_manifest
from ..step.executor import Executor, resolve_device

# Re-recorded graphs may take a little more or less pool than at capture (allocator
# rounding, library versions); more than this means the plan or the machine changed.
POOL_TOLERANCE_FRACTION = 0.10
POOL_TOLERANCE_BYTES = 32 << 20


def open_manifest(path: str | Path | Manifest, tp: TPGroup, model: str | Path | None):
    """The manifest at `path`, checked against this process (its rank count, the ranks'
    agreement, this machine and library versions; not the weights yet), with the app config
    it records (its checkpoint moved to `model` if given) and the device to build on; its
    Triton cache in use from here on."""
    manifest = load_manifest(path)
    mpath = manifest_path(path)
    captured_tp = manifest.parallel.get("tensor_parallel_size", 1)
    if captured_tp != tp.world:
        raise ManifestError(f"{mpath}: captured with tensor_parallel_size {captured_tp}, "
                            f"loaded on {tp.world} rank(s); `trtgraph run` starts the captured number itself.")
    agree(tp, "the manifest", manifest.to_json()["digest"])
    config = with_checkpoint(manifest.app_config(), mpath, model)
    device = resolve_device(config.device)
    diffs = check_manifest(manifest, device, weights=False)
    if diffs:
        raise ManifestError(mismatch_message(mpath, diffs))
    use_triton_cache(manifest.paths["triton_cache"])
    return manifest, config, device


def check_built(manifest: Manifest, ex: Executor, mpath: Path):
    """The model and the buffer layout built here are the ones the manifest recorded."""
    model_diffs = _model_differences(manifest, ex.loaded.fingerprint)
    if model_diffs:
        raise ManifestError(mismatch_message(mpath, model_diffs))
    if ex.buffers.layout() != manifest.buffers:
        raise ManifestError(f"{mpath}: the persistent buffer layout built here differs "
                            f"from the manifest's `buffers`. Recapture on this machine.")
    check_kernel_choices(manifest, ex, mpath)


def check_kernel_choices(manifest: Manifest, ex: Executor, mpath: Path) -> None:
    """The GEMM backends and fused-or-composed ops chosen here are the ones the capture chose
    and verified (the graphs re-recorded here replay exactly that choice)."""
    if ex.model.ops.name != "triton":
        return
    from ...kernels.decode_linear import installed_choice
    from ...kernels.linear import installed_backends

    why = {"linear_backends": "cuBLAS is not allowed here where the capture ran it (another device or library, "
                              "or with `deterministic` a GEMM that is not row-invariant here or a per-row record), "
                              "or the record was edited",
           "fused_ops": "the kernel tables changed since the capture"}
    for field, built in (("linear_backends", installed_backends()), ("fused_ops", installed_choice())):
        recorded = manifest.totals.get(field)
        if recorded is not None and recorded != built:
            changed = sorted(k for k in set(recorded) | set(built) if recorded.get(k) != built.get(k))
            raise ManifestError(f"{mpath}: totals.{field} records another kernel choice than this build "
                                f"makes ({', '.join(changed[:4])}{', ...' if len(changed) > 4 else ''}: "
                                f"{why[field]}). Recapture on this machine.")


# ---- start-up: re-record exactly the manifest's keys ----------------------------
def record(manifest: Manifest, ex: Executor, tp: TPGroup, eager: bool) -> float:
    """Warm up the keys the capture found load every kernel and make every lazy buffer
    (`totals.warmup_keys`; every key for a manifest without it), then re-record every key in
    the capture order, refusing a start where a kernel first loads while a graph is recorded.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    order = manifest.capture_order
    if ex.device.type == "cuda":
        triton_key.remember(manifest.paths.get("triton_cache"))  # not 0.4 s of hashing Triton itself
    with torch.inference_mode():
        for key in warmup_keys(manifest):
            ex.warmup(key)
        startup.lap("warmup_triton_cache")
        if eager:
            return time.perf_counter() - t0
        pool, loads, layout = 0, FirstLoads(_first_load), ex.buffers.layout()
        loads.before()
        for i, key in enumerate(order):
            agree(tp, f"graph key {i} and the buffer layout", f"{key}|{layout}")
            if ex.metadata[key].num_tokens != key.num_tokens:
                raise ManifestError(f"{key}: token count {ex.metadata[key].num_tokens} != {key.num_tokens}")
            pool += ex.capture(key).pool_bytes
            loads.after(str(key))
    startup.lap("re_record")
    expected = int(manifest.totals.get("pool_bytes", 0))
    if abs(pool - expected) > max(POOL_TOLERANCE_FRACTION * expected, POOL_TOLERANCE_BYTES):
        raise ManifestError(f"re-recorded graphs took {pool / 2**20:.1f} MiB of pool, the manifest says "
                            f"{expected / 2**20:.1f} MiB (tolerance 10% or 32 MiB). The machine or libraries "
                            f"behave differently from capture time; recapture here.")
    ex.num_eager_steps = 0
    return time.perf_counter() - t0


def warmup_keys(manifest: Manifest) -> list:
    """The keys to run eagerly before the re-record, in the capture's warm order."""
    names = manifest.totals.get("warmup_keys")
    if names is None:  # captured before warmup_keys was recorded
        return manifest.capture_order
    by_name = {str(k): k for k in manifest.capture_order}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ManifestError(f"{manifest_path(manifest)}: totals.warmup_keys names {unknown[0]!r}, which is not one "
                            f"of the manifest's keys. Recapture on this machine.")
    return [by_name[n] for n in names]


def _first_load(key: str, count: int):
    raise ManifestError(f"{key}: recording its graph loaded {count} Triton kernel(s) that the warm-up of "
                        f"totals.warmup_keys had not (a graph must not be recorded around a first load). "
                        f"The kernels or their choice differ from the capture's; recapture on this machine.")


def with_checkpoint(config, mpath: Path, model: str | Path | None):
    """The manifest's config, with the checkpoint at `model` when given. A checkpoint directory
    that is gone is refused here, naming the field and the option that points elsewhere."""
    from ...config import ModelSource

    if model is not None:
        ckpt = Path(model).expanduser()
        if not ckpt.is_dir():
            raise ManifestError(f"--model {model}: no such checkpoint directory. Pass the directory that holds "
                                f"the checkpoint captured into {mpath}.")
        if config.model.is_synthetic:  # generated weights: nothing was read from a checkpoint
            raise ManifestError(f"--model {model}: {mpath} was captured from a synthetic model (config.model."
                                f"synthetic: weights generated from a seed), not a checkpoint; leave --model out, "
                                f"or capture the checkpoint first (`trtgraph capture --config` with model.path).")
        return config.replace(model=ModelSource(path=str(ckpt.resolve())))
    if config.model.path is not None and not Path(config.model.path).is_dir():
        raise ManifestError(f"{mpath}: config.model.path = {config.model.path} does not exist; the checkpoint "
                            f"was moved or deleted after capture. Pass its new location with `trtgraph run "
                            f"--model PATH` or `trtgraph serve --model PATH` (or LLM(..., model=PATH)); its files are checked against the "
                            f"manifest's sizes and sha256.")
    return config


def _model_differences(manifest, fingerprint: dict):
    from ...artifacts import compare_model
    from ..step.checks import Difference

    return [Difference(*d) for d in compare_model(manifest, fingerprint)]


def mismatch_message(path: Path, diffs) -> str:
    return (f"{path}: this manifest does not match this machine: " + "; ".join(str(d) for d in diffs)
            + f". Recapture here with `trtgraph capture --config <your model.yaml> --out {path.parent}`.")
