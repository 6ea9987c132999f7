"""Bounds on rendering a checkpoint's chat template: time and size, beside the sandbox's bounds
on what a template can reach.

A template is code from the checkpoint. jinja2's sandbox keeps it from Python's internals and
from mutating its inputs, but not from looping for hours or building a string of gigabytes —
either would hold a `run` or a server worker for good. Here a render gets:

- a deadline (`RENDER_SECONDS`): a watchdog thread raises `RenderTimeout` in the rendering
  thread when it passes (no trace function: a render within its bounds costs its registration;
  raised as a BaseException, so no `except Exception` on the way swallows it);
- a size limit (`MAX_CHARS` characters or items, `MAX_INT_BYTES` for an integer) on every
  value the template reads, calls, filters or computes with an operator, and on its output;
  operations that would build a value past the limit in one step — repetition (`*`), products
  and powers of integers, `%`- and `format`-widths, `center` / `ljust` / `rjust` / `zfill` /
  `expandtabs` / `replace`, the `center` / `indent` filters — are refused before they run.

A limit reached raises `RenderLimit` (a jinja2 SecurityError), which chat.ChatTemplate turns into
the request's refusal. Real templates stay far inside both: a render takes microseconds to
milliseconds, and a prompt past `MAX_CHARS` is past every context length.
"""

from __future__ import annotations

import re

import jinja2.constants  # noqa: F401 -- the modules jinja2 imports inside a render (an error's traceback rewrite,
import jinja2.debug  # noqa: F401     lipsum, pprint, wordwrap), imported here: a deadline landing in a first import
import pprint  # noqa: F401           left importlib's module lock held, every later import of it (every erroring
import textwrap  # noqa: F401         render) waiting for good
from jinja2.compiler import CodeGenerator, operators, optimizeconst
from jinja2.runtime import markup_join, str_join
from jinja2.exceptions import SecurityError
from jinja2.filters import make_attrgetter
from jinja2.utils import pass_environment
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .render_watchdog import WATCHDOG, Expired

RENDER_SECONDS = 5.0
MAX_CHARS = 1 << 24  # 16,777,216 characters (or items of a list)
MAX_INT_BYTES = 1 << 16  # an integer of 524,288 bits: arithmetic on it stays in milliseconds
_WIDE = re.compile(r"\d{8,}|\*")  # a width or precision of 10^7+ (or taken from the arguments)
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+|\*)?(?:\.(\d+|\*))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*:[^{}]*?(\d{8,})[^{}]*\}")
_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}


class RenderLimit(SecurityError):
    """A chat template's render went past a bound."""


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0


def _int_bytes(value) -> int:
    return value.bit_length() // 8 if isinstance(value, int) else 0


def checked(value, what: str):
    """`value` if its size is within the limits, else RenderLimit naming `what`."""
    if _size(value) > MAX_CHARS:
        raise RenderLimit(f"{what} made a value of {_size(value):,} characters or items (the limit is "
                          f"{MAX_CHARS:,})")
    if _int_bytes(value) > MAX_INT_BYTES:
        raise RenderLimit(f"{what} made an integer of {_int_bytes(value):,} bytes (the limit is {MAX_INT_BYTES:,})")
    return value


def _text_size(value) -> int:
    """What str(), repr() or JSON of `value` spells out, at least (characters): a list holding one
    string a million times spells it a million times. Counted only until past MAX_CHARS, so the
    count costs at most MAX_CHARS steps (a real template's values take a few)."""
    total, stack = 0, [value]
    while stack and total <= MAX_CHARS:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            total += len(item) + 1
            if total <= MAX_CHARS:
                stack.extend(item.items() if isinstance(item, dict) else item)
        else:
            total += 1 + _int_bytes(item) * 3
    return total


def text_checked(value, what: str):
    """`value` if its text (`_text_size`) is within MAX_CHARS, else RenderLimit naming `what`: for a value
    about to be turned into text, compared or sorted whole in one C call the deadline cannot stop."""
    if isinstance(value, (list, tuple, set, frozenset, dict, int)) and _text_size(value) > MAX_CHARS:
        raise RenderLimit(f"{what} a value whose text is over {MAX_CHARS:,} characters or items (one value "
                          f"held many times counts each time)")
    return value


def _texts_checked(values, what: str):
    if _text_size(list(values)) > MAX_CHARS:
        raise RenderLimit(f"{what} values whose text is over {MAX_CHARS:,} characters or items (one value held "
                          f"many times counts each time)")
    return values


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator with `~` (Concat) and comparisons (`in`, `==`, `<`, ...) bounded: the
    sandbox intercepts neither, and both run as one C call on whole values."""

    @optimizeconst
    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("), context)")

    @optimizeconst
    def visit_Compare(self, node, frame) -> None:
        self.write("(environment.operand(")
        self.visit(node.expr, frame)
        self.write(")")
        for op in node.ops:
            self.visit(op, frame)
        self.write(")")

    def visit_Operand(self, node, frame) -> None:
        self.write(f" {operators[node.op]} environment.operand(")
        self.visit(node.expr, frame)
        self.write(")")


def _output(value):
    return text_checked(value, "writing out")


def _int_arg(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_join(items, sep, what: str) -> None:
    """`sep.join(items)`'s size, refused before it is built (the str method and the join filter)."""
    if sum(_size(i) for i in items) + _size(sep) * len(items) > MAX_CHARS:
        raise RenderLimit(f"{what} past the size limit")


def _check_replace(text: str, old: str, new: str, what: str) -> None:
    """`text.replace(old, new)`'s size (an empty `old` inserts `new` at every position), refused before it is built."""
    if len(text) + (text.count(old) if old else len(text) + 1) * len(new) > MAX_CHARS:
        raise RenderLimit(f"{what} past the size limit")


def _keep_pass_arg(fn, wrapper):
    """`wrapper` with jinja2's pass_context / pass_eval_context / pass_environment mark of `fn`."""
    if hasattr(fn, "jinja_pass_arg"):
        wrapper.jinja_pass_arg = fn.jinja_pass_arg
    return wrapper


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the size bounds above (the deadline is `render`'s)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("finalize", _output)  # every {{ value }} before it is made text
        super().__init__(*args, **kwargs)

    def bounded_concat(self, parts, context):
        _texts_checked(parts, "joining with ~")
        return (markup_join if context.eval_ctx.autoescape else str_join)(parts)

    @staticmethod
    def operand(value):
        return text_checked(value, "comparing")

    def call_binop(self, context, operator, left, right):
        if operator == "*" and _int_arg(left) and _int_arg(right):
            if _int_bytes(left) + _int_bytes(right) > MAX_INT_BYTES:
                raise RenderLimit("a product of integers over the size limit")
        elif operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _size(seq) and _int_arg(times) * _size(seq) > MAX_CHARS:
                    raise RenderLimit(f"repeating a value of {_size(seq):,} items {times:,} times is over the "
                                      f"limit of {MAX_CHARS:,}")
        elif operator == "**":
            base, exp = _int_arg(left), _int_arg(right)
            if abs(base) > 1 and exp * abs(base).bit_length() > 8 * MAX_INT_BYTES:
                raise RenderLimit(f"a power of {exp:,} over the size limit")
        elif operator == "+" and _size(left) + _size(right) > MAX_CHARS:
            raise RenderLimit(f"joining values of {_size(left):,} and {_size(right):,} items is over the limit "
                              f"of {MAX_CHARS:,}")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left)
            _check_fields(left.count("%"), [right], "the operator %")
        return checked(super().call_binop(context, operator, left, right), f"the operator {operator}")

    def getattr(self, obj, attribute):
        return checked(super().getattr(obj, attribute), f"reading .{attribute}")

    def getitem(self, obj, argument):
        return checked(super().getitem(obj, argument), "reading an item")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        name = getattr(__obj, "__name__", "")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, list, tuple, set, frozenset, dict)):  # a C method: join, count, index, ...
            _texts_checked([owner, *args, *kwargs.values()], f"calling {name or 'a function'} with")
        if isinstance(owner, str):
            if name in _WIDTH_METHODS and any(_int_arg(a) > MAX_CHARS for a in args):
                raise RenderLimit(f"str.{name} with a width over {MAX_CHARS:,}")
            if name == "expandtabs" and owner.count("\t") * max((_int_arg(a) for a in args), default=8) > MAX_CHARS:
                raise RenderLimit("str.expandtabs past the size limit")
            if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _check_replace(owner, args[0], args[1], "str.replace")
            if name == "join" and args and isinstance(args[0], (list, tuple)):
                _check_join(args[0], owner, "str.join")
        return checked(super().call(__context, __obj, *args, **kwargs), f"calling {name or 'a function'}")

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        if _FORMAT_SPEC.search(value.__self__):
            raise RenderLimit("a str.format width over the size limit")
        fields = value.__self__.count("{")

        def bounded(*args, **kwargs):
            _check_fields(fields, [*args, *kwargs.values()], "str.format")
            return wrapped(*args, **kwargs)
        return bounded


def _check_fields(fields: int, values, what: str) -> None:
    """A format with `fields` fields may spell each of `values` that many times."""
    if fields and fields * _text_size(list(values)) > MAX_CHARS:
        raise RenderLimit(f"{what} with {fields:,} fields of values that would spell over {MAX_CHARS:,} characters")


def _bounded_sum(environment, iterable, attribute=None, start=0):
    """jinja2's sum filter as a loop of its own: builtins.sum is one C call the deadline cannot stop
    (a sum of lists is quadratic), and each partial sum is size-checked."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    if isinstance(start, (str, bytes, bytearray)):  # as builtins.sum
        raise TypeError(f"sum() can't sum {type(start).__name__} [use ''.join(seq) instead]")
    total = start
    for item in iterable:
        if _size(total) + _size(item) > MAX_CHARS:
            raise RenderLimit(f"the sum filter past the size limit of {MAX_CHARS:,}")
        total = checked(total + item, "the sum filter")
    return total


_bounded_sum = pass_environment(_bounded_sum)


def _check_percent(fmt: str) -> None:
    for m in _PERCENT.finditer(fmt):
        for part in m.groups():
            if part and _WIDE.fullmatch(part):
                raise RenderLimit(f"a %-format width {part!r} over the size limit")


# Filters that neither make text of a value nor compare its items (their results are size-checked; what
# they hand on is checked where it is used): not walked, so `messages | length` in a loop stays cheap.
_STRUCTURAL_FILTERS = frozenset({"length", "count", "first", "last", "list", "batch", "slice", "map", "select",
                                 "reject", "selectattr", "rejectattr", "items", "default", "d", "attr", "random",
                                 "reverse", "abs", "int", "float", "round", "sum"})
_COMPARING_TESTS = frozenset({"in", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt",
                              "greaterthan", ">", "ge", ">="})


def bound_filters(env: BoundedSandbox) -> None:
    """Every filter's result size-checked, and the text of what it is given unless it is structural;
    `center`'s and `indent`'s widths, `format`'s %-widths, `tojson`'s indent and what `join` and
    `replace` would build checked before they run. Comparing tests check their operands' text."""
    def sized(name, fn):
        def run(*args, **kwargs):
            if name == "center" and _int_arg(args[1] if len(args) > 1 else kwargs.get("width")) > MAX_CHARS:
                raise RenderLimit(f"the center filter with a width over {MAX_CHARS:,}")
            if name == "indent":
                width = args[1] if len(args) > 1 else kwargs.get("width", 4)
                text = args[0] if args and isinstance(args[0], str) else ""
                if _int_arg(width) * (text.count("\n") + 1) > MAX_CHARS or _size(width) > MAX_CHARS:
                    raise RenderLimit("the indent filter past the size limit")
            if name not in _STRUCTURAL_FILTERS:
                _texts_checked([*args, *kwargs.values()], f"the {name} filter on")
            if name == "format" and args and isinstance(args[0], str):
                _check_percent(args[0])
                _check_fields(args[0].count("%"), [*args[1:], *kwargs.values()], "the format filter")
            if name == "tojson" and _int_arg(args[2] if len(args) > 2 else kwargs.get("indent")) > 1024:
                raise RenderLimit("tojson with an indent over 1,024")
            values = [a for a in args if isinstance(a, (str, list, tuple))]  # (past a context jinja passes first)
            if name == "join" and values and isinstance(values[0], (list, tuple)):
                at = args.index(values[0]) + 1
                _check_join(values[0], args[at] if len(args) > at else kwargs.get("d", ""), "the join filter")
            if name == "replace" and len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
                _check_replace(*values[:3], "the replace filter")
            return checked(fn(*args, **kwargs), f"the {name} filter")

        return _keep_pass_arg(fn, run)

    env.filters = {name: sized(name, _bounded_sum if name == "sum" else fn) for name, fn in env.filters.items()}

    def tested(name, fn):
        def run(*args, **kwargs):
            if name in _COMPARING_TESTS:
                _texts_checked([*args, *kwargs.values()], f"the test {name} on")
            return fn(*args, **kwargs)

        return _keep_pass_arg(fn, run)

    env.tests = {name: tested(name, fn) for name, fn in env.tests.items()}


class RenderTimeout(RenderLimit):
    """Raised in a rendering thread by the watchdog once its deadline has passed."""

    def __init__(self, *args):
        super().__init__(*(args or (f"the render did not finish within {RENDER_SECONDS:g} s",)))


def render_bounded(template, **context) -> str:
    """`template` rendered within the deadline and the output size limit."""
    try:
        token = WATCHDOG.begin(RENDER_SECONDS)  # (inside: a deadline short enough to pass within begin)
        try:
            parts, total = [], 0
            for chunk in template.generate(**context):
                total += len(chunk)
                if total > MAX_CHARS:
                    raise RenderLimit(f"the rendered prompt passed {MAX_CHARS:,} characters")
                parts.append(chunk)
            return "".join(parts)
        finally:
            WATCHDOG.end(token)
    except Expired:
        raise RenderTimeout() from None
