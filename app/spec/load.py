"""Read a spec: YAML text + `--set key.path=value` overrides -> a validated `Spec`, or a SpecError.

Every problem names the YAML path and line, what was found and what is allowed; all problems of
a file are reported together.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from app.spec.errors import Described, FieldError, Problem, SpecError, found_nothing
from app.spec.schema import Spec

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class SpecDocument:
    """A validated spec and where its values came from, to locate later problems (model, plan)."""

    spec: Spec
    source: str
    lines: dict[Loc, int | str]

    def locate(self, error: SpecError) -> SpecError:
        """The same problems with this document's file name and line numbers."""
        problems = [p if p.line else p.at_line(_line_of(_split(p.path), self.lines)) for p in error.problems]
        return SpecError(problems, error.source or self.source)


def read_spec(path: str | Path | None, overrides: Sequence[str] = ()) -> SpecDocument:
    """Load, override and validate the spec at `path` (None: every default)."""
    if path is None:
        return parse_spec("", "(defaults)", overrides)
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([Problem("", "a readable YAML spec file", Described(f"{source} ({exc.strerror})"))]) from None
    except UnicodeDecodeError as exc:
        found = Described(f"a byte that is not UTF-8 at offset {exc.start}")
        raise SpecError([Problem("", "a UTF-8 YAML text file", found)], source) from None
    return parse_spec(text, source, overrides)


def load_spec(path: str | Path | None, overrides: Sequence[str] = ()) -> Spec:
    return read_spec(path, overrides).spec


def parse_spec(text: str, source: str = "<spec>", overrides: Sequence[str] = ()) -> SpecDocument:
    """Validate spec text (the part of `read_spec` that needs no file)."""
    data, lines = _read_yaml(text, source)
    for override in overrides:
        _apply_override(data, override, lines)
    try:
        return SpecDocument(Spec.model_validate(data), source, lines)
    except ValidationError as exc:
        problems = [_problem(error, lines) for error in exc.errors()]
        raise SpecError(problems, source) from None


def dump_spec(spec: Spec) -> str:
    """The effective spec (defaults filled in) as YAML that `load_spec` accepts back."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


# --- YAML with line numbers -------------------------------------------------------------------


def _read_yaml(text: str, source: str) -> tuple[dict, dict[Loc, int | str]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        problem = Problem("", "well-formed YAML", Described(f"a syntax error: {what}"), line)
        raise SpecError([problem], source) from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise SpecError([Problem("", "a mapping of sections (model, parallel, cores, ...)", data, 1)], source)
    lines: dict[Loc, int | str] = {}
    duplicates: list[Problem] = []
    try:
        _index_lines(node, (), lines, duplicates)
    except SpecError as error:
        raise SpecError(error.problems, source) from None
    if duplicates:
        raise SpecError(duplicates, source)
    return data, lines


def _index_lines(node: yaml.Node, loc: Loc, lines: dict, duplicates: list[Problem], visited: set | None = None) -> None:
    visited = set() if visited is None else visited
    if id(node) in visited:  # an alias: a spec needs none, and following them can blow up exponentially
        raise SpecError([Problem(_dotted(loc), "plain YAML values (anchors and aliases are not supported)",
                                 Described("an alias (*name)"), lines.get(loc, node.start_mark.line + 1))])
    if isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        visited.add(id(node))
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in seen:
                where = _dotted(loc + (key,))
                duplicates.append(Problem(where, f"each key once (first set on line {seen[key]})", Described("the key again"), line))
            seen[key] = line
            lines[loc + (key,)] = line
            _index_lines(value_node, loc + (key,), lines, duplicates, visited)
            lines[loc + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _index_lines(item, loc + (index,), lines, duplicates, visited)


# --- --set overrides ----------------------------------------------------------------------------


def _apply_override(data: dict, override: str, lines: dict[Loc, int | str]) -> None:
    key_path, sep, raw = override.partition("=")
    keys = tuple(key_path.strip().split("."))
    if not sep or not all(keys):
        raise SpecError([Problem("--set", "KEY.PATH=VALUE, e.g. --set server.port=9000", override)])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = _dotted(keys[: depth + 1])
            raise SpecError([Problem(where, "a mapping, to set a key inside it", child, "--set")])
        node = child
    node[keys[-1]] = value
    for loc in [loc for loc in lines if loc[: len(keys)] == keys]:
        del lines[loc]
    lines[keys] = "--set"


# --- pydantic errors -> Problems ----------------------------------------------------------------


def _problem(error: dict, lines: dict[Loc, int | str]) -> Problem:
    loc, model, field = _walk(error["loc"])
    found = error.get("input", found_nothing())
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        loc = loc + _split(cause.field)
        allowed, found = cause.allowed, cause.found
    elif error["type"] == "extra_forbidden":
        allowed, found = _unknown_key(model, str(loc[-1])), Described(f"an unknown key {loc[-1]!r}")
    elif error["type"] == "missing":
        allowed, found = "a value (this key is required)", found_nothing()
    else:
        allowed = _allowed(error, field)
    if isinstance(found, dict):
        found = "a mapping"
    return Problem(_dotted(loc), allowed, found, _line_of(loc, lines))


def _walk(raw_loc: tuple) -> tuple[Loc, type[BaseModel] | None, Any]:
    """Keep the YAML keys and list indexes of a pydantic location, dropping union branch tags.

    Returns the location, the model class that holds the last key, and that key's FieldInfo.
    """
    loc: list[str | int] = []
    current: Any = Spec
    holder, field = None, None
    for item in raw_loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            loc.append(item)
            holder, field = current, current.model_fields.get(item)
            current = _model_of(field.annotation) if field else None
        elif isinstance(item, int):
            loc.append(item)
    return tuple(loc), holder, field


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _unknown_key(model: type[BaseModel] | None, key: str) -> str:
    known = list(model.model_fields) if model else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}known keys here: {', '.join(known)}"


# What a pattern of the schema allows, in words
PATTERN_WORDS = {r"^\S{1,128}$": "1 to 128 characters, none of them a space",
                 r"^[A-Za-z_][\w.]*/.+$": 'an installed package\'s name, "/", and a path inside it'}


def _allowed(error: dict, field: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind == "literal_error":
        return f"one of {ctx['expected']}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than", "multiple_of"):
        return _number_range(field, kind, ctx)
    if kind == "string_pattern_mismatch" and field is not None:
        return PATTERN_WORDS.get(ctx["pattern"]) or field.description or f"a string matching {ctx['pattern']}"
    simple = {
        "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
        "bool_type": "true or false", "bool_parsing": "true or false",
        "float_type": "a number", "float_parsing": "a number",
        "string_type": "a string", "list_type": "a list",
        "model_type": "a mapping of keys", "model_attributes_type": "a mapping of keys",
        "string_too_short": "a non-empty string" if ctx.get("min_length") == 1
        else f"a string of at least {ctx.get('min_length')} characters",
        "too_short": f"a list of at least {ctx.get('min_length')} items",
    }
    return simple.get(kind, error["msg"])


_BOUND_WORDS = {
    "greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"),
    "greater_than": (">", "gt"), "less_than": ("<", "lt"), "multiple_of": ("a multiple of", "multiple_of"),
}


def _number_range(field: Any, kind: str, ctx: dict) -> str:
    bounds = {}
    for meta in field.metadata if field else ():
        bounds.update({k: getattr(meta, k) for k in ("ge", "le", "multiple_of") if getattr(meta, k, None) is not None})
    if "ge" in bounds and "le" in bounds:
        whole = field is None or float not in (field.annotation, *typing.get_args(field.annotation))
        text = f"{'an integer' if whole else 'a number'} from {bounds['ge']} to {bounds['le']}"
    else:
        symbol, key = _BOUND_WORDS[kind]
        text = f"a number {symbol} {ctx.get(key)}"
    if "multiple_of" in bounds:
        text += f" that is a multiple of {bounds['multiple_of']}"
    return text


def _line_of(loc: Loc, lines: dict[Loc, int | str]) -> int | str | None:
    """The line of `loc`, else of a key inside it (what set it), else of the nearest section around it."""
    if loc in lines or not loc:
        return lines.get(loc)
    inside = [lines[key] for key in lines if key[: len(loc)] == loc and len(key) > len(loc)]
    if inside:
        return inside[0]
    for end in range(len(loc) - 1, 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def _split(dotted: str) -> Loc:
    """"cores.ranks" -> ("cores", "ranks"); "" -> (); "[1]" -> (1,)."""
    parts: list[str | int] = []
    for piece in dotted.replace("[", ".[").split("."):
        if piece.startswith("["):
            parts.append(int(piece[1:-1]))
        elif piece:
            parts.append(piece)
    return tuple(parts)


def _dotted(loc: Sequence[str | int]) -> str:
    text = ""
    for item in loc:
        text += f"[{item}]" if isinstance(item, int) else (f".{item}" if text else str(item))
    return text
