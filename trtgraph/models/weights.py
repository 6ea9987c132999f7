"""A checkpoint's safetensors weights onto a CausalLM (models/loader.py builds the model and
calls `fill_from_safetensors`): the files (`weight_files`, through the shard index when there is
one), the HF tensors that fill each fused parameter (q/k/v -> qkv, gate/up -> gate_up:
`hf_sources`, `part_shapes`), only this rank's slice of each read, and the checks on the way:
missing, unexpected, duplicated (a tensor in two files), mis-shaped, non-float and non-finite
tensors, each refused as a WeightLoadError listing every culprit."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import WeightLoadError
from ..inputs import short, text_problem
from .config import ModelConfig
from .jsonfiles import read_json
from .llama import CausalLM
from .parallel import TPGroup, copy_padded, part_slice, take

# safetensors dtype codes of the integer and boolean kinds, by torch name (for messages)
_ST_DTYPES = {"I8": "torch.int8", "I16": "torch.int16", "I32": "torch.int32", "I64": "torch.int64",
              "U8": "torch.uint8", "U16": "torch.uint16", "U32": "torch.uint32", "U64": "torch.uint64",
              "BOOL": "torch.bool"}
# Tensors some checkpoints carry that hold nothing we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def weight_files(ckpt: Path) -> list[Path]:
    """The safetensors files of a checkpoint, through the shard index when there is one."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = read_json(index)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as exc:
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


def hf_sources(cfg: ModelConfig) -> dict[str, list[str]]:
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


def open_all(files: list[Path]) -> dict[str, Path]:
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


def fill_from_safetensors(model: CausalLM, cfg: ModelConfig, files: list[Path], ckpt: Path,
                           tp: TPGroup = TPGroup()) -> None:
    where = open_all(files)
    sources = hf_sources(cfg)
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

    full = full_shapes(cfg)
    handles = {}
    try:
        bad = []
        for ours, hf_names in sources.items():
            want = part_shapes(cfg, ours, full[ours], len(hf_names))
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
        check_finite(params, sources, where, handles)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def check_finite(params: dict, sources: dict[str, list[str]], where: dict[str, Path], handles: dict) -> None:
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


def full_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every parameter's shape in the unsharded model."""
    with torch.device("meta"):
        model = CausalLM(cfg, 1, ops=None)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def shard(full: torch.Tensor, cfg: ModelConfig, tp: TPGroup, ours: str, nparts: int) -> torch.Tensor:
    """This rank's part of an unsharded (fused) parameter."""
    if not tp.active:
        return full
    sizes = [shape[0] for shape in part_shapes(cfg, ours, tuple(full.shape), nparts)]
    parts = full.split(sizes) if nparts > 1 else [full]
    return torch.cat([take(p, part_slice(cfg, tp, ours, i)) for i, p in enumerate(parts)])


def part_shapes(cfg: ModelConfig, ours: str, shape: tuple, nparts: int) -> list[tuple]:
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
