"""Preflight: which libraries get preloaded, the warnings when they are missing, and the real re-exec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.bootstrap.preflight import (ALLOCATORS, RUNTIME_DEFAULTS, check, default_search_dirs, early_preload_env,
                                     find_library, preload_env)
from app.spec.schema import RuntimeSpec
from tests.conftest import CONFIG, run_app


def _libs(tmp_path: Path, *names: str) -> list[str]:
    for name in names:
        (tmp_path / name).write_bytes(b"")
    return [str(tmp_path)]


def test_allocator_found_is_preloaded(tmp_path):
    dirs = _libs(tmp_path, "libjemalloc.so.2", "libnuma.so.1")
    report = check(RuntimeSpec(), "x86_64", {}, dirs, maps="")
    assert report.preload == [str(tmp_path / "libjemalloc.so.2")]
    assert report.needs_reexec and report.warnings == []
    env = preload_env(report, {"LD_PRELOAD": "/other.so"})
    assert env["LD_PRELOAD"] == f"{tmp_path / 'libjemalloc.so.2'} /other.so" and env["APPLIANCE_PRELOAD_REEXEC"] == "1"


def test_already_loaded_needs_no_reexec(tmp_path):
    dirs = _libs(tmp_path, "libjemalloc.so.2", "libnuma.so.1")
    maps = f"7f00-7f01 r-xp 00000000 08:01 42 {tmp_path / 'libjemalloc.so.2'}\n"
    assert not check(RuntimeSpec(), "x86_64", {}, dirs, maps).needs_reexec


@pytest.mark.parametrize(("allocator", "package"), [("jemalloc", "libjemalloc2"), ("tcmalloc", "libtcmalloc-minimal4")])
def test_missing_allocator_warns_with_the_package(tmp_path, allocator, package):
    report = check(RuntimeSpec(allocator=allocator), "x86_64", {}, _libs(tmp_path, "libnuma.so.1"), "")
    assert report.preload == [] and not report.needs_reexec
    assert report.warnings == [f"runtime.allocator is {allocator} but it is not installed; running with glibc "
                               f"malloc (install it: apt-get install {package})"]


def test_system_allocator_preloads_nothing(tmp_path):
    report = check(RuntimeSpec(allocator="system"), "x86_64", {}, _libs(tmp_path, "libjemalloc.so.2", "libnuma.so.1"), "")
    assert report.preload == [] and report.warnings == []


def test_an_allocator_the_user_preloaded_that_the_spec_does_not_use_is_named(tmp_path):
    """vLLM's docs have users preload tcmalloc; the spec's jemalloc goes ahead of it and wins: said, with the fix."""
    dirs = _libs(tmp_path, "libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libnuma.so.1")
    theirs = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    report = check(RuntimeSpec(), "x86_64", {"LD_PRELOAD": theirs}, dirs, "")
    assert report.warnings == [f"LD_PRELOAD holds {theirs}, but runtime.allocator is jemalloc, which is preloaded "
                               f"ahead of it and is the one in use: set runtime.allocator to use yours (or \"system\" "
                               f"to leave LD_PRELOAD as it is)"]
    for spec in (RuntimeSpec(allocator="tcmalloc"), RuntimeSpec(allocator="system")):  # theirs is used: nothing said
        assert check(spec, "x86_64", {"LD_PRELOAD": theirs}, dirs, "").warnings == []


def test_intel_openmp_is_preferred_on_x86_when_installed(tmp_path):
    dirs = _libs(tmp_path, "libjemalloc.so.2", "libiomp5.so", "libnuma.so.1")
    report = check(RuntimeSpec(), "x86_64", {}, dirs, "")
    assert report.openmp_runtime == "intel"
    assert report.preload == [str(tmp_path / "libjemalloc.so.2"), str(tmp_path / "libiomp5.so")]
    assert check(RuntimeSpec(), "aarch64", {}, dirs, "").openmp_runtime == "gnu"
    assert check(RuntimeSpec(openmp="gnu"), "x86_64", {}, dirs, "").openmp_runtime == "gnu"


def test_libiomp5_that_is_llvms_libomp_is_named_llvm(tmp_path):
    """Debian's libomp-dev installs libiomp5.so as a link to LLVM's libomp.so.5: preloaded, and named for it."""
    dirs = _libs(tmp_path, "libjemalloc.so.2", "libomp.so.5", "libnuma.so.1")
    (tmp_path / "libiomp5.so").symlink_to("libomp.so.5")
    report = check(RuntimeSpec(), "x86_64", {}, dirs, "")
    assert report.openmp_runtime == "llvm" and report.warnings == []
    assert report.preload == [str(tmp_path / "libjemalloc.so.2"), str(tmp_path / "libomp.so.5")]
    asked = check(RuntimeSpec(openmp="intel"), "x86_64", {}, dirs, "")
    assert asked.openmp_runtime == "llvm" and asked.preload == report.preload
    assert asked.warnings == [f"runtime.openmp is intel but libiomp5.so here is LLVM's libomp "
                              f"({tmp_path / 'libomp.so.5'}); using it as llvm (install Intel's: pip install intel-openmp)"]


def test_forced_openmp_runtime_that_is_missing_falls_back_with_a_warning(tmp_path):
    report = check(RuntimeSpec(openmp="intel"), "x86_64", {}, _libs(tmp_path, "libnuma.so.1"), "")
    assert report.openmp_runtime == "gnu"
    assert "install it: pip install intel-openmp" in report.warnings[-1]


def test_missing_libnuma_warns(tmp_path):
    report = check(RuntimeSpec(allocator="system"), "x86_64", {}, _libs(tmp_path), "")
    assert report.warnings == ["libnuma is not installed: rank memory cannot be bound to NUMA nodes "
                               "(install it: apt-get install libnuma1)"]


def _early(tmp_path: Path, *argv: str, env: dict[str, str] | None = None, maps: str = "") -> dict[str, str] | None:
    dirs = _libs(tmp_path, "libjemalloc.so.2", "libtcmalloc_minimal.so.4", "libnuma.so.1")
    return early_preload_env(list(argv), {"LD_PRELOAD": "/other.so", **(env or {})}, dirs, maps)


def test_serve_preloads_before_its_spec_is_validated(tmp_path, tmp_spec):
    target = _early(tmp_path, "serve", "--port", "8001")  # every default: jemalloc
    assert target["LD_PRELOAD"] == f"{tmp_path / 'libjemalloc.so.2'} /other.so"
    # its own marker: the full preflight still re-executes (once) if this guess missed a library
    assert target["APPLIANCE_PRELOAD_EARLY"] == "1" and "APPLIANCE_PRELOAD_REEXEC" not in target
    spec = tmp_spec("runtime:\n  allocator: tcmalloc\nmodel: {dtype: bfloat16}\n")
    assert _early(tmp_path, "serve", "-c", spec)["LD_PRELOAD"].startswith(str(tmp_path / "libtcmalloc_minimal.so.4"))
    assert _early(tmp_path, "serve", f"--config={spec}", "--set", "runtime.allocator=jemalloc")["LD_PRELOAD"] \
        .startswith(str(tmp_path / "libjemalloc.so.2"))
    assert _early(tmp_path, "serve", "-c", spec, "--set", "runtime.allocator=system") is None  # nothing to preload


@pytest.mark.parametrize("case", ["not serve", "re-executed", "early already", "mapped", "no such spec", "not YAML",
                                  "runtime not a mapping", "unknown allocator"])
def test_no_early_reexec_where_there_is_nothing_to_do_or_the_spec_is_for_the_full_start(tmp_path, tmp_spec, case):
    """None of these re-execute early: the full start validates the spec and names what is wrong with it."""
    jemalloc = f"7f00-7f01 r-xp 00000000 08:01 42 {tmp_path / 'libjemalloc.so.2'}\n"
    argv, env, maps = {
        "not serve": (["plan"], {}, ""),
        "re-executed": (["serve"], {"APPLIANCE_PRELOAD_REEXEC": "1"}, ""),
        "early already": (["serve"], {"APPLIANCE_PRELOAD_EARLY": "1"}, ""),
        "mapped": (["serve"], {}, jemalloc),
        "no such spec": (["serve", "-c", str(tmp_path / "missing.yaml")], {}, ""),
        "not YAML": (["serve", "-c", tmp_spec("model: [unclosed\n")], {}, ""),
        "runtime not a mapping": (["serve", "-c", tmp_spec("runtime: 3\n")], {}, ""),
        "unknown allocator": (["serve", "--set", "runtime.allocator=mimalloc"], {}, ""),
    }[case]
    assert _early(tmp_path, *argv, env=env, maps=maps) is None


def test_the_early_defaults_are_the_specs():
    assert RUNTIME_DEFAULTS == {key: getattr(RuntimeSpec(), key) for key in RUNTIME_DEFAULTS}


def _preflight_child(env: dict[str, str] | None = None):
    child = run_app("preflight", "-c", str(CONFIG / "default.yaml"), "--json", env=env)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout), child.stderr


def test_child_reexecutes_with_jemalloc_preloaded():
    jemalloc = find_library(ALLOCATORS["jemalloc"], default_search_dirs())
    assert jemalloc, "libjemalloc2 is not installed: apt-get install libjemalloc2 (the README's test command does)"
    report, _ = _preflight_child({"LD_PRELOAD": "", "APPLIANCE_PRELOAD_REEXEC": ""})
    assert "libjemalloc" in report["ld_preload"]
    assert report["reexecuted"] is True
    assert report["loaded"] == report["preload"] and jemalloc in report["loaded"]  # mapped, not just named


def test_child_without_jemalloc_warns_and_does_not_reexec(tmp_path):
    report, stderr = _preflight_child({"LD_PRELOAD": "", "APPLIANCE_LIB_PATH": str(tmp_path)})
    assert report["reexecuted"] is False and report["preload"] == []
    assert "runtime.allocator is jemalloc but it is not installed" in stderr
    assert "apt-get install libjemalloc2" in stderr


def test_reexec_happens_once_even_when_the_library_will_not_load(tmp_path):
    (tmp_path / "libjemalloc.so.2").write_text("not a shared object")
    report, stderr = _preflight_child({"LD_PRELOAD": "", "APPLIANCE_LIB_PATH": str(tmp_path)})
    assert report["reexecuted"] is True and report["loaded"] == []
    assert "did not load; continuing without" in stderr


def test_a_missing_native_build_is_named_before_anything_starts(monkeypatch):
    """Run from the repository root, a non-editable install's `app` is shadowed by the source tree, which has
    no built kernels: the bootstrap says so, instead of an engine dying on an ImportError."""
    import importlib.util

    from app.bootstrap.isa import check_native_build
    from app.spec.errors import SpecError

    check_native_build()  # this checkout's are built
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "app._native" else real(name, *a))
    with pytest.raises(SpecError, match=r"\(build\).*no app\._native for the app package at .*app.*pip install -e \."):
        check_native_build()
