"""Reading untrusted text: bounded YAML, strict JSON, and the value checks every reader shares.

Nothing here raises a TrtgraphError itself: the readers (config, requests, manifests,
config.json) wrap a problem into their own error type, naming their file, line and field.
- `load_yaml`: `yaml.SafeLoader`, but nesting and the size after alias expansion are
  bounded before anything is built (an alias bomb, a recursive alias), and a key given
  twice in one mapping is refused with both lines (YAML itself forbids it; PyYAML keeps
  the last).
- `loads_json`: `json.loads`, but nesting past the recursion limit and (optionally) NaN,
  Infinity, floats that overflow to inf and a key given twice in one object (requests: the
  prompts file, the server's bodies) are a `JSONProblem`, never a RecursionError;
  an integer past the int-string digit limit becomes a `HugeInt`, which every field check
  refuses by name (never a ValueError mid-run).
- `int_problem` / `number_problem` / `text_problem` / `path_problem`: None when a value is fine, else the
  "expected ..." text for the caller's message. `short` is a bounded, printable repr.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import stat
from typing import Any

import yaml

MAX_YAML_DEPTH = 64  # nesting, counted through aliases
MAX_YAML_NODES = 10_000  # nodes once every alias is expanded; a model.yaml has about a hundred
MAX_CONFIG_BYTES = 1 << 20  # a model.yaml is a few hundred bytes
MAX_INT_DIGITS = 4000  # below Python's default int-string limit (4300), so the message is ours
MERGE_TAG = "tag:yaml.org,2002:merge"


# ---------------------------------------------------------------------------- values

def is_int(value: Any) -> bool:
    """A JSON/YAML integer: int but not bool (True is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not bool."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))  # isfinite(10**400) overflows


def int_problem(value: Any, lo: int, hi: int) -> str | None:
    if not is_int(value) or not lo <= value <= hi:
        return f"an integer in [{lo}, {hi}]"
    return None


def number_problem(value: Any, lo: float, hi: float, lo_open: bool = False) -> str | None:
    """A finite number in [lo, hi] (or (lo, hi] with lo_open)."""
    ok = is_number(value) and (lo < value if lo_open else lo <= value) and value <= hi
    return None if ok else f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"


def text_problem(value: Any) -> str | None:
    """Text that can be written as UTF-8: a str without lone surrogates (JSON's "\\ud800")."""
    if not isinstance(value, str):
        return "a string"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"valid Unicode text (character {exc.start} is a lone surrogate "
                f"{value[exc.start]!r}, which no UTF-8 file can hold)")
    return None


def json_problem(value: Any, path: str) -> tuple[str, Any, str] | None:
    """(where, the value there, what was expected) for the first part of `value` that JSON cannot round-trip: a key that
    is not a string, a NaN or infinite float, a type JSON lacks (a YAML date, set, bytes)."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str) or text_problem(k):
                    return where, k, "string keys (text)"
                stack.append((v, f"{where}.{k}"))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            return where, item, "a finite number"
        elif isinstance(item, str) and text_problem(item):
            return where, item, text_problem(item)
        elif item is not None and not isinstance(item, (str, int, float, bool)):
            return where, item, f"a JSON value (a string, number, true/false, null, list or mapping), not a {type(item).__name__}"
    return None


def path_problem(value: Any) -> str | None:
    """A path the OS can open: non-empty text, no NUL character, no lone surrogate."""
    if not isinstance(value, str) or not value.strip():
        return "a path (a non-empty string)"
    if "\0" in value:
        return "a path without NUL characters"
    return text_problem(value)


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 3, 60, 60, 60
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6


def short(value: Any) -> str:
    """A repr for messages: bounded in length and depth, ASCII-safe for lone surrogates,
    JSON spelling for null/true/false, and no failure on huge integers."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if is_int(value) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        return _repr.repr(value)
    except (ValueError, RecursionError):
        return f"<a {type(value).__name__}>"


# ---------------------------------------------------------------------------- files

class InputTooLarge(ValueError):
    """A file is not a regular file, or larger than any valid one of its kind."""


def read_bounded(path, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file (never a FIFO or a device such as /dev/zero, which would
    block or never end), refused past max_bytes before it is read."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # before open(): opening a FIFO blocks
        raise InputTooLarge("not a regular file")
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if max_bytes is not None and st.st_size > max_bytes:
            raise InputTooLarge(f"{st.st_size} bytes, more than the {max_bytes} any valid one needs")
        return f.read()


# ---------------------------------------------------------------------------- JSON

class JSONProblem(ValueError):
    """A text is not JSON that can be read safely; str() says why and where."""


class HugeInt:
    """Stands for a JSON integer too long to convert (Python refuses past 4300 digits), so
    the field that holds it is refused by name, like any other value of the wrong type."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str) -> int | HugeInt:
    digits = len(text.lstrip("-"))
    return HugeInt(digits) if digits > MAX_INT_DIGITS else int(text)


def _strict_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONProblem(f"the number {text[:40]} is too large for a float")
    return value


def _no_constant(name: str):
    raise JSONProblem(f"{name} is not a JSON number")


def loads_json(text: str, allow_nonfinite: bool = True, unique_keys: bool = False) -> Any:
    """json.loads with every failure a JSONProblem. allow_nonfinite=False also refuses
    NaN, Infinity and floats that overflow to inf; unique_keys=True a key given twice in one
    object (json.loads keeps the last: a request's second `temperature` would silently win)."""
    hooks = {} if allow_nonfinite else {"parse_float": _strict_float, "parse_constant": _no_constant}
    if unique_keys:
        hooks["object_pairs_hook"] = _unique_keys
    try:
        return json.loads(text, parse_int=_parse_int, **hooks)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise JSONProblem(f"{exc.msg} at {where}") from None
    except RecursionError:
        raise JSONProblem("nested too deeply: more levels of [ and { than Python can read") from None


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONProblem(f"the key {short(key)} is given twice in one object; give each field once")
            seen.add(key)
    return obj


# ---------------------------------------------------------------------------- YAML

class YAMLProblem(yaml.MarkedYAMLError):
    """Valid YAML syntax that is refused: an alias bomb, a recursive alias, a duplicate key."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer stops at MAX_YAML_DEPTH levels (it recurses per level) and
    MAX_YAML_NODES nodes, and whose integers stay within Python's digit limit."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = self._nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1
        try:
            if self._nodes > MAX_YAML_NODES:
                raise YAMLProblem(None, None, f"more than {MAX_YAML_NODES} values in one document",
                                  self.peek_event().start_mark)
            if self._depth > MAX_YAML_DEPTH:
                raise YAMLProblem(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_INT_DIGITS:  # int() would raise ValueError past Python's digit limit
            raise YAMLProblem(None, None, f"an integer with {digits} digits (at most {MAX_INT_DIGITS})",
                              node.start_mark)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def load_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """(the data, the composed root node for line lookups). Raises yaml.YAMLError (a
    YAMLProblem for refused content) with a mark; nothing is built before the checks pass."""
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None
        check_expansion(root)
        check_duplicate_keys(loader, root)
        return loader.construct_document(root), root
    finally:
        loader.dispose()


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_expansion(root: yaml.Node) -> None:
    """Refuse recursive aliases, and documents whose size or depth after alias expansion
    exceeds the bounds. One pass over the node graph (each node once), no recursion."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    visiting: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        nid = id(node)
        if children_done:
            kids = _children(node)
            size[nid] = 1 + sum(size[id(k)] for k in kids)
            depth[nid] = 1 + max((depth[id(k)] for k in kids), default=0)
            visiting.discard(nid)
            if size[nid] > MAX_YAML_NODES:
                raise YAMLProblem(None, None, f"this value expands to more than {MAX_YAML_NODES} nodes "
                                              f"through aliases (*name); write it out without aliases",
                                  node.start_mark)
            if depth[nid] > MAX_YAML_DEPTH:
                raise YAMLProblem(None, None, f"this value nests deeper than {MAX_YAML_DEPTH} levels "
                                              f"through aliases (*name)", node.start_mark)
            continue
        if nid in size:
            continue
        if nid in visiting:
            raise YAMLProblem(None, None, "a recursive alias: this value contains an alias (*name) to itself",
                              node.start_mark)
        visiting.add(nid)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node))


def check_duplicate_keys(loader: yaml.SafeLoader, root: yaml.Node) -> None:
    """A key given twice in one mapping (merge keys `<<` excepted: explicit keys override
    merged ones by design). Keys compare as built (`1` and `01`, `yes` and `true`)."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != MERGE_TAG:
                key = loader.construct_object(key_node)
                name = f"{path}.{key_node.value}" if path else str(key_node.value)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key; construction reports it
                    earlier = key_node
                if earlier is not key_node:
                    raise YAMLProblem(None, None, f"duplicate key {name} (first on line "
                                                  f"{earlier.start_mark.line + 1}); keep only one",
                                      key_node.start_mark)
                stack.append((value_node, name))
            else:
                stack.append((value_node, path))


def key_lines(root: yaml.Node | None) -> dict[str, int]:
    """Map dotted key paths (`limits.max_seq_len`, `buckets.chunk_sizes[1]`) to 1-based
    line numbers. The root has passed check_expansion, so the walk is bounded."""
    out: dict[str, int] = {}
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for k, val in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                out.setdefault(key, k.start_mark.line + 1)
                stack.append((val, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out.setdefault(f"{prefix}[{i}]", item.start_mark.line + 1)
                stack.append((item, f"{prefix}[{i}]"))
    return out


def yaml_error_message(exc: yaml.YAMLError, text: str, source: str) -> str:
    """`model.yaml line 8, column 17: not valid YAML: <problem>. <what to do>`."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None and getattr(exc, "position", None) is not None:  # a reader error
        line = text.count("\n", 0, exc.position)
        mark = yaml.Mark(source, exc.position, line, exc.position - (text.rfind("\n", 0, exc.position) + 1),
                         None, None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc)
    advice = "Fix it and run again." if isinstance(exc, YAMLProblem) else "Fix the syntax and run again."
    return f"{source}{where}: not valid YAML: {problem}. {advice}"
