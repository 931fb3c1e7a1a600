"""Preflight: the native libraries the process should run with, and the re-exec that preloads them.

jemalloc/tcmalloc replace glibc malloc (far less fragmentation and lock contention under many
threads); Intel OpenMP, where installed, is preloaded on x86 and pinned with KMP_AFFINITY (for our
kernels it measured the same as GNU's and LLVM's: docs/DEPLOYING.md).
Both must be in LD_PRELOAD before the interpreter starts, so when one is installed but not loaded
the process re-executes itself once with LD_PRELOAD set; an environment marker stops any loop.

`serve` re-executes first from `python -m app` itself (`early_preload_env`), before the command line's
modules load: what it preloads comes from the spec file's `runtime` section and `--set runtime.*` as
written. The full preflight after it checks again and, where that guess was wrong, re-executes as before.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: early_preload_env runs before the spec's modules load
    from app.spec.schema import RuntimeSpec

REEXEC_MARKER = "APPLIANCE_PRELOAD_REEXEC"
EARLY_MARKER = "APPLIANCE_PRELOAD_EARLY"
RUNTIME_DEFAULTS = {"allocator": "jemalloc", "openmp": "auto"}  # RuntimeSpec's (tests/unit/test_preflight.py)
SEARCH_PATH_VAR = "APPLIANCE_LIB_PATH"


@dataclass(frozen=True)
class Library:
    names: tuple[str, ...]  # file names to look for, preferred first
    install: str  # how to get it


ALLOCATORS = {
    "jemalloc": Library(("libjemalloc.so.2", "libjemalloc.so"), "apt-get install libjemalloc2"),
    "tcmalloc": Library(("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "apt-get install libtcmalloc-minimal4"),
}
OPENMP_LIBRARIES = {
    "intel": Library(("libiomp5.so",), "pip install intel-openmp"),
    "llvm": Library(("libomp.so.5", "libomp.so"), "apt-get install libomp5"),
}
LIBNUMA = Library(("libnuma.so.1", "libnuma.so"), "apt-get install libnuma1")


@dataclass
class PreflightReport:
    allocator: str
    allocator_path: str | None
    openmp_runtime: str  # the runtime whose affinity variables the plan sets
    openmp_path: str | None
    libnuma_path: str | None
    preload: list[str]  # what LD_PRELOAD must hold
    loaded: list[str]  # which of those are mapped into this process
    ld_preload: str
    reexecuted: bool
    warnings: list[str] = field(default_factory=list)

    @property
    def needs_reexec(self) -> bool:
        return any(path not in self.loaded for path in self.preload) and not self.reexecuted


def default_search_dirs() -> list[str]:
    """Where preloadable libraries live: this environment's lib/ (pip's intel-openmp) and the system's."""
    multiarch = f"{platform.machine()}-linux-gnu"
    return [os.path.join(sys.prefix, "lib"), f"/usr/lib/{multiarch}", f"/lib/{multiarch}",
            "/usr/local/lib", "/usr/lib64", "/usr/lib", "/lib"]


def find_library(library: Library, dirs: list[str]) -> str | None:
    for name in library.names:
        for directory in dirs:
            candidate = Path(directory) / name
            if candidate.is_file():
                return str(candidate.resolve())
    return None


def check(runtime: RuntimeSpec, arch: str, env: dict[str, str], dirs: list[str], maps: str) -> PreflightReport:
    """What to preload for `runtime` on this machine, and what is missing (pure: no side effects)."""
    warnings: list[str] = []
    preload: list[str] = []
    allocator_path = None
    if runtime.allocator != "system":
        allocator_path = find_library(ALLOCATORS[runtime.allocator], dirs)
        if allocator_path:
            preload.append(allocator_path)
        else:
            warnings.append(f"runtime.allocator is {runtime.allocator} but it is not installed; running with "
                            f"glibc malloc (install it: {ALLOCATORS[runtime.allocator].install})")
    if allocator_path:  # a user's own allocator in LD_PRELOAD (as vLLM's docs have users preload tcmalloc) loses
        for other in _preloaded_allocators(env.get("LD_PRELOAD", ""), runtime.allocator):
            warnings.append(f"LD_PRELOAD holds {other}, but runtime.allocator is {runtime.allocator}, which is "
                            f"preloaded ahead of it and is the one in use: set runtime.allocator to use yours "
                            f"(or \"system\" to leave LD_PRELOAD as it is)")
    openmp, openmp_path = _openmp(runtime.openmp, arch, dirs, warnings)
    if openmp_path:
        preload.append(openmp_path)
    libnuma = find_library(LIBNUMA, dirs)
    if libnuma is None:
        warnings.append(f"libnuma is not installed: rank memory cannot be bound to NUMA nodes "
                        f"(install it: {LIBNUMA.install})")
    loaded = [path for path in preload if _is_mapped(path, maps)]
    return PreflightReport(runtime.allocator, allocator_path, openmp, openmp_path, libnuma, preload, loaded,
                           env.get("LD_PRELOAD", ""), env.get(REEXEC_MARKER) == "1", warnings)


def _preloaded_allocators(ld_preload: str, chosen: str) -> list[str]:
    """The libraries in LD_PRELOAD that are an allocator other than `chosen` (jemalloc or tcmalloc)."""
    return [path for path in ld_preload.replace(":", " ").split()
            if any(Path(path).name.startswith(f"lib{name}") for name in ALLOCATORS if name != chosen)]


def _openmp(wanted: str, arch: str, dirs: list[str], warnings: list[str]) -> tuple[str, str | None]:
    """Resolve the OpenMP runtime; "auto" prefers Intel's on x86 when the intel-openmp package is there (or
    what stands in for it under its name)."""
    if wanted == "auto":
        intel = find_library(OPENMP_LIBRARIES["intel"], dirs) if arch == "x86_64" else None
        return ("gnu", None) if intel is None else (_named(intel), intel)
    if wanted == "gnu":
        return "gnu", None
    path = find_library(OPENMP_LIBRARIES[wanted], dirs)
    if path is None:
        warnings.append(f"runtime.openmp is {wanted} but it is not installed; using GNU OpenMP "
                        f"(install it: {OPENMP_LIBRARIES[wanted].install})")
        return "gnu", None
    if wanted == "intel" and _named(path) == "llvm":
        warnings.append(f"runtime.openmp is intel but libiomp5.so here is LLVM's libomp ({path}); using it as llvm "
                        f"(install Intel's: {OPENMP_LIBRARIES['intel'].install})")
        return "llvm", path
    return wanted, path


def _named(libiomp5: str) -> str:
    """Debian's libomp-dev makes libiomp5.so a link to LLVM's libomp: that is what loads, so say so."""
    return "intel" if Path(libiomp5).name.startswith("libiomp5") else "llvm"


def _is_mapped(path: str, maps: str) -> bool:
    real = os.path.realpath(path)
    return any(line.endswith(real) for line in maps.splitlines())


def preload_env(report: PreflightReport, env: dict[str, str]) -> dict[str, str]:
    """The environment to re-execute with: the libraries first in LD_PRELOAD, and the loop marker."""
    existing = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p not in report.preload]
    return {**env, "LD_PRELOAD": " ".join(report.preload + existing), REEXEC_MARKER: "1"}


def _search_dirs(env: dict[str, str]) -> list[str]:
    return env[SEARCH_PATH_VAR].split(":") if env.get(SEARCH_PATH_VAR) else default_search_dirs()


def _reexecute(env: dict[str, str]) -> None:
    """This command again, in `env` (does not return)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def run_preflight(runtime: RuntimeSpec, arch: str) -> PreflightReport:
    """Check this process; re-execute it with the missing libraries preloaded (does not return then)."""
    env = dict(os.environ)
    report = check(runtime, arch, env, _search_dirs(env), Path("/proc/self/maps").read_text())
    if report.needs_reexec:
        _reexecute(preload_env(report, env))
    if report.reexecuted and len(report.loaded) < len(report.preload):
        missing = [p for p in report.preload if p not in report.loaded]
        report.warnings.append(f"re-executed with LD_PRELOAD but {', '.join(missing)} did not load; continuing without")
    return report


def early_preload_env(argv: list[str], env: dict[str, str], dirs: list[str], maps: str) -> dict[str, str] | None:
    """The environment `python -m app ARGV` should re-execute with at once, or None (nothing to preload, not
    `serve`, already re-executed, or a spec that only the full start reads: it reports what is wrong with it).

    The re-exec otherwise comes after the spec is validated, so every start imported and parsed everything
    twice: 0.6 s of the default spec's 5.3 s start on a 2-core Zen 1."""
    if not argv or argv[0] != "serve" or env.get(REEXEC_MARKER) == "1" or env.get(EARLY_MARKER) == "1":
        return None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-c", "--config")
    parser.add_argument("--set", action="append", default=[])
    try:
        args, _ = parser.parse_known_args(argv[1:])
        runtime = dict(RUNTIME_DEFAULTS)
        if args.config:
            import yaml

            with open(args.config, encoding="utf-8") as spec:
                section = (yaml.safe_load(spec) or {}).get("runtime") or {}
            runtime.update({key: section[key] for key in RUNTIME_DEFAULTS if key in section})
        for item in args.set:
            key, _, value = item.partition("=")
            if key.startswith("runtime.") and key[len("runtime."):] in RUNTIME_DEFAULTS:
                runtime[key[len("runtime."):]] = value.strip().strip("'\"")
    except Exception:  # noqa: BLE001 - any spec this cannot read: the full start says what is wrong
        return None
    if runtime["allocator"] not in (*ALLOCATORS, "system") or runtime["openmp"] not in ("auto", "gnu",
                                                                                         *OPENMP_LIBRARIES):
        return None
    report = check(SimpleNamespace(**runtime), platform.machine(), env, dirs, maps)
    if all(path in report.loaded for path in report.preload):
        return None
    return {**env, "LD_PRELOAD": preload_env(report, env)["LD_PRELOAD"], EARLY_MARKER: "1"}


def reexec_early(argv: list[str]) -> None:
    """Re-execute `python -m app ARGV` with its libraries preloaded, if `early_preload_env` says to."""
    env = dict(os.environ)
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return
    target = early_preload_env(argv, env, _search_dirs(env), maps)
    if target is not None:
        _reexecute(target)
