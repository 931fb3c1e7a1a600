"""What the CPU can run: the minimum ISA the native kernels need, and which dtypes run natively.

Refusing here, with the flag that is missing, is what keeps a SIGILL from ever reaching a user.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from app.spec.errors import Described, Problem, SpecError
from app.topology.machine import Topology

# /proc/cpuinfo's flag -> its name; the x86 kernels are built with -mavx2 -mfma -mf16c (F16C widens the float16 scales
# of quantized blocks, float16 weights and float16 caches), the arm64 ones for NEON
MINIMUM_ISA = {"x86_64": {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C"}, "aarch64": {"asimd": "NEON (asimd)"}}
NATIVE_BF16 = {"x86_64": ("avx512_bf16", "amx_bf16"), "aarch64": ("bf16",)}


def check_isa(topo: Topology) -> None:
    """Raise unless the CPU is a supported architecture with the minimum vector ISA."""
    if topo.arch not in MINIMUM_ISA:
        raise SpecError([Problem("(cpu)", "an x86-64 CPU with AVX2, FMA and F16C or an arm64 CPU with NEON",
                                 Described(f"architecture {topo.arch!r} ({topo.cpu_model})"))])
    needed = MINIMUM_ISA[topo.arch]
    missing = [flag for flag in needed if not topo.has(flag)]
    if missing:
        flags = ", ".join(f"'{flag}'" for flag in missing)
        raise SpecError([Problem("(cpu)", f"an {topo.arch} CPU with {_and(needed.values())}; the kernels need it",
                                 Described(f"{topo.cpu_model} without {_and(needed[f] for f in missing)} "
                                           f"(no {flags} in /proc/cpuinfo)"))])


def _and(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_native_build() -> None:
    """Raise unless the `app` package Python found has its native kernels (app._native) beside it."""
    if importlib.util.find_spec("app._native") is None:
        import app

        raise SpecError([Problem("(build)", "an app package with its native kernels: `pip install -e .` in the "
                                 "repository builds them for it (a non-editable install has them in site-packages' "
                                 "app, which Python does not import while it runs in the repository's root)",
                                 Described(f"no app._native for the app package at {Path(app.__file__).parent}"))])


def has_native_bf16(topo: Topology) -> bool:
    return any(topo.has(flag) for flag in NATIVE_BF16.get(topo.arch, ()))


def resolve_dtype(requested: str, topo: Topology, path: str = "model.dtype") -> tuple[str, list[str]]:
    """The compute dtype to use for `requested`, and any warning about the choice."""
    native = has_native_bf16(topo)
    if requested == "auto":
        if native:
            return "bfloat16", []
        return "float32", [f"{path}: auto chose float32: the CPU has no native BF16 "
                           f"({' or '.join(NATIVE_BF16.get(topo.arch, ('bf16',)))})"]
    if requested == "bfloat16" and not native:
        flags = " or ".join(NATIVE_BF16.get(topo.arch, ("bf16",)))
        raise SpecError([Problem(path, f'"float32" or "auto" on this CPU (bfloat16 needs {flags})', requested)])
    return requested, []
