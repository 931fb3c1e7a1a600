"""The OpenMP environment that pins a rank's threads, one variable set per runtime.

Thread i of the rank runs on the i-th CPU of its list. Each runtime reads its own variables, so the
plan sets the ones of the runtime that will actually be loaded. LLVM's libomp reads Intel's KMP_AFFINITY
too, and takes it: with OMP_PLACES="{0},{1}" and OMP_PROC_BIND=close, Debian's libomp 16 bound the first
thread to the first place before it read the places, then dropped every other CPU as "invalid" (OMP:
Warning #124) and bound every thread to that one CPU (2-vCPU AMD EPYC under KVM; tests/kernels/test_binding.py).
`bind_threads` pins the threads again after, but the runtime's own binding should be right by itself.
"""

from __future__ import annotations

RUNTIMES = ("intel", "gnu", "llvm")


def openmp_env(runtime: str, cpus: tuple[int, ...]) -> dict[str, str]:
    """Environment variables for `runtime` ("intel", "gnu" or "llvm") binding threads to `cpus`."""
    env = {"OMP_NUM_THREADS": str(len(cpus))}
    if runtime in ("intel", "llvm"):
        proclist = ",".join(map(str, cpus))
        env["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{proclist}]"
    elif runtime == "gnu":
        env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
    else:
        raise ValueError(f"unknown OpenMP runtime {runtime!r}; expected one of {RUNTIMES}")
    return env
