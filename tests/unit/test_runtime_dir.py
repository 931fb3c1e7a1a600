"""The runtime directory: removed with the OpenMP shared-memory files of its processes, and what a
killed run left behind is removed by the next start (real directories and processes, a stand-in shm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.bootstrap.runtime import RuntimeDir


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _kmp(shm: Path, pid: int) -> list[Path]:
    files = [shm / f"__KMP_REGISTERED_LIB_{pid}", shm / f"__KMP_REGISTERED_LIB_{pid}_{os.getuid()}"]
    for f in files:
        f.write_text("0x1-cafebabe-libomp.so")
    return files


def test_remove_takes_the_directory_and_the_openmp_files_of_exited_processes(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    runtime = RuntimeDir.create(tmp_path, shm)
    dead, alive = _dead_pid(), os.getppid()
    runtime.record_pid(dead)
    runtime.record_pid(alive)
    dead_files, alive_files, own_files = _kmp(shm, dead), _kmp(shm, alive), _kmp(shm, os.getpid())
    other = shm / "__KMP_REGISTERED_LIB_1234567"  # not a process of this run
    other.write_text("x")
    runtime.remove(shm=shm)
    assert not runtime.path.exists()
    assert not any(f.exists() for f in dead_files)
    assert all(f.exists() for f in alive_files + own_files + [other])  # running processes keep theirs


def test_a_start_removes_what_a_killed_run_left_behind(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = RuntimeDir.create(tmp_path, shm)
    supervisor, engine = _dead_pid(), _dead_pid()
    (stale.path / "supervisor").write_text(str(supervisor))  # as if a dead supervisor had made it
    stale.record_pid(engine)
    (stale.path / "engine-0.ipc").touch()
    leftovers = _kmp(shm, engine)
    running = RuntimeDir.create(tmp_path, shm)
    (running.path / "supervisor").write_text(str(os.getppid()))  # another live supervisor: it must stay
    unrelated = tmp_path / "appliance-not-ours"
    unrelated.mkdir()  # no supervisor file: not a runtime directory, left alone

    fresh = RuntimeDir.create(tmp_path, shm)  # (a directory of this very pid is stale too: PID 1 after a restart)
    assert not stale.path.exists() and not any(f.exists() for f in leftovers)
    assert running.path.exists() and unrelated.exists() and fresh.path.exists()
    assert oct(fresh.path.stat().st_mode & 0o777) == "0o700"
