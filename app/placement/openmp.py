"""The OpenMP environment that pins a rank's threads, one variable set per runtime.

Thread i of the rank runs on the i-th CPU of its list. Each runtime reads its own variables, so the
plan sets the ones of the runtime that will actually be loaded.
"""

from __future__ import annotations

RUNTIMES = ("intel", "gnu", "llvm")


def openmp_env(runtime: str, cpus: tuple[int, ...]) -> dict[str, str]:
    """Environment variables for `runtime` ("intel", "gnu" or "llvm") binding threads to `cpus`."""
    env = {"OMP_NUM_THREADS": str(len(cpus))}
    if runtime == "intel":
        proclist = ",".join(map(str, cpus))
        env["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{proclist}]"
    elif runtime == "gnu":
        env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
    elif runtime == "llvm":
        env["OMP_PLACES"] = ",".join(f"{{{cpu}}}" for cpu in cpus)
        env["OMP_PROC_BIND"] = "close"
    else:
        raise ValueError(f"unknown OpenMP runtime {runtime!r}; expected one of {RUNTIMES}")
    return env
