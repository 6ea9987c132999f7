"""model.yaml -> frozen dataclasses, with strict validation.

Every error names the key path (`limits.max_batch_size`), the value, what is allowed,
and where the YAML came from (file and line when known). Unknown keys are errors that
list the valid ones. The sections and their checks are trtgraph/config_sections.py; this
module is the top level: reading the YAML, `Config` and its serialisation. The embedded
default (`trtgraph/default.yaml`) is a tiny synthetic Llama that captures and runs in
seconds on a CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .config_sections import (AUTO, DEVICES, DTYPE_NAMES, KERNELS, SAMPLING_MODES,  # noqa: F401 (importers' names)
                              BucketConfig, KVCacheConfig, Limits, ModelSource, ParallelConfig, SpeculativeConfig,
                              parse_buckets, parse_kv_cache, parse_limits, parse_model, parse_speculative,
                              Validator, section)
from .errors import ConfigError, WeightLoadError
from .fields import defaults
from .inputs import (MAX_CONFIG_BYTES, InputTooLarge, key_lines, load_yaml, path_problem, read_bounded,
                     yaml_error_message)


@dataclass(frozen=True)
class Config:
    model: ModelSource
    dtype: str = "bfloat16"
    device: str = AUTO
    kernels: str = AUTO  # auto: Triton on CUDA, the torch references on a CPU
    deterministic: bool = False  # true: batch-invariant GEMMs, a row's tokens do not depend on its crowd
    limits: Limits = field(default_factory=Limits)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)
    output: str = "trtgraph-artifacts"
    speculative: SpeculativeConfig | None = None  # off when absent
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    source: str = "<dict>"  # where it was read from, for messages

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path, for_capture: bool = False) -> "Config":
        """for_capture: also check what a capture would otherwise find only once it builds the
        model or starts its ranks (`_check_model`), with the file and line (the CLI's configs)."""
        path = Path(path)
        if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO, `<(...)`, a device: it exists, so not "no such file"
            raise ConfigError(f"{path}: cannot read the config file (not a regular file); write the config to a "
                              f"file and pass that to --config.")
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file. Pass an existing YAML file to "
                              f"--config, or leave --config out to use the embedded default.")
        try:
            data = read_bounded(path, MAX_CONFIG_BYTES)
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line, column = data.count(b"\n", 0, exc.start) + 1, exc.start - data.rfind(b"\n", 0, exc.start) - 1
            raise ConfigError(f"{path} line {line}: not valid UTF-8 (byte {column} of the line); save the file as "
                              f"UTF-8.") from None
        except (OSError, InputTooLarge) as exc:
            raise ConfigError(f"{path}: cannot read the config file ({exc}).") from None
        return cls.from_text(text, source=str(path), base_dir=path.parent, for_capture=for_capture)

    @classmethod
    def from_text(cls, text: str, source: str, base_dir: Path | None = None, for_capture: bool = False) -> "Config":
        try:
            data, root = load_yaml(text)
        except yaml.YAMLError as exc:
            raise ConfigError(yaml_error_message(exc, text, source)) from None
        if data is None:
            data = {}
        lines = key_lines(root)
        try:
            config = cls.from_dict(data, source=source, base_dir=base_dir)
            if for_capture:
                _check_model(config)
            return config
        except ConfigError as exc:
            key_path = getattr(exc, "key_path", None)
            if key_path and key_path in lines:
                raise ConfigError(str(exc).replace(f"{source}: ", f"{source} line {lines[key_path]}: ", 1)) from None
            raise

    @classmethod
    def default(cls) -> "Config":
        text = resources.files("trtgraph").joinpath("default.yaml").read_text(encoding="utf-8")
        return cls.from_text(text, source="<embedded default>")

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>", base_dir: Path | None = None,
                  check_paths: bool = True) -> "Config":
        """check_paths=False: a manifest's config, whose checkpoint may have moved since
        (the runtime says so, and `run --model` names the new place)."""
        v = Validator(source)
        top = {**defaults(cls), **v.mapping(data, "", {"model", "dtype", "device", "kernels", "deterministic",
                                                     "limits", "kv_cache", "buckets", "output", "speculative",
                                                     "parallel"})}
        dtype = v.choice(top["dtype"], "dtype", DTYPE_NAMES)
        device = v.choice(top["device"], "device", DEVICES)
        kernels = v.choice(top["kernels"], "kernels", KERNELS)
        deterministic = v.flag(top["deterministic"], "deterministic",
                               expected="true (batch-invariant GEMMs) or false (the fastest GEMM per shape)")
        limits = parse_limits(v, top["limits"])
        model = parse_model(v, top.get("model"), base_dir,
                             None if limits.max_seq_len == AUTO else limits.max_seq_len, check_paths)

        kv_cache = parse_kv_cache(v, top["kv_cache"], limits)
        par = section(v, top["parallel"], "parallel", ParallelConfig)
        parallel = ParallelConfig(v.integer(par["tensor_parallel_size"], "parallel.tensor_parallel_size", lo=1, hi=64))
        speculative = parse_speculative(v, top["speculative"])
        buckets = parse_buckets(v, top["buckets"], limits, speculative)
        output = top["output"]
        if path_problem(output):
            v.fail("output", output, f"a directory: {path_problem(output)}")
        if output.startswith("~"):  # as model.path: `~/art` is the home directory's, never a directory named ~
            output = str(Path(output).expanduser())
        return cls(model=model, dtype=dtype, device=device, kernels=kernels, deterministic=deterministic,
                   limits=limits, kv_cache=kv_cache, buckets=buckets, output=output, speculative=speculative,
                   parallel=parallel, source=source)

    # ---- serialisation (the manifest stores the resolved config) ------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        model = {k: v for k, v in d.pop("model").items() if v is not None}
        b = d["buckets"]
        for k in ("chunk_sizes", "draft_lens", "sampling"):
            b[k] = list(b[k])
        for k in ("batch_sizes", "context_batch_sizes"):
            if b[k] != AUTO:
                b[k] = list(b[k])
        if d["speculative"] is None:
            del d["speculative"]
        return {"model": model, **d}

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def with_max_seq_len(self, max_seq_len: int) -> "Config":
        """`limits.max_seq_len: auto` resolved: the number, and chunk sizes above it dropped
        from the plan (the smallest chunk kept is max_seq_len itself when none fits)."""
        d = self.to_dict()
        d["limits"]["max_seq_len"] = max_seq_len
        d["buckets"]["chunk_sizes"] = [c for c in d["buckets"]["chunk_sizes"] if c <= max_seq_len] or [max_seq_len]
        return Config.from_dict(d, source=self.source)


def _check_model(config: Config) -> None:
    """What a capture would otherwise find only once it builds the model, or once it has started
    its ranks: a synthetic spec without a required field, a tensor-parallel size that does not
    divide the model's heads (a checkpoint's config.json is read for it). A config read for
    anything else may hold a partial spec (a capture refuses it when it builds the model)."""
    world = config.parallel.tensor_parallel_size
    if config.model.is_synthetic:
        from .models.config import synthetic_model_config

        max_seq_len = None if config.limits.max_seq_len == AUTO else config.limits.max_seq_len
        model = synthetic_model_config(config.model.synthetic, max_seq_len, source=config.source)[1]
    elif world > 1:
        from .models.loader import model_config

        model = model_config(config.model)
    else:
        return
    if world > 1:
        from .models.parallel import check_divisible

        try:
            check_divisible(model, world, config.source)
        except WeightLoadError as exc:
            err = ConfigError(str(exc))
            err.key_path = "parallel.tensor_parallel_size"
            raise err from None
