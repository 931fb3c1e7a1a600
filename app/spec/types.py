"""Value types the spec accepts in more than one spelling, each normalised once, here.

Each validator raises ValueError whose text says what would be accepted; the loader turns it into
an error that also names the YAML path and what was found.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, PlainValidator, WithJsonSchema

from app.spec.errors import FieldError

from app.topology.cpulist import format_cpulist, parse_cpulist
from app.units import MAX_SIZE, SIZE_HELP, exact_size, has_unit, parse_size

CPULIST_HELP = 'a CPU list such as "0-3,8,10-11" or a YAML list of CPU numbers'
RANKS_HELP = (
    '"auto", or one CPU list per rank: "0-31|32-63" (vLLM\'s form) or a YAML list of CPU lists'
)
KV_MEMORY_HELP = f'{SIZE_HELP}, or a fraction of the rank\'s NUMA node memory such as 0.3 or "30%"'

# JSON Schema of each spelling, for editors (config/spec.schema.json): as permissive as the
# validators below, which stay the authority and give the precise message.
_RANGE = r"\d+(-\d+(:\d+)?)?"
_CPULIST = rf"\s*{_RANGE}(\s*,\s*{_RANGE})*\s*"
_SIZE = r"^\s*\d+(\.\d+)?\s*([bB]|[kKmMgGtT]([iI]?[bB]?))?\s*$"
CPUSET_SCHEMA = {"anyOf": [{"type": "string", "pattern": f"^{_CPULIST}$"}, {"type": "integer", "minimum": 0},
                           {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]}


def _to_cpus(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        try:
            cpus = parse_cpulist(value)
        except ValueError as exc:
            raise ValueError(f"{CPULIST_HELP} ({exc})") from None
    elif isinstance(value, list | tuple) and all(_is_cpu_id(v) for v in value):
        cpus = tuple(sorted(set(value)))
    else:
        raise ValueError(CPULIST_HELP)
    if not cpus:
        raise ValueError(f"a non-empty CPU list: {CPULIST_HELP}")
    return cpus


def _is_cpu_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


CpuSet = Annotated[
    tuple[int, ...],
    BeforeValidator(_to_cpus),
    PlainSerializer(format_cpulist, return_type=str),
    WithJsonSchema(CPUSET_SCHEMA, mode="validation"),
]
"""A set of CPU ids, written "0-3,8" or [0, 1, 2, 3, 8]."""


def _to_rank_lists(value: Any) -> str | tuple[tuple[int, ...], ...]:
    if value == "auto":
        return value
    if _is_cpu_id(value):  # one rank on one CPU, as YAML reads `ranks: 1` (or `--set cores.ranks=1`)
        value = [value]
    if isinstance(value, str):
        value = [part.strip() for part in value.split("|")]
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(RANKS_HELP)
    lists = []
    for index, item in enumerate(value):
        try:
            lists.append(_to_cpus(item))
        except ValueError as exc:
            raise FieldError(f"[{index}]", str(exc), item) from None
    return tuple(lists)


def _show_rank_lists(value: str | tuple[tuple[int, ...], ...]) -> str | list[str]:
    return value if isinstance(value, str) else [format_cpulist(cpus) for cpus in value]


RankCpus = Annotated[
    str | tuple[tuple[int, ...], ...],
    PlainValidator(_to_rank_lists),
    PlainSerializer(_show_rank_lists),
    WithJsonSchema({"anyOf": [{"const": "auto"}, {"type": "string", "pattern": f"^{_CPULIST}(\\|{_CPULIST})*$"},
                              {"type": "integer", "minimum": 0},
                              {"type": "array", "minItems": 1, "items": CPUSET_SCHEMA}]}, mode="validation"),
]
"""Either "auto" or one CPU set per rank."""


def _to_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE:
        return value
    if isinstance(value, str):
        try:
            size = parse_size(value)
        except ValueError:
            size = 0
        if size > 0:
            return size
    raise ValueError(f"{SIZE_HELP}, above zero")


ByteSize = Annotated[
    int,
    BeforeValidator(_to_size),
    PlainSerializer(exact_size, return_type=str),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_SIZE},
                              {"type": "string", "pattern": _SIZE}]}, mode="validation"),
]
"""A number of bytes, written "4GiB", "512MiB" or as a plain integer."""


def _to_kv_memory(value: Any) -> int | float:
    """A fraction in (0, 1) ("30%" too), or bytes: a size with a unit, or a plain integer."""
    if isinstance(value, str) and not has_unit(value) and not value.strip().endswith("%"):
        try:  # a bare number written as a string: read it as the number it is
            value = int(value) if value.strip().isdigit() else float(value)
        except ValueError:
            pass
    if isinstance(value, float) and 0 < value < 1:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE:
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            percent = -1.0
        if 0 < percent < 100:
            return percent / 100
    elif isinstance(value, str):
        try:
            size = parse_size(value)
        except ValueError:
            size = 0
        if size > 0:
            return size
    raise ValueError(KV_MEMORY_HELP)


def _show_kv_memory(value: int | float) -> str | float:
    return value if isinstance(value, float) else exact_size(value)


KvMemory = Annotated[
    int | float,
    BeforeValidator(_to_kv_memory),
    PlainSerializer(_show_kv_memory),
    WithJsonSchema({"anyOf": [{"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                              {"type": "integer", "minimum": 1, "maximum": MAX_SIZE},
                              {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*%\s*$"},
                              {"type": "string", "pattern": _SIZE}]}, mode="validation"),
]
"""KV-cache memory per rank: bytes (int) or a fraction of the rank's memory budget (float)."""
