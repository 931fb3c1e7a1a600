"""The arm64 NEON kernels, cross-compiled and run under qemu-aarch64, against the portable ones.

Needs `g++-aarch64-linux-gnu` and `qemu-user` (Debian packages; the README's test command installs
them). CI sets APPLIANCE_REQUIRE_ARM64=1 so that missing tools fail instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import REPO

NATIVE = REPO / "native"
SOURCES = ["norm", "rope", "activation", "cache", "attention", "linear", "quant", "act_quant", "words", "float_tiles", "widened",
           "dequant", "pack"]


def test_neon_kernels_match_portable_ones(tmp_path):
    compiler, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if not (compiler and qemu):
        if os.environ.get("APPLIANCE_REQUIRE_ARM64") == "1":
            pytest.fail("aarch64-linux-gnu-g++ or qemu-aarch64 is missing but APPLIANCE_REQUIRE_ARM64=1")
        pytest.skip("no aarch64 cross compiler or qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)")
    flags = ["-std=c++17", "-O3", "-fopenmp", f"-I{NATIVE / 'include'}"]
    isa_flags = {"neon": [], "portable": ["-O2"]}  # as native/CMakeLists.txt builds them
    jobs = [([*flags, *isa_flags[isa], f"-DAPPLIANCE_ISA={isa}"], NATIVE / "src" / f"{name}.cpp",
             tmp_path / f"{isa}_{name}.o") for isa in isa_flags for name in SOURCES]
    # plain C++, not per ISA: the K-quant decoders the packing uses
    jobs.append((flags, NATIVE / "src" / "convert.cpp", tmp_path / "convert.o"))
    # one compiler a core, the slowest (quant.cpp) first: the build is most of this test's time
    jobs.sort(key=lambda job: job[1].name != "quant.cpp")
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: subprocess.run([compiler, *job[0], "-c", str(job[1]), "-o", str(job[2])], check=True),
                      jobs))
    objects = [str(job[2]) for job in jobs]
    harness = tmp_path / "harness"
    subprocess.run([compiler, *flags, "-DAPPLIANCE_ISA=portable", str(REPO / "tests/kernels/arm64/neon_vs_portable.cpp"),
                    *objects, "-o", str(harness)], check=True)
    run = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(harness)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "NEON matches portable" in run.stdout and run.stdout.count(" ok") == 54
    # decode attention's and the integer tiles' prefetches survive compilation here too (see tests/kernels/test_codegen.py)
    objdump = compiler.removesuffix("g++") + "objdump"
    for isa in ("neon", "portable"):
        listing = subprocess.run([objdump, "-d", str(tmp_path / f"{isa}_attention.o")], capture_output=True, text=True,
                                 check=True).stdout
        assert listing.count("pldl2keep") >= 2, f"{isa}: no prfm pldl2keep in attention.o"
        listing = subprocess.run([objdump, "-d", str(tmp_path / f"{isa}_quant.o")], capture_output=True, text=True,
                                 check=True).stdout
        assert listing.count("pldl1keep") >= 2, f"{isa}: no prfm pldl1keep in quant.o"
        assert listing.count("pldl2keep") >= 2, f"{isa}: no prfm pldl2keep (the next panels) in quant.o"
