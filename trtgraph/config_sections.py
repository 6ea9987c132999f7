"""The config's sections: model source, limits, KV cache, buckets, speculative decoding and
parallelism as frozen dataclasses, and their parsers, each a strict check that names the key
path, the value and what is allowed (`Validator`). `Config` (trtgraph/config.py) puts them
together and reads the YAML."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .fields import FieldChecker, defaults
from .inputs import is_int, path_problem, short, text_problem

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # models.DTYPES maps each to its torch dtype
DEVICES = ("auto", "cuda", "cpu")
KERNELS = ("auto", "torch", "triton")
SAMPLING_MODES = ("greedy", "sampled")
AUTO = "auto"


@dataclass(frozen=True)
class ModelSource:
    path: str | None = None  # a Hugging Face checkpoint directory
    synthetic: dict | None = None  # HF config.json fields plus `seed`; random weights
    hub: str | None = None  # a Hub repository id (org/name), resolved in the local HF cache
    revision: str | None = None  # with `hub`: a branch, tag or commit (default main)

    @property
    def is_synthetic(self) -> bool:
        return self.synthetic is not None


@dataclass(frozen=True)
class Limits:
    max_batch_size: int = 64
    # "auto": the model's max_position_embeddings, lowered to what the KV cache holds for one
    # sequence; capture resolves it (Config.with_max_seq_len) and the manifest stores the number.
    max_seq_len: int | str = AUTO
    max_num_tokens: int = 8192


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = 16
    num_blocks: int | str = AUTO  # an integer, or "auto": sized from free memory


@dataclass(frozen=True)
class BucketConfig:
    batch_sizes: tuple[int, ...] | str = AUTO
    context_batch_sizes: tuple[int, ...] | str = AUTO
    chunk_sizes: tuple[int, ...] = (64, 256, 512)
    draft_lens: tuple[int, ...] = (0,)
    sampling: tuple[str, ...] = ("greedy", "sampled")

    def generation_batch_sizes(self, max_batch_size: int) -> tuple[int, ...]:
        """`auto` is 1, 2, 4, 8, then multiples of 8, up to max_batch_size (always included)."""
        if self.batch_sizes != AUTO:
            return tuple(self.batch_sizes)
        return _ladder(max_batch_size)

    def prefill_batch_sizes(self, chunk_size: int, limits: "Limits") -> tuple[int, ...]:
        """Context batch sizes for one chunk size. `auto`: the same ladder as generation up to
        the most rows of that chunk a step may hold, min(max_batch_size, max_num_tokens // chunk),
        so a burst of prompts prefills in steps that fill max_num_tokens."""
        if self.context_batch_sizes != AUTO:
            return tuple(self.context_batch_sizes)
        return _ladder(max(1, min(limits.max_batch_size, limits.max_num_tokens // chunk_size)), small=range(1, 8))


def _ladder(most: int, small=(1, 2, 4)) -> tuple[int, ...]:
    """The `small` sizes, then multiples of 8, up to `most` (always included). A prefill row
    pads a whole chunk, so prefill steps get every size below 8."""
    sizes = [b for b in small if b < most] + list(range(8, most, 8))
    return tuple(sorted(set(sizes + [most])))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup (n-gram) speculative decoding: K drafted tokens per sequence per step."""
    method: str = "ngram"
    draft_len: int = 4
    ngram_min: int = 1
    ngram_max: int = 3


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism across the GPUs (or CPU processes) of one host."""
    tensor_parallel_size: int = 1




def section(v: "Validator", raw: Any, path: str, cls) -> dict:
    """A mapping of `cls`'s fields, the omitted ones at their dataclass defaults."""
    if dataclasses.is_dataclass(raw):  # the default_factory's value: nothing given
        return defaults(cls)
    return {**defaults(cls), **v.mapping(raw, path, {f.name for f in dataclasses.fields(cls)})}


def _listed(value: Any) -> Any:
    """A dataclass default (a tuple) as the list a YAML file would give; anything else as is."""
    return list(value) if isinstance(value, tuple) else value


def parse_limits(v: "Validator", raw: Any) -> Limits:
    lim = section(v, raw, "limits", Limits)
    max_seq_len = lim["max_seq_len"]
    if max_seq_len != AUTO:
        max_seq_len = v.integer(max_seq_len, "limits.max_seq_len", lo=2, hi=1 << 20,
                                expected="'auto' or an integer in [2, 1048576]")
    limits = Limits(max_batch_size=v.integer(lim["max_batch_size"], "limits.max_batch_size", lo=1, hi=4096),
                    max_seq_len=max_seq_len,
                    max_num_tokens=v.integer(lim["max_num_tokens"], "limits.max_num_tokens", lo=1, hi=1 << 22))
    if limits.max_num_tokens < limits.max_batch_size:
        v.fail("limits.max_num_tokens", limits.max_num_tokens,
               f"at least limits.max_batch_size ({limits.max_batch_size}): a generation step of "
               f"the largest batch needs one token per sequence")
    return limits


def parse_kv_cache(v: "Validator", raw: Any, limits: Limits) -> KVCacheConfig:
    kv = section(v, raw, "kv_cache", KVCacheConfig)
    block_size = v.integer(kv["block_size"], "kv_cache.block_size", lo=1, hi=4096)
    if block_size & (block_size - 1):
        v.fail("kv_cache.block_size", block_size, "a power of two (8, 16, 32, ...)")
    num_blocks = kv["num_blocks"]
    if num_blocks != AUTO:
        num_blocks = v.integer(num_blocks, "kv_cache.num_blocks", lo=2, hi=1 << 24,
                               expected="'auto' or an integer >= 2 (block 0 is the reserved null block)")
        blocks_per_seq = math.ceil(limits.max_seq_len / block_size) if limits.max_seq_len != AUTO else 1
        if num_blocks - 1 < blocks_per_seq:
            v.fail("kv_cache.num_blocks", num_blocks,
                   f"at least {blocks_per_seq + 1}: one sequence of limits.max_seq_len="
                   f"{limits.max_seq_len} needs {blocks_per_seq} blocks of {block_size}, plus the null block")
    return KVCacheConfig(block_size=block_size, num_blocks=num_blocks)


def parse_model(v: "Validator", raw: Any, base_dir: Path | None, max_seq_len: int | None,
                 check_paths: bool = True) -> ModelSource:
    if raw is None:
        v.fail("model", None, "a mapping with `path` (a Hugging Face checkpoint directory), `hub` (a Hub "
                              "repository id in the local cache) or `synthetic` (config.json fields plus seed)")
    if isinstance(raw, str):  # `model: ./ckpt`
        v.fail("model", raw, f"a mapping with `path`, `hub` or `synthetic`; for a checkpoint directory, "
                             f"`model: {{path: {raw}}}`")
    m = v.mapping(raw, "model", {"path", "synthetic", "hub", "revision"})
    if sum(k in m for k in ("path", "synthetic", "hub")) != 1:
        v.fail("model", sorted(m), "exactly one of `path`, `hub` or `synthetic`")
    if "revision" in m and "hub" not in m:
        v.fail("model.revision", m["revision"], "only with `hub` (a branch, tag or commit of that repository)")
    if "hub" in m:
        repo, rev = m["hub"], m.get("revision", "main")
        if not isinstance(repo, str) or not repo.strip() or any(c.isspace() for c in repo) or repo.count("/") > 1:
            v.fail("model.hub", repo, "a Hugging Face repository id such as meta-llama/Llama-3.2-1B-Instruct")
        if not isinstance(rev, str) or not rev.strip():
            v.fail("model.revision", rev, "a branch, tag or commit (string)")
        return ModelSource(hub=repo, revision=rev)
    if "path" in m:
        p = m["path"]
        if path_problem(p):
            v.fail("model.path", p, f"a checkpoint directory: {path_problem(p)}")
        path = Path(p).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if check_paths and not path.is_dir():
            state = "is not a directory" if path.exists() else "does not exist"
            v.fail("model.path", p, f"an existing checkpoint directory ({path} {state}); "
                                    f"download the checkpoint there or fix the path")
        return ModelSource(path=str(path.resolve()) if check_paths else str(path))
    syn = m["synthetic"]
    if not isinstance(syn, dict) or not syn:
        v.fail("model.synthetic", syn, "a mapping of config.json fields (architecture, hidden_size, ...)")
    for k in syn:
        if not isinstance(k, str):
            v.fail("model.synthetic", k, "string keys")
    from .models.config import check_synthetic  # here: trtgraph.models imports this module

    check_synthetic(syn, max_seq_len, source=v.source)  # every field given; the whole spec once complete
    return ModelSource(synthetic=copy.deepcopy(syn))


def parse_speculative(v: "Validator", raw: Any) -> SpeculativeConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):  # `speculative: false` meant off; `true`, on with the defaults
        v.fail("speculative", raw, "a mapping of method, draft_len, ngram_min and ngram_max (`speculative: {}` for "
                                   "their defaults); leave `speculative` out (or null) to decode without drafts")
    sp = section(v, raw, "speculative", SpeculativeConfig)
    method = v.choice(sp["method"], "speculative.method", ("ngram",))
    k = v.integer(sp["draft_len"], "speculative.draft_len", lo=1, hi=64)
    lo = v.integer(sp["ngram_min"], "speculative.ngram_min", lo=1, hi=64)
    hi = v.integer(sp["ngram_max"], "speculative.ngram_max", lo=1, hi=64)
    if hi < lo:
        v.fail("speculative.ngram_max", hi, f"at least speculative.ngram_min ({lo})")
    return SpeculativeConfig(method=method, draft_len=k, ngram_min=lo, ngram_max=hi)


def parse_buckets(v: "Validator", raw: Any, limits: Limits, speculative: SpeculativeConfig | None) -> BucketConfig:
    b = section(v, raw, "buckets", BucketConfig)
    batch_sizes = b["batch_sizes"]
    if batch_sizes != AUTO:
        batch_sizes = v.int_list(batch_sizes, "buckets.batch_sizes", lo=1, hi=limits.max_batch_size,
                                 hi_name="limits.max_batch_size")
    context = b["context_batch_sizes"]
    if context != AUTO:
        context = v.int_list(context, "buckets.context_batch_sizes", lo=1, hi=limits.max_batch_size,
                             hi_name="limits.max_batch_size")
    seq_hi = limits.max_seq_len if limits.max_seq_len != AUTO else 1 << 20  # auto: dropped when resolved
    chunks = v.int_list(_listed(b["chunk_sizes"]), "buckets.chunk_sizes",
                        lo=1, hi=seq_hi, hi_name="limits.max_seq_len")
    drafts = v.int_list(_listed(b["draft_lens"]), "buckets.draft_lens", lo=0, hi=64, hi_name="64")
    if 0 not in drafts:
        v.fail("buckets.draft_lens", list(drafts), "a list that includes 0 (plain generation steps)")
    if speculative is not None:  # verify keys (batch, K) for every generation batch size
        drafts = tuple(sorted(set(drafts) | {speculative.draft_len}))
    sampling = _listed(b["sampling"])
    if not isinstance(sampling, list) or not sampling:
        v.fail("buckets.sampling", sampling, f"a non-empty list of {list(SAMPLING_MODES)}")
    for i, s in enumerate(sampling):
        v.choice(s, f"buckets.sampling[{i}]", SAMPLING_MODES)
    if len(set(sampling)) != len(sampling):
        v.fail("buckets.sampling", sampling, "no repeated modes")
    # Every step must fit in max_num_tokens: the largest prefill step and the largest
    # generation step (with the largest draft) are both bounded by it.
    worst_ctx = max(context if context != AUTO else [1]) * max(chunks)
    if worst_ctx > limits.max_num_tokens:
        v.fail("buckets.chunk_sizes", list(chunks),
               f"max(context_batch_sizes) * max(chunk_sizes) = {worst_ctx} tokens <= limits.max_num_tokens "
               f"({limits.max_num_tokens}); lower the chunk sizes or raise max_num_tokens")
    gen_max = max(batch_sizes) if batch_sizes != AUTO else limits.max_batch_size
    worst_gen = gen_max * (1 + max(drafts))
    if worst_gen > limits.max_num_tokens:
        v.fail("buckets.draft_lens", list(drafts),
               f"largest batch * (1 + largest draft) = {worst_gen} tokens <= limits.max_num_tokens "
               f"({limits.max_num_tokens})")
    return BucketConfig(batch_sizes=batch_sizes, context_batch_sizes=context, chunk_sizes=chunks,
                        draft_lens=drafts, sampling=tuple(sampling))


class Validator(FieldChecker):
    """The config's checks: ConfigError naming the key path (Config.from_text adds its line)."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, value: Any, allowed: str):
        where = path or "<top level>"
        shown = repr(value) if value is None or isinstance(value, bool) else short(value)
        exc = ConfigError(f"{self.source}: {where} = {shown} is not allowed; expected {allowed}.")
        exc.key_path = path
        raise exc

    def mapping(self, raw: Any, path: str, allowed: set[str]) -> dict:
        if not isinstance(raw, dict):
            self.fail(path, raw, "a mapping")
        unknown = sorted(str(k) if not text_problem(k) else short(k) for k in raw if k not in allowed)
        if unknown:
            where = f"{path}." if path else ""
            exc = ConfigError(f"{self.source}: unknown key{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(where + k for k in unknown)}; valid keys"
                              f"{' under ' + path if path else ''} are: {', '.join(sorted(allowed))}.")
            exc.key_path = where + unknown[0]
            raise exc
        return raw

    def int_list(self, raw: Any, path: str, lo: int, hi: int, hi_name: str) -> tuple[int, ...]:
        if not isinstance(raw, list) or not raw:
            self.fail(path, raw, "a non-empty list of integers")
        out = []
        for i, x in enumerate(raw):
            if not is_int(x):
                self.fail(f"{path}[{i}]", x, "an integer")
            if x < lo:
                self.fail(f"{path}[{i}]", x, f"an integer >= {lo}")
            if x > hi:
                self.fail(f"{path}[{i}]", x, f"at most {hi_name} ({hi})")
            out.append(x)
        if len(set(out)) != len(out):
            self.fail(path, raw, "no repeated values")
        return tuple(sorted(out))
