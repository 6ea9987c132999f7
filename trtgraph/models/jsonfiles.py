"""A checkpoint's JSON files (config.json, generation_config.json, tokenizer_config.json,
special_tokens_map.json, the shard index), read bounded and strict: a file past MAX_JSON_BYTES,
not UTF-8, not JSON, nested too deep for Python or holding an integer of thousands of digits is a
WeightLoadError naming it, never a RecursionError or ValueError."""

from __future__ import annotations

from pathlib import Path

from ..errors import WeightLoadError
from ..inputs import InputTooLarge, JSONProblem, loads_json, read_bounded

MAX_JSON_BYTES = 64 << 20  # kilobytes to a few MiB in real checkpoints


def read_json(path: Path):
    """The file's JSON value."""
    try:
        return loads_json(read_bounded(path, MAX_JSON_BYTES).decode("utf-8"))
    except (JSONProblem, UnicodeDecodeError, InputTooLarge, OSError) as exc:
        raise WeightLoadError(f"{path}: not valid JSON ({exc}).") from None


def read_json_object(path: Path) -> dict:
    """The file's JSON object (anything else is refused, naming the file)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise WeightLoadError(f"{path}: expected a JSON object.")
    return data
