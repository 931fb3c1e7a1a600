"""The kernel variants this CPU runs, for the `isa` fixtures: every ISA, and the avx512bf16 kernels twice,
bfloat16 pairs multiplied by vdpbf16ps ("avx512bf16") and by float32 FMAs ("avx512bf16-fma"), regardless of
which of the two the CPU's measured speeds pick (kernels.bf16_dot)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from app import kernels


def variants() -> list[str]:
    names = []
    for isa in kernels.supported_isas():
        names += [isa, f"{isa}-fma"] if isa == "avx512bf16" else [isa]
    return names


@contextmanager
def running(variant: str) -> Iterator[str]:
    """The kernels of `variant` inside the block; yields its ISA's name."""
    isa, _, fma = variant.partition("-")
    with kernels.use_isa(isa), kernels.use_bf16_dot("off" if fma else "on"):
        yield isa
