"""File access below a root directory ("/" on a live machine, a captured tree in tests).

Every read goes through `Root`, which remembers what it read (files, directories it listed, and
symlinks it looked at): `topology --capture` copies exactly those, so a capture always holds what
the reader needs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from app.spec.errors import Described, Problem, SpecError
from app.topology.cpulist import parse_cpulist, parse_cpumask


class Root:
    """Read files of a (possibly captured) machine, relative to its root."""

    def __init__(self, root: str | Path = "/"):
        self.path = Path(root)
        self.is_live = self.path.resolve() == Path("/")
        self.read_paths: set[str] = set()
        self.dirs_seen: set[str] = set()
        self.links_seen: dict[str, str] = {}  # path -> link target, for sysfs links such as cpu3/node0

    def _abs(self, rel: str) -> Path:
        return self.path / rel.lstrip("/")

    def text(self, rel: str) -> str | None:
        """The file's text, or None when it is absent or unreadable."""
        try:
            text = self._abs(rel).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
        self.read_paths.add(rel.lstrip("/"))
        return text

    def line(self, rel: str) -> str | None:
        """The file's first line, stripped."""
        text = self.text(rel)
        return text.strip().split("\n", 1)[0].strip() if text is not None else None

    def cpulist(self, rel: str) -> tuple[int, ...] | None:
        """A CPU (or node) list file, None when absent; a malformed one is a SpecError naming the file."""
        return self._cpus(rel, parse_cpulist, "a CPU list")

    def cpumask(self, rel: str) -> tuple[int, ...] | None:
        """A CPU mask file ("0000ffff,0000ffff"), None when absent; a malformed one is a SpecError."""
        return self._cpus(rel, parse_cpumask, "a CPU mask")

    def _cpus(self, rel: str, parse: Callable[[str], tuple[int, ...]], expected: str) -> tuple[int, ...] | None:
        text = self.line(rel)
        if text is None:
            return None
        try:
            return parse(text)
        except ValueError as exc:
            raise _malformed(self, rel, text, f"{expected} ({exc})") from None

    def integers(self, rel: str) -> tuple[int, ...] | None:
        text = self.line(rel)
        if text is None:
            return None
        try:
            return tuple(int(word) for word in text.split())
        except ValueError:
            raise _malformed(self, rel, text, "whitespace-separated integers") from None

    def exists(self, rel: str) -> bool:
        found = self._abs(rel).exists()
        if found and self._abs(rel).is_dir():
            self.dirs_seen.add(rel.lstrip("/"))
        return found

    def links(self, rel: str, pattern: str) -> list[str]:
        """Names in directory `rel` that match `pattern` (sysfs links such as cpu3/node0, which may dangle)."""
        names = [name for name in self.listdir(rel) if re.fullmatch(pattern, name)]
        for name in names:
            path = self._abs(f"{rel}/{name}")
            key = f"{rel}/{name}".lstrip("/")
            if path.is_symlink():
                self.links_seen[key] = os.readlink(path)
            else:
                self.dirs_seen.add(key)
        return names

    def listdir(self, rel: str) -> list[str]:
        try:
            names = sorted(os.listdir(self._abs(rel)))
            self.dirs_seen.add(rel.lstrip("/"))
            return names
        except OSError:
            return []


def _malformed(root: Root, rel: str, text: str, expected: str) -> SpecError:
    where = root.path / rel.lstrip("/")
    return SpecError([Problem("(machine)", f"{expected} in {where}", Described(f"{text[:80]!r}"))])
