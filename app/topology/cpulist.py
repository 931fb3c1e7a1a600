"""CPU lists in the kernel's notation ("0-3,8,10-11") and back; CPU masks ("0000ffff,0000ffff").

The kernel writes CPU sets as lists in sysfs (`cpulist`, `online`), in `/proc/self/status`
(`Cpus_allowed_list`) and in the cgroup cpuset files; users write them this way in the spec.
Older kernels give some sets only as masks (`node*/cpumap`, `topology/thread_siblings`).
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_CPU = 1 << 16  # well past any real machine; guards against "0-999999999" eating memory


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse "0-3,8,10-11" (also with stride, "0-15:2") into a sorted tuple of CPU ids.

    Raises ValueError with a message a user can act on.
    """
    text = text.strip()
    if not text:
        return ()
    cpus: set[int] = set()
    for part in text.split(","):
        cpus.update(_parse_range(part.strip(), text))
    return tuple(sorted(cpus))


def _parse_range(part: str, whole: str) -> range:
    stride = 1
    if ":" in part:
        part, _, stride_text = part.partition(":")
        stride = _parse_id(stride_text, whole)
        if stride < 1:
            raise ValueError(f"stride must be >= 1 in {whole!r}")
    first_text, dash, last_text = part.partition("-")
    first = _parse_id(first_text, whole)
    last = _parse_id(last_text, whole) if dash else first
    if last < first:
        raise ValueError(f"range {part!r} runs backwards in {whole!r}")
    return range(first, last + 1, stride)


def _parse_id(text: str, whole: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a CPU number in {whole!r}")
    value = int(text)
    if value >= MAX_CPU:
        raise ValueError(f"CPU {value} is out of range (max {MAX_CPU - 1}) in {whole!r}")
    return value


def parse_cpumask(text: str) -> tuple[int, ...]:
    """Parse the kernel's bitmap format into a sorted tuple of CPU ids.

    The kernel prints comma-separated 32-bit hex words, most significant first; the first word is
    only as wide as the bits above the last full word ("ffff" for 16 CPUs, "f,ffffffff" for 36).
    Raises ValueError with a message a user can act on.
    """
    text = text.strip()
    if not text:
        return ()
    bits = 0
    for word in text.split(","):
        if not 1 <= len(word) <= 8 or any(ch not in "0123456789abcdefABCDEF" for ch in word):
            raise ValueError(f"{word!r} is not a 32-bit hex word in {text[:80]!r}")
        bits = (bits << 32) | int(word, 16)
    if bits.bit_length() > MAX_CPU:
        raise ValueError(f"a mask past CPU {MAX_CPU - 1} in {text[:40]!r}")
    return tuple(cpu for cpu in range(bits.bit_length()) if bits >> cpu & 1)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids as the kernel does: sorted, consecutive runs collapsed ("0-3,8")."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    start = prev = None
    for cpu in ordered:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            runs.append(_run(start, prev))
        start = prev = cpu
    if start is not None:
        runs.append(_run(start, prev))
    return ",".join(runs)


def _run(start: int, end: int | None) -> str:
    return str(start) if start == end else f"{start}-{end}"
