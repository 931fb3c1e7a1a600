"""What the compiler made of the kernels, where it can silently differ from the source.

GCC (12, at -O2 and up) sees no side effect in a prefetch: a function made only of prefetches is
pure, and its calls are deleted as dead code. Decode attention ran so for days without one of the
prefetches its source asks for (with them it streams the KV cache at ~15 GB/s instead of ~10).
Results cannot show it; the disassembly can.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from app import _native
from tests.conftest import REPO


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 prefetch instructions")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_attention_prefetches_survive_compilation():
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _native.__file__],
                             capture_output=True, text=True, check=True).stdout
    # Counted over the whole library: attention.cpp is the only source that prefetches (checked
    # below), and in a stripped build the OpenMP workers that hold them have no names to match.
    found = len(re.findall(r"\bprefetcht1\b", listing))
    # 32 in the Release build (4 ISA copies x 4 dtype pairs x keys and values); 8 if a compiler kept
    # prefetch_blocks out of line (one per cache dtype and ISA)
    assert found >= 8, f"{found} prefetcht1 instructions in the library"


def test_only_attention_prefetches():
    sources = sorted((REPO / "native").rglob("*.[ch]*"))
    prefetching = [p.name for p in sources if "__builtin_prefetch" in p.read_text()]
    assert prefetching == ["attention.cpp"], "a new prefetch: make sure it is emitted (see this file's docstring)"
