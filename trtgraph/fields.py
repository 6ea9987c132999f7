"""One validator for every field read from outside: model.yaml, a manifest, a request, an HF
config.json or generation_config.json.

`FieldChecker` holds the checks (integer, number, flag, choice, text); each reader
subclasses it only to say how a failure is worded and which error it raises (`fail`), so a
message names that reader's file, line and field. The value tests themselves are the shared
ones of `inputs` (`int_problem`, `number_problem`, `text_problem`: a bool is never a number).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

from .inputs import int_problem, number_problem, text_problem


class FieldChecker:
    """Checks that return the value when it is allowed, else call `fail(name, value, expected)`."""

    def fail(self, name: str, value: Any, expected: str) -> NoReturn:
        raise NotImplementedError

    def integer(self, value: Any, name: str, lo: int, hi: int, expected: str | None = None) -> int:
        problem = int_problem(value, lo, hi)
        if problem:
            self.fail(name, value, expected or problem)
        return value

    def number(self, value: Any, name: str, lo: float, hi: float, lo_open: bool = False,
               expected: str | None = None) -> float:
        """A finite int or float in [lo, hi] ((lo, hi] with lo_open), as a float."""
        problem = number_problem(value, lo, hi, lo_open)
        if problem:
            self.fail(name, value, expected or problem)
        return float(value)

    def flag(self, value: Any, name: str, nullable: bool = False, expected: str | None = None) -> bool:
        """true or false (null too with `nullable`, read as false)."""
        if not isinstance(value, bool) and not (nullable and value is None):
            self.fail(name, value, expected or ("true, false or null" if nullable else "true or false"))
        return bool(value)

    def choice(self, value: Any, name: str, choices: tuple, expected: str | None = None):
        if value not in choices:
            self.fail(name, value, expected or "one of " + ", ".join(map(str, choices)))
        return value

    def text(self, value: Any, name: str, expected: str | None = None) -> str:
        """A string that UTF-8 can hold."""
        problem = text_problem(value)
        if problem:
            self.fail(name, value, expected or problem)
        return value


def defaults(cls) -> dict[str, Any]:
    """A dataclass's field defaults by name: the one place a default is written."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out
