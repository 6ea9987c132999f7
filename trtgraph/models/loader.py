"""Build a CausalLM from a Hugging Face checkpoint directory or a synthetic spec.

Checkpoints: config.json plus `*.safetensors`, single or sharded through
`model.safetensors.index.json`. HF names are mapped onto the fused layout (q/k/v -> qkv,
gate/up -> gate_up) at load (models/weights.py: which files, which tensors, every check on
them). Missing, unexpected, duplicated, mis-shaped or non-finite tensors raise WeightLoadError
listing every culprit. Only JSON and safetensors are read: nothing in a checkpoint can execute code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import startup
from ..config import DTYPE_NAMES, ModelSource
from ..errors import WeightLoadError
from ..inputs import is_int
from ..kernels import KernelSet
from .config import GenerationDefaults, ModelConfig, synthetic_model_config
from .hub import checkpoint_dir, hub_record
from .jsonfiles import read_json_object
from .llama import CausalLM
from .parallel import TPGroup, check_divisible, copy_padded
from .tokenizer import check_vocab_covers_tokenizer
from .weights import fill_from_safetensors, full_shapes, hf_sources, shard, weight_files

# the torch dtype of each name a config may give (the names live once, in config.DTYPE_NAMES)
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# Checkpoint files besides the weights that change what is served; the manifest records
# their sizes and sha256 so a moved or edited checkpoint is caught.
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    fingerprint: dict  # for the manifest: what these weights are
    checkpoint_dir: Path | None
    generation: GenerationDefaults = GenerationDefaults()


def read_generation_config(ckpt: Path | None) -> GenerationDefaults:
    """generation_config.json's eos ids and sampling defaults (none: greedy, config.json's eos)."""
    if ckpt is None or not (ckpt / "generation_config.json").is_file():
        return GenerationDefaults()
    path = ckpt / "generation_config.json"
    return GenerationDefaults.from_hf(read_json_object(path), source=str(path))


def file_records(paths: list[Path], rehash: bool = False) -> list[dict]:
    """[{name, bytes, sha256, mtime_ns}] of checkpoint files (names without the directory).
    A file whose name, size and modification time a loaded manifest recorded keeps the
    recorded sha256 (unless `rehash`): a start does not read gigabytes to hash them again."""
    from ..artifacts import recorded_sha256

    out = []
    for p in paths:
        st = p.stat()
        sha = None if rehash else recorded_sha256(p.name, st.st_size, st.st_mtime_ns)
        out.append({"name": p.name, "bytes": st.st_size, "sha256": sha or file_sha256(p), "mtime_ns": st.st_mtime_ns})
    return out


def load_model(source, dtype: str, device: torch.device, max_seq_len: int, ops: KernelSet,
               tp: TPGroup = TPGroup()) -> LoadedModel:
    """`source` is a config.ModelSource. With tensor parallelism, this rank's shard only."""
    startup.lap("checks_and_kernels")  # what the engine did before the weights
    if source.is_synthetic:
        return _load_synthetic(source.synthetic, dtype, device, max_seq_len, ops, tp)
    loaded = load_checkpoint(checkpoint_dir(source), dtype, device, max_seq_len, ops, tp)
    loaded.fingerprint.update(hub_record(source, loaded.checkpoint_dir))
    return loaded


def model_fingerprint(source, dtype: str, max_seq_len: int, rehash: bool = False) -> dict:
    """What the weights are, without loading them: config hash, parameter count, and for a
    checkpoint each weight file's size and sha256 (`rehash`: hashed even where a loaded
    manifest recorded the same size and time)."""
    if source.is_synthetic:
        seed, cfg = _synthetic_config(source.synthetic, max_seq_len)
        return {"source": "synthetic", "architecture": cfg.architecture, "config_hash": cfg.fingerprint(),
                "dtype": dtype, "parameter_count": cfg.parameter_count(), "seed": seed, "weight_files": []}
    ckpt = checkpoint_dir(source)
    if not ckpt.is_dir():
        raise WeightLoadError(f"{ckpt}: checkpoint directory does not exist.")
    cfg = ModelConfig.from_hf(read_hf_config(ckpt), source=str(ckpt / "config.json"), max_seq_len=max_seq_len)
    files = weight_files(ckpt)
    meta = [ckpt / n for n in METADATA_FILES if (ckpt / n).is_file()]
    return {"source": "checkpoint", "architecture": cfg.architecture, "config_hash": cfg.fingerprint(),
            "dtype": dtype, "parameter_count": cfg.parameter_count(),
            "weight_files": file_records(files, rehash), "files": file_records(meta, rehash),
            "generation_config": read_generation_config(ckpt).to_json(), **hub_record(source, ckpt)}


def position_limit(source) -> tuple[int, str]:
    """The longest sequence the model may run, and why: its max_position_embeddings, or a
    shorter sliding window (not implemented, so never crossed). Reads config.json only."""
    if source.is_synthetic:
        hf = {"max_position_embeddings": 4096, **source.synthetic}
        where = "model.synthetic"
    else:
        ckpt = checkpoint_dir(source)
        hf, where = read_hf_config(ckpt), str(ckpt / "config.json")
    limit = hf.get("max_position_embeddings", 4096)
    if not is_int(limit) or limit < 2:
        raise WeightLoadError(f"{where}: max_position_embeddings = {limit!r}; expected an integer >= 2.")
    reason = f"max_position_embeddings of {where}"
    archs = hf.get("architectures")  # any type: ModelConfig.from_hf names a wrong one
    arch = archs[0] if isinstance(archs, list) and archs else hf.get("architecture")
    window = hf.get("sliding_window")
    if isinstance(window, int) and (arch == "MistralForCausalLM" or hf.get("use_sliding_window")) and window < limit:
        limit, reason = window, f"sliding_window of {where} (sliding-window attention is not implemented)"
    return limit, reason


def model_config(source) -> ModelConfig:
    """The ModelConfig of a source, from its config alone (no weights read)."""
    limit = position_limit(source)[0]
    if source.is_synthetic:
        return _synthetic_config(source.synthetic, limit)[1]
    ckpt = checkpoint_dir(source)
    return ModelConfig.from_hf(read_hf_config(ckpt), source=str(ckpt / "config.json"), max_seq_len=limit)


def read_hf_config(ckpt: Path) -> dict:
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise WeightLoadError(f"{ckpt}: no config.json. A Hugging Face checkpoint directory holds "
                              f"config.json and *.safetensors; point model.path at one.")
    return read_json_object(cfg_path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def load_checkpoint(ckpt: Path, dtype: str, device: torch.device, max_seq_len: int, ops: KernelSet,
                    tp: TPGroup = TPGroup()) -> LoadedModel:
    if not ckpt.is_dir():
        raise WeightLoadError(f"{ckpt}: checkpoint directory does not exist.")
    cfg = ModelConfig.from_hf(read_hf_config(ckpt), source=str(ckpt / "config.json"), max_seq_len=max_seq_len)
    check_vocab_covers_tokenizer(ckpt, cfg.vocab_size, str(ckpt / "config.json"), "vocab_size")
    model = _empty_model(cfg, dtype, device, max_seq_len, ops, tp, source=str(ckpt / "config.json"))
    fill_from_safetensors(model, cfg, weight_files(ckpt), ckpt, tp)
    startup.lap("weights_read")
    fingerprint = model_fingerprint(ModelSource(path=str(ckpt)), dtype, max_seq_len)
    startup.lap("weights_checksum")
    return LoadedModel(model, cfg, fingerprint, ckpt, read_generation_config(ckpt))


def _empty_model(cfg: ModelConfig, dtype: str, device: torch.device, max_seq_len: int, ops: KernelSet,
                 tp: TPGroup = TPGroup(), source: str = "model") -> CausalLM:
    check_divisible(cfg, tp.world, source)
    with torch.device("meta"):
        model = CausalLM(cfg, max_seq_len, ops, tp)
    _materialize(model, device, DTYPES[dtype])
    model.init_rope()
    model.eval().requires_grad_(False)
    return model


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Uninitialised storage on `device` for a model built on the meta device: parameters in
    `dtype`, buffers (the rope table) in their own dtype. Not `Module.to_empty`: its
    empty_like on meta tensors imports torch's symbolic-shape machinery (seconds of start-up)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                              requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _synthetic_config(spec: dict, max_seq_len: int) -> tuple[int, ModelConfig]:
    return synthetic_model_config(spec, max_seq_len, source="model config")


def _load_synthetic(spec: dict, dtype: str, device: torch.device, max_seq_len: int, ops: KernelSet,
                    tp: TPGroup = TPGroup()) -> LoadedModel:
    seed, cfg = _synthetic_config(spec, max_seq_len)
    model = _empty_model(cfg, dtype, device, max_seq_len, ops, tp, source="model.synthetic")
    params, nparts = dict(model.named_parameters()), {k: len(v) for k, v in hf_sources(cfg).items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    # Every rank draws the whole model in the same order and keeps its shard, so a sharded
    # synthetic model holds exactly the single-process weights.
    for name, shape in sorted(full_shapes(cfg).items()):
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if "norm" in name:  # norms near 1, like a trained model's
            x = 1.0 + 0.1 * x
        else:
            x = x * (0.02 if "embed" in name or name.endswith("bias") else 1.0 / shape[-1] ** 0.5)
        copy_padded(params[name].data, shard(x, cfg, tp, name, nparts[name]))
    startup.lap("weights_generated")  # synthetic: drawn on the device itself
    fp = model_fingerprint(ModelSource(synthetic=spec), dtype, max_seq_len)
    if not tp.active:
        assert fp["parameter_count"] == sum(p.numel() for p in model.parameters())
    return LoadedModel(model, cfg, fp, None)
