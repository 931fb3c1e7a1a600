"""Errors a user can act on: where (the YAML path, and line when known), what was found, what is allowed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_NOTHING = object()


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, located by its dotted YAML path ("cores.ranks[1]")."""

    path: str
    allowed: str
    found: Any = _NOTHING
    line: int | str | None = None
    """Line in the YAML file, or "--set" for a value from the command line."""

    def render(self, source: str | None = None) -> str:
        if isinstance(self.line, str):
            where = f"{self.line} "
        elif source:
            where = f"{source}:{self.line}: " if self.line else f"{source}: "
        else:
            where = ""
        found = "" if self.found is _NOTHING else f"found {_show(self.found)}; "
        return f"{where}{self.path or '(top level)'}: {found}allowed: {self.allowed}"

    def at_line(self, line: int | str | None) -> Problem:
        return Problem(self.path, self.allowed, self.found, line)


class Described(str):
    """A "found" text that describes rather than quotes a value ("an unknown key 'x'")."""


def _show(value: Any) -> str:
    if isinstance(value, Described):
        return str(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 80 else value[:77] + "...")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class SpecError(Exception):
    """A spec that cannot be used; carries every problem found, not only the first."""

    def __init__(self, problems: list[Problem], source: str | None = None):
        self.problems = problems
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(p.render(self.source) for p in self.problems)


class FieldError(ValueError):
    """Raised inside a validator to blame a field below the one being validated.

    `field` is a dotted path relative to the model that raises it ("" for the model itself).
    """

    def __init__(self, field: str, allowed: str, found: Any = _NOTHING):
        self.field = field
        self.allowed = allowed
        self.found = found
        super().__init__(allowed)


def found_nothing() -> Any:
    """The marker for "no value was found" (a missing key)."""
    return _NOTHING
