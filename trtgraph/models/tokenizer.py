"""Tokenizers: a checkpoint's tokenizer.json through `tokenizers`, or a byte-level one for
synthetic models (ids 0-255 are bytes; ids above are specials or unused)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, WeightLoadError

BYTE_VOCAB_SIZE = 256  # the byte-level tokenizer's ids: one per byte value


class ByteTokenizer:
    """UTF-8 bytes as token ids. Decoding skips ids that are not bytes."""

    def __init__(self, vocab_size: int, bos_token_id: int | None = None):
        if vocab_size < BYTE_VOCAB_SIZE:
            raise WeightLoadError(f"a synthetic model needs vocab_size >= {BYTE_VOCAB_SIZE} for its byte-level "
                                  f"tokenizer; got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json (fast tokenizer format), special tokens skipped on decode."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise WeightLoadError(f"{path}: cannot read the tokenizer ({exc}).") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def check_vocab_covers_tokenizer(checkpoint_dir: Path | None, vocab_size: int, source: str, field: str) -> None:
    """Refuse, when the model is built, a vocabulary the tokenizer `load_tokenizer` will pick
    cannot use: the byte-level one (synthetic models, checkpoints without tokenizer.json)
    needs all 256 byte ids. Otherwise every later `run` would fail on it."""
    if checkpoint_dir is not None and (checkpoint_dir / "tokenizer.json").is_file():
        return
    if vocab_size < BYTE_VOCAB_SIZE:
        why = "a synthetic model" if checkpoint_dir is None else f"{checkpoint_dir} has no tokenizer.json, so it"
        exc = ConfigError(f"{source}: {field} = {vocab_size} is not allowed; expected at least {BYTE_VOCAB_SIZE}: "
                          f"{why} uses the byte-level tokenizer, whose {BYTE_VOCAB_SIZE} ids must all be in the "
                          f"vocabulary.")
        exc.key_path = field
        raise exc


def load_tokenizer(checkpoint_dir: Path | None, vocab_size: int, bos_token_id: int | None):
    """The checkpoint's tokenizer.json when there is one; otherwise the byte-level one."""
    if checkpoint_dir is not None and (checkpoint_dir / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint_dir / "tokenizer.json")
    bos = bos_token_id if bos_token_id is not None and 256 <= bos_token_id < vocab_size else None
    return ByteTokenizer(vocab_size, bos)
