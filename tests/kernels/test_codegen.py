"""What the compiler made of the kernels, where it can silently differ from the source.

GCC treats a prefetch as free of side effects: a function that only prefetches is `const`, and its
calls are deleted as dead code. That is how decode attention ran for days without one of the
prefetches its source asks for (it streams the KV cache at DRAM speed, so they are most of its
bandwidth). Results cannot show it; the disassembly can.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from app import _native


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 prefetch instructions")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_attention_prefetches_survive_compilation():
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", _native.__file__],
                             capture_output=True, text=True, check=True).stdout
    # each function's body: "<address> <name>:" up to the next blank line
    bodies = re.split(r"\n\n", listing)
    attention = [b for b in bodies if re.search(r"^[0-9a-f]+ <[^\n]*paged_attention|^[0-9a-f]+ <[^\n]*attention_impl", b, re.M)]
    assert attention, "no attention function found in the library's disassembly"
    found = sum(len(re.findall(r"\bprefetcht1\b", b)) for b in attention)
    # four ISA copies (avx512bf16, avx512, avx2, portable), each with a float32 and a bfloat16 cache
    # path that prefetches keys and values (32 in the Release build)
    assert found >= 16, f"{found} prefetcht1 instructions in the attention kernels"
