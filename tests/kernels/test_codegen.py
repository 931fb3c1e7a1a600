"""What the compiler made of the kernels, where it can silently differ from the source.

GCC (12, at -O2 and up) sees no side effect in a prefetch: a function made only of prefetches is
pure, and its calls are deleted as dead code. Decode attention ran so for days without one of the
prefetches its source asks for (with them it streams the KV cache at ~15 GB/s instead of ~10).
Results cannot show it; the disassembly can.
"""

from __future__ import annotations

import platform
import re
import subprocess

import pytest

from app import _native
from tests.conftest import REPO


# What __builtin_prefetch(p, 0, locality) becomes on each architecture the kernels are built for, and
# how many the library must hold at least there. Counted over the whole library: in a stripped build the
# OpenMP workers that hold them have no names to match.
PREFETCHES = {
    # locality 2 (L2): attention's next key tile, a few lines from each inner-product loop (attention_tile.h's
    # Prefetcher), and the integer tiles' next panels (packed.h's prefetch_next). In the x86-64 Release
    # build 580 with both, 244 with attention's alone (every block shape, 4 ISA copies): fewer than 400 and
    # the tiles' were dropped. On arm64 test_arm64.py counts them per object; a handful here if a compiler
    # kept Prefetcher::some out of line
    "attention and the integer tiles' next panels": (
        {"x86_64": r"\bprefetcht1\b", "AMD64": r"\bprefetcht1\b", "aarch64": r"\bprfm\s+pldl2keep\b"},
        {"x86_64": 400, "AMD64": 400, "aarch64": 8}),
    # locality 3 (L1): the integer tiles' weights, 2 KiB ahead (packed.h's prefetch_blocks). 848 in the x86-64 Release
    # build (every integer and halves tile shape, with and without the next panels, 4 ISA copies); a
    # handful if kept out of line
    "quantized tiles": ({"x86_64": r"\bprefetcht0\b", "AMD64": r"\bprefetcht0\b", "aarch64": r"\bprfm\s+pldl1keep\b"},
                        {"x86_64": 8, "AMD64": 8, "aarch64": 8}),
}


@pytest.mark.parametrize("kernels", sorted(PREFETCHES))
def test_prefetches_survive_compilation(kernels):
    # objdump is binutils', which building the library on this machine already needed
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _native.__file__],
                             capture_output=True, text=True, check=True).stdout
    pattern, least = (by_arch[platform.machine()] for by_arch in PREFETCHES[kernels])
    found = len(re.findall(pattern, listing))
    assert found >= least, f"{found} prefetch instructions of the {kernels} in the library (at least {least})"


def test_only_attention_and_the_quantized_tiles_prefetch():
    sources = sorted((REPO / "native").rglob("*.[ch]*"))
    prefetching = [p.name for p in sources if "__builtin_prefetch" in p.read_text()]
    assert prefetching == ["attention_tile.h", "packed.h"], \
        "a new prefetch: make sure it is emitted (see this file's docstring)"
