"""Build a CausalLM from a Hugging Face checkpoint directory or a synthetic spec.

Checkpoints: config.json plus `*.safetensors`, single or sharded through
`model.safetensors.index.json`. HF names are mapped onto the fused layout (q/k/v -> qkv,
gate/up -> gate_up) at load. Missing, unexpected or mis-shaped tensors raise
WeightLoadError listing every culprit. Only JSON and safetensors are read: nothing in a
checkpoint can execute code.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .. import startup
from ..config import DTYPE_NAMES, ModelSource
from ..errors import WeightLoadError
from ..inputs import InputTooLarge, JSONProblem, is_int, loads_json, read_bounded, short, text_problem
from ..kernels import KernelSet
from .config import GenerationDefaults, ModelConfig, synthetic_model_config
from .hub import checkpoint_dir, hub_record
from .llama import CausalLM
from .parallel import TPGroup, check_divisible, copy_padded, part_slice, take
from .tokenizer import check_vocab_covers_tokenizer

# the torch dtype of each name a config may give (the names live once, in config.DTYPE_NAMES)
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# safetensors dtype codes of the integer and boolean kinds, by torch name (for messages)
_ST_DTYPES = {"I8": "torch.int8", "I16": "torch.int16", "I32": "torch.int32", "I64": "torch.int64",
              "U8": "torch.uint8", "U16": "torch.uint16", "U32": "torch.uint32", "U64": "torch.uint64",
              "BOOL": "torch.bool"}
MAX_JSON_BYTES = 64 << 20  # config.json and the shard index: kilobytes to a few MiB in real checkpoints
# Tensors some checkpoints carry that hold nothing we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


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
    return GenerationDefaults.from_hf(_read_json_object(path), source=str(path))


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
    return _read_json_object(cfg_path)


def _read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, generation_config.json), bounded and strict."""
    try:
        data = loads_json(read_bounded(path, MAX_JSON_BYTES).decode("utf-8"))
    except (JSONProblem, UnicodeDecodeError, InputTooLarge, OSError) as exc:
        raise WeightLoadError(f"{path}: not valid JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise WeightLoadError(f"{path}: expected a JSON object.")
    return data


def weight_files(ckpt: Path) -> list[Path]:
    """The safetensors files of a checkpoint, through the shard index when there is one."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = loads_json(read_bounded(index, MAX_JSON_BYTES).decode("utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (JSONProblem, UnicodeDecodeError, InputTooLarge, OSError, KeyError, TypeError, AttributeError) as exc:
            raise WeightLoadError(f"{index}: not a valid shard index ({exc!r}).") from None
        bad = next((n for n in names if text_problem(n) or not n), None)
        if bad is not None:
            raise WeightLoadError(f"{index}: shard name {short(bad)} is not a file name.")
        files = []
        for name in names:
            # checked on the name, not through symlinks: a Hugging Face cache snapshot's shards are
            # links to ../../blobs/<hash>, outside the snapshot directory, and load as they do unsharded
            path = ckpt / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise WeightLoadError(f"{index}: shard {name!r} lies outside the checkpoint directory.")
            if not path.is_file():
                raise WeightLoadError(f"{index}: shard {name} is listed but missing from {ckpt}.")
            files.append(path)
        return files
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in ckpt.glob("*.bin")) + sorted(p.name for p in ckpt.glob("*.pt"))
        hint = (f" Found {', '.join(pickles)}: pickle files are never loaded (they can run code); "
                f"convert them to safetensors first.") if pickles else ""
        raise WeightLoadError(f"{ckpt}: no *.safetensors weights.{hint}")
    return files


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
    _fill_from_safetensors(model, cfg, weight_files(ckpt), ckpt, tp)
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


def _hf_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensor names concatenated (dim 0) to fill it."""
    out: dict[str, list[str]] = {"embed_tokens.weight": ["model.embed_tokens.weight"],
                                 "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out[ours + "self_attn.qkv_proj.weight"] = [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if cfg.qkv_bias:
            out[ours + "self_attn.qkv_proj.bias"] = [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
        if cfg.qk_norm:
            out[ours + "self_attn.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
            out[ours + "self_attn.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
        out[ours + "self_attn.o_proj.weight"] = [hf + "self_attn.o_proj.weight"]
        out[ours + "mlp.gate_up_proj.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        out[ours + "mlp.down_proj.weight"] = [hf + "mlp.down_proj.weight"]
        out[ours + "input_layernorm.weight"] = [hf + "input_layernorm.weight"]
        out[ours + "post_attention_layernorm.weight"] = [hf + "post_attention_layernorm.weight"]
    return out


def _open_all(files: list[Path]) -> dict[str, Path]:
    """HF tensor name -> the file holding it. Corrupt files are named; a tensor held by two
    files is refused (which copy is meant is ambiguous: never pick one silently)."""
    where: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except Exception as exc:  # safetensors raises its own error types; all mean "corrupt"
            raise WeightLoadError(f"{path}: not a readable safetensors file ({exc}). The file may be "
                                  f"truncated or corrupt; download it again.") from None
        for name in names:
            if name in where:
                raise WeightLoadError(f"{path}: tensor {name} is also in {where[name]}; a checkpoint holds each "
                                      f"tensor once. Remove the stray file (or the duplicate) from "
                                      f"{path.parent}, or download the checkpoint again.")
            where[name] = path
    return where


def _fill_from_safetensors(model: CausalLM, cfg: ModelConfig, files: list[Path], ckpt: Path,
                           tp: TPGroup = TPGroup()) -> None:
    where = _open_all(files)
    sources = _hf_sources(cfg)
    params = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        where.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    needed = {n for names in sources.values() for n in names}
    missing = sorted(n for n in needed if n not in where)
    unexpected = sorted(n for n in where if n not in needed and not _IGNORED.search(n))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_list(unexpected)}")
    if problems:
        raise WeightLoadError(f"{ckpt}: weights do not match config.json ({cfg.architecture}, "
                              f"{cfg.num_layers} layers): " + "; ".join(problems) + ".")

    full = _full_shapes(cfg)
    handles = {}
    try:
        bad = []
        for ours, hf_names in sources.items():
            want = _part_shapes(cfg, ours, full[ours], len(hf_names))
            parts, ok = [], True
            for i, (name, shape) in enumerate(zip(hf_names, want)):
                path = where[name]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt").__enter__()
                try:
                    view = handles[path].get_slice(name)
                    got_shape, got_dtype = tuple(view.get_shape()), view.get_dtype()
                    if not got_dtype.startswith(("F", "BF")):
                        shown = _ST_DTYPES.get(got_dtype, got_dtype)
                        bad.append(f"{name} has dtype {shown} (expected a floating-point dtype)")
                        ok = False
                    if got_shape != shape:
                        bad.append(f"{name} {got_shape} (expected {shape})")
                        ok = False
                    if ok:  # only this rank's slice is read from the file
                        parts.append(take(view, part_slice(cfg, tp, ours, i)))
                except WeightLoadError:
                    raise
                except Exception as exc:
                    raise WeightLoadError(f"{path}: cannot read tensor {name} ({exc}); the file may be "
                                          f"truncated or corrupt.") from None
            if ok:
                copy_padded(params[ours].data, torch.cat(parts) if len(parts) > 1 else parts[0])
        if bad:
            raise WeightLoadError(f"{ckpt}: mis-shaped or mistyped tensors: {_list(bad)}.")
        _check_finite(params, sources, where, handles)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def _check_finite(params: dict, sources: dict[str, list[str]], where: dict[str, Path], handles: dict) -> None:
    """Refuse NaN or infinite weights rather than serve garbage tokens: a corrupt file, or
    finite values past the range of the dtype they were converted to (float16's 65504). One
    fp32 sum per parameter on its device (no copy), one sync for them all."""
    names = list(sources)
    sums = torch.stack([params[n].data.sum(dtype=torch.float32) for n in names])
    bad = [n for n, ok in zip(names, torch.isfinite(sums).tolist()) if not ok]
    if not bad:
        return
    # only on this error path: which of the culprits' tensors are non-finite in the file itself
    hf_names = [h for n in bad for h in sources[n]]
    in_file = [h for h in hf_names if not torch.isfinite(handles[where[h]].get_tensor(h)).all()]
    ckpt, dtype = where[hf_names[0]].parent, params[bad[0]].dtype
    if in_file:
        raise WeightLoadError(f"{ckpt}: NaN or infinite values in {_list([f'{h} (in {where[h].name})' for h in in_file])}; "
                              f"the checkpoint is corrupt. Download it again.")
    raise WeightLoadError(f"{ckpt}: {_list(hf_names)} hold values too large for {dtype} (they become infinite); "
                          f"load this checkpoint with dtype bfloat16 or float32.")


def _full_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every parameter's shape in the unsharded model."""
    with torch.device("meta"):
        model = CausalLM(cfg, 1, ops=None)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _shard(full: torch.Tensor, cfg: ModelConfig, tp: TPGroup, ours: str, nparts: int) -> torch.Tensor:
    """This rank's part of an unsharded (fused) parameter."""
    if not tp.active:
        return full
    sizes = [shape[0] for shape in _part_shapes(cfg, ours, tuple(full.shape), nparts)]
    parts = full.split(sizes) if nparts > 1 else [full]
    return torch.cat([take(p, part_slice(cfg, tp, ours, i)) for i, p in enumerate(parts)])


def _part_shapes(cfg: ModelConfig, ours: str, shape: tuple, nparts: int) -> list[tuple]:
    """The shape each HF tensor fused into `ours` must have, in order."""
    if ours.endswith("qkv_proj.weight"):
        return [(cfg.q_size, cfg.hidden_size), (cfg.kv_size, cfg.hidden_size), (cfg.kv_size, cfg.hidden_size)]
    if ours.endswith("qkv_proj.bias"):
        return [(cfg.q_size,), (cfg.kv_size,), (cfg.kv_size,)]
    if nparts == 2:
        return [(shape[0] // 2, *shape[1:])] * 2
    return [shape]


def _list(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _synthetic_config(spec: dict, max_seq_len: int) -> tuple[int, ModelConfig]:
    return synthetic_model_config(spec, max_seq_len, source="model config")


def _load_synthetic(spec: dict, dtype: str, device: torch.device, max_seq_len: int, ops: KernelSet,
                    tp: TPGroup = TPGroup()) -> LoadedModel:
    seed, cfg = _synthetic_config(spec, max_seq_len)
    model = _empty_model(cfg, dtype, device, max_seq_len, ops, tp, source="model.synthetic")
    params, nparts = dict(model.named_parameters()), {k: len(v) for k, v in _hf_sources(cfg).items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    # Every rank draws the whole model in the same order and keeps its shard, so a sharded
    # synthetic model holds exactly the single-process weights.
    for name, shape in sorted(_full_shapes(cfg).items()):
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if "norm" in name:  # norms near 1, like a trained model's
            x = 1.0 + 0.1 * x
        else:
            x = x * (0.02 if "embed" in name or name.endswith("bias") else 1.0 / shape[-1] ** 0.5)
        copy_padded(params[name].data, _shard(x, cfg, tp, name, nparts[name]))
    startup.lap("weights_generated")  # synthetic: drawn on the device itself
    fp = model_fingerprint(ModelSource(synthetic=spec), dtype, max_seq_len)
    if not tp.active:
        assert fp["parameter_count"] == sum(p.numel() for p in model.parameters())
    return LoadedModel(model, cfg, fp, None)
