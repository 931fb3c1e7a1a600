"""The kernel variants this CPU runs, for the `isa` fixtures: every ISA, and the avx512bf16 kernels twice,
bfloat16 pairs multiplied by vdpbf16ps ("avx512bf16") and by float32 FMAs ("avx512bf16-fma"), regardless of
which of the two the CPU's measured speeds pick (kernels.bf16_dot); with `tiles`, the avx2 kernels twice too,
their int16 row tiles one row ("avx2-narrow") and several ("avx2-wide") tall (kernels.wide_int_tiles)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from app import kernels


def variants(tiles: bool = False) -> list[str]:
    names = []
    for isa in kernels.supported_isas():
        if isa == "avx512bf16":
            names += [isa, f"{isa}-fma"]
        elif isa == "avx2" and tiles:
            names += [f"{isa}-narrow", f"{isa}-wide"]
        else:
            names.append(isa)
    return names


@contextmanager
def running(variant: str) -> Iterator[str]:
    """The kernels of `variant` inside the block; yields its ISA's name."""
    isa, _, how = variant.partition("-")
    with kernels.use_isa(isa), kernels.use_bf16_dot("off" if how == "fma" else "on"), \
            kernels.use_int_tiles(how if how in ("narrow", "wide") else "auto"):
        yield isa
