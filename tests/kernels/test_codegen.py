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

from app import _native
from tests.conftest import REPO


# the instruction __builtin_prefetch(p, 0, 2) becomes on each architecture the kernels are built for
PREFETCH_L2 = {"x86_64": r"\bprefetcht1\b", "AMD64": r"\bprefetcht1\b", "aarch64": r"\bprfm\s+pldl2keep\b"}


def test_attention_prefetches_survive_compilation():
    # objdump is binutils', which building the library on this machine already needed
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _native.__file__],
                             capture_output=True, text=True, check=True).stdout
    # Counted over the whole library: attention.cpp is the only source that prefetches (checked
    # below), and in a stripped build the OpenMP workers that hold them have no names to match.
    found = len(re.findall(PREFETCH_L2[platform.machine()], listing))
    # 32 in the x86-64 Release build (4 ISA copies x 4 dtype pairs x keys and values); 8 if a compiler
    # kept prefetch_blocks out of line (one per cache dtype and ISA)
    assert found >= 8, f"{found} L2 prefetch instructions in the library"


# __builtin_prefetch(p, 0, 3), into L1: the integer tiles' weights, a few blocks ahead (quant.cpp)
PREFETCH_L1 = {"x86_64": r"\bprefetcht0\b", "AMD64": r"\bprefetcht0\b", "aarch64": r"\bprfm\s+pldl1keep\b"}


def test_quantized_tile_prefetches_survive_compilation():
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _native.__file__],
                             capture_output=True, text=True, check=True).stdout
    found = len(re.findall(PREFETCH_L1[platform.machine()], listing))
    # 384 in the x86-64 Release build (every integer and halves tile shape, 4 ISA copies); a handful if a
    # compiler kept prefetch_blocks out of line
    assert found >= 8, f"{found} L1 prefetch instructions in the library"


def test_only_attention_and_the_quantized_tiles_prefetch():
    sources = sorted((REPO / "native").rglob("*.[ch]*"))
    prefetching = [p.name for p in sources if "__builtin_prefetch" in p.read_text()]
    assert prefetching == ["attention.cpp", "quant.cpp"], \
        "a new prefetch: make sure it is emitted (see this file's docstring)"
