"""Tokenizers: a checkpoint's tokenizer.json through `tokenizers`, with the settings of its
tokenizer_config.json applied as transformers applies them, or a byte-level one for
synthetic models (ids 0-255 are bytes; ids above are specials or unused).

Encoding `prompt` text gives the ids `transformers.AutoTokenizer(text)` gives (the pipeline it
picks by tokenizer_class, config.json's model_type and a byte-level vocabulary): BOS/EOS as
tokenizer.json's post-processor adds them (transformers 5 ignores tokenizer_config.json's
`add_bos_token` / `add_eos_token` when there is a tokenizer.json, and so do we; real
checkpoints write the same choice in both), added and special tokens matched in the text.
Decoding skips special tokens. `StreamDecoder` turns ids into text
chunks as they arrive without ever splitting a UTF-8 character across chunks.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from ..errors import ConfigError, WeightLoadError
from .chat import read_tokenizer_config

BYTE_VOCAB_SIZE = 256  # the byte-level tokenizer's ids: one per byte value


class ByteTokenizer:
    """UTF-8 bytes as token ids. Decoding skips ids that are not bytes."""

    def __init__(self, vocab_size: int, bos_token_id: int | None = None):
        if vocab_size < BYTE_VOCAB_SIZE:
            raise WeightLoadError(f"a synthetic model needs vocab_size >= {BYTE_VOCAB_SIZE} for its byte-level "
                                  f"tokenizer; got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    max_token_chars = 1  # a byte covers at most one character

    def token_bytes(self, token_id: int) -> bytes:
        """The byte a token stands for (none for the ids past the bytes, which decode skips)."""
        return bytes([token_id]) if 0 <= token_id < BYTE_VOCAB_SIZE else b""


class HFTokenizer:
    """A checkpoint's tokenizer.json (fast tokenizer format) plus its tokenizer_config.json."""

    def __init__(self, path: Path, tok_config: dict | None = None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises its own exception type
            raise WeightLoadError(f"{path}: cannot read the tokenizer ({exc}).") from None
        config = tok_config if tok_config is not None else read_tokenizer_config(path.parent)
        cls = config.get("tokenizer_class")
        if cls is not None and not isinstance(cls, str):  # a list or object: unhashable, and no class
            raise WeightLoadError(f"{path.parent / 'tokenizer_config.json'}: tokenizer_class = {str(cls)[:60]!r}; "
                                  f"expected a tokenizer class name (a string). Fix or remove the field.")
        rebuild = CLASS_PIPELINES.get(pipeline_class(cls, _model_type(path.parent), _is_byte_level(path)))
        if rebuild is not None:
            rebuild(self._tok, config)
        # transformers skips this clean-up for BPE models; others (WordPiece, ...) get it
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and \
            type(self._tok.model).__name__ != "BPE"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of (normalized) text one token can cover, where that is bounded: a
        BPE model over bytes (a ByteLevel pre-tokenizer, or byte fallback), whose every character
        becomes one or more byte symbols, so no token covers more characters than its vocabulary
        string is long (a `<0xNN>` piece covers less than it spells); added tokens count too.
        None for the rest (an unknown token can stand for a run of characters)."""
        import json

        spec = self._spec
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or not (model.get("byte_fallback") or "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))):
            return None
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        return _clean_up(text) if self._clean_up else text

    @functools.cached_property
    def _spec(self) -> dict:
        """tokenizer.json as the library holds it (model, pre-tokenizer, decoder)."""
        import json

        return json.loads(self._tok.to_str())

    @functools.cached_property
    def _byte_form(self) -> str | None:
        """How a BPE model's vocabulary spells bytes: "byte-level" (GPT-2's alphabet, a ByteLevel
        decoder: Llama-3, Qwen), "byte-fallback" (`<0xNN>` pieces and ▁ for a space: Llama-2,
        Mistral); None for any other model."""
        import json

        spec = self._spec
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            return None
        if "ByteLevel" in json.dumps(spec.get("decoder")):
            return "byte-level"
        return "byte-fallback" if model.get("byte_fallback") else None

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for (OpenAI's log-probability `bytes`): for a token that is
        part of a character, that part, where decoding it alone gives U+FFFD. Special tokens stand
        for none (decode skips them). None where the model does not spell bytes (then the UTF-8 of
        the token's text is all there is)."""
        form, piece = self._byte_form, self._tok.id_to_token(token_id)
        if form is None or piece is None:
            return None
        if token_id in self._special_ids:
            return b""
        if form == "byte-level":
            table = _byte_level_alphabet()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")  # an added token written as plain text
        hexed = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return bytes([int(hexed.group(1), 16)]) if hexed else piece.replace("\u2581", " ").encode("utf-8")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable Latin-1 bytes stand for
    themselves, every other byte (controls, space, 0x7F-0xA0, 0xAD) for a character from U+0100 on,
    in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(0x100 + i): b for i, b in enumerate(moved)}}


class StreamDecoder:
    """Incremental detokenization: `push(new_ids)` returns the text those ids complete.

    Decodes a short window (as vLLM does) so that tokenizers whose decoders look at
    neighbours (SentencePiece's leading space, byte fallback) decode as the whole would.
    Text that ends in an incomplete UTF-8 character is held back until the character is
    complete; `flush()` returns whatever is left. The chunks joined equal `decode(ids)`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here have been emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):]


def _as_llama_tokenizer(tok, config: dict) -> None:
    """transformers 5 builds a checkpoint that names LlamaTokenizer (Llama-2, Mistral) with its
    own pipeline over tokenizer.json's vocabulary: no normalizer, a Metaspace pre-tokenizer
    (▁ prepended to the first word unless `legacy`), and a decoder that strips that space."""
    from tokenizers import decoders, pre_tokenizers

    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = "never" if not add_prefix_space else ("always" if config.get("legacy", False) else "first")
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)


QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _as_qwen2_tokenizer(tok, config: dict) -> None:
    """transformers 5's Qwen2Tokenizer (Qwen2, Qwen2.5, Qwen3): NFC, Qwen's split, byte level."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False)])
    tok.decoder = decoders.ByteLevel()


def _as_code_llama_tokenizer(tok, config: dict) -> None:
    """transformers 5's CodeLlamaTokenizer: Llama's Metaspace (▁ before the first word unless
    add_prefix_space is false; `legacy` not read), no normalizer, a decoder that strips that space."""
    from tokenizers import decoders, pre_tokenizers

    add_prefix_space = config.get("add_prefix_space")
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never" if add_prefix_space is False
                                                 else "first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])


# Classes whose tokenization transformers 5 rebuilds over tokenizer.json's vocabulary and
# merges (the post-processor and added tokens stay). Other classes use tokenizer.json as is.
CLASS_PIPELINES = {"LlamaTokenizer": _as_llama_tokenizer, "Qwen2Tokenizer": _as_qwen2_tokenizer,
                   "CodeLlamaTokenizer": _as_code_llama_tokenizer}
# What transformers 5 registers per model type (of those trtgraph runs), and the model types whose
# declared tokenizer_class it overrides with that registered one.
MODEL_TYPE_TOKENIZERS = {"qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer", "qwen2_moe": "Qwen2Tokenizer",
                         "qwen3_moe": "Qwen2Tokenizer", "mistral": "TokenizersBackend", "mixtral": "TokenizersBackend"}
OVERRIDDEN_MODEL_TYPES = frozenset({"qwen2", "phi3"})
AS_IS = frozenset({"TokenizersBackend", "PythonBackend", "PreTrainedTokenizer"})


def pipeline_class(declared, model_type: str | None, byte_level: bool) -> str | None:
    """The class whose pipeline transformers 5's AutoTokenizer builds for a checkpoint (its rules for
    these model types): tokenizer_class `declared` (without "Fast"), but LlamaTokenizer over a
    byte-level tokenizer.json as is; where the model type registers another class, that one for
    qwen2, else the declared one if transformers has a pipeline of its own for it, else as is.
    None: tokenizer.json as is."""
    base = declared.removesuffix("Fast") if isinstance(declared, str) else None
    if base == "LlamaTokenizer" and byte_level and model_type not in OVERRIDDEN_MODEL_TYPES:
        return None
    registered = MODEL_TYPE_TOKENIZERS.get(model_type)
    if base is None:
        return registered
    if registered is not None and registered != base:
        if registered in AS_IS:
            return None
        return registered if model_type in OVERRIDDEN_MODEL_TYPES else base
    return base


def _model_type(ckpt: Path) -> str | None:
    """config.json's model_type beside the tokenizer (None without one; read as every checkpoint
    JSON file is: a bad file is a WeightLoadError naming it)."""
    from .jsonfiles import read_json

    config = read_json(ckpt / "config.json") if (ckpt / "config.json").is_file() else None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def _is_byte_level(path: Path) -> bool:
    """tokenizer.json names a ByteLevel pre-tokenizer or decoder (transformers' own test)."""
    return '"ByteLevel"' in path.read_text(encoding="utf-8", errors="replace")


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (for WordPiece-style vocabularies)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def check_vocab_covers_tokenizer(checkpoint_dir: Path | None, vocab_size: int, source: str, field: str) -> None:
    """Refuse, when the model is built, a vocabulary the tokenizer `load_tokenizer` will pick
    cannot use: the byte-level one (synthetic models, checkpoints without tokenizer.json)
    needs all 256 byte ids. Otherwise every later `run` would fail on it."""
    if checkpoint_dir is not None and (checkpoint_dir / "tokenizer.json").is_file():
        return
    _refuse_slow_tokenizer(checkpoint_dir)
    if vocab_size < BYTE_VOCAB_SIZE:
        why = "a synthetic model" if checkpoint_dir is None else f"{checkpoint_dir} has no tokenizer.json, so it"
        exc = ConfigError(f"{source}: {field} = {vocab_size} is not allowed; expected at least {BYTE_VOCAB_SIZE}: "
                          f"{why} uses the byte-level tokenizer, whose {BYTE_VOCAB_SIZE} ids must all be in the "
                          f"vocabulary.")
        exc.key_path = field
        raise exc


SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "spiece.model", "sentencepiece.bpe.model")


def _refuse_slow_tokenizer(checkpoint_dir: Path | None) -> None:
    """A checkpoint whose tokenizer is only in files `tokenizers` cannot read is refused: the
    byte-level tokenizer in its place would encode every prompt as bytes the model never saw."""
    if checkpoint_dir is None:
        return
    found = next((name for name in SLOW_TOKENIZER_FILES if (checkpoint_dir / name).is_file()), None)
    if found is not None:
        raise WeightLoadError(f"{checkpoint_dir / found}: this checkpoint's tokenizer is in {found}, which trtgraph "
                              f"does not read, and it has no tokenizer.json (the byte-level tokenizer would encode "
                              f"text the model never saw). Write tokenizer.json beside it: python -c \"from "
                              f"transformers import AutoTokenizer as T; T.from_pretrained('{checkpoint_dir}')"
                              f".save_pretrained('{checkpoint_dir}')\"")


def load_tokenizer(checkpoint_dir: Path | None, vocab_size: int, bos_token_id: int | None):
    """The checkpoint's tokenizer.json when there is one; otherwise the byte-level one."""
    if checkpoint_dir is not None and (checkpoint_dir / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint_dir / "tokenizer.json")
    _refuse_slow_tokenizer(checkpoint_dir)
    bos = bos_token_id if bos_token_id is not None and 256 <= bos_token_id < vocab_size else None
    return ByteTokenizer(vocab_size, bos)
