"""The runtime directory of one `serve`: IPC sockets, metrics files, the draining marker, child pids.

It is private (0700) under the temp directory and holds no secret (the API key reaches the workers in
their environment). The supervisor removes it on every exit path it survives, together with the
files that Intel's and LLVM's OpenMP runtimes keep in /dev/shm per process
(`__KMP_REGISTERED_LIB_<pid>[_<uid>]`), which stay behind when a process does not exit cleanly. A
supervisor that was itself killed cannot clean up, so every start first removes what runs whose
supervisor is gone left behind: their directories and the OpenMP files of the pids they recorded.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("app.bootstrap")

RUNTIME_VARIABLE = "APPLIANCE_RUNTIME_DIR"  # tells the frontend's gunicorn where to record its workers
PREFIX = "appliance-"
SHARED_MEMORY = Path("/dev/shm")
OPENMP_SHM_PREFIX = "__KMP_REGISTERED_LIB_"


@dataclass(frozen=True)
class RuntimeDir:
    path: Path

    @classmethod
    def create(cls, parent: Path | None = None, shm: Path = SHARED_MEMORY) -> RuntimeDir:
        parent = parent or Path(tempfile.gettempdir())
        remove_stale(parent, shm)
        runtime = cls(Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent)))
        (runtime.path / "metrics").mkdir()
        (runtime.path / "pids").mkdir()
        (runtime.path / "supervisor").write_text(str(os.getpid()))
        runtime.record_pid(os.getpid())
        return runtime

    def record_pid(self, pid: int) -> None:
        record_pid(self.path, pid)

    def pids(self) -> set[int]:
        folder = self.path / "pids"
        return {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if folder.is_dir() else set()

    def remove(self, pids: set[int] = frozenset(), shm: Path = SHARED_MEMORY) -> None:
        """The directory and the OpenMP shared-memory files of every recorded process that has exited."""
        for pid in self.pids() | set(pids):
            if pid != os.getpid() and not _alive(pid):  # ours goes when this process's OpenMP unloads
                remove_openmp_files(pid, shm)
        shutil.rmtree(self.path, ignore_errors=True)


def record_pid(runtime: Path, pid: int) -> None:
    (runtime / "pids" / str(pid)).touch()


def remove_openmp_files(pid: int, shm: Path = SHARED_MEMORY) -> None:
    for name in (f"{OPENMP_SHM_PREFIX}{pid}", f"{OPENMP_SHM_PREFIX}{pid}_{os.getuid()}"):
        try:
            (shm / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("could not remove %s: %s", shm / name, exc)


def remove_stale(parent: Path, shm: Path = SHARED_MEMORY) -> None:
    """Runtime directories of this user whose supervisor is no longer running."""
    for path in parent.glob(PREFIX + "*"):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            owner = int((path / "supervisor").read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or still being created
        if owner != os.getpid() and _alive(owner):
            continue
        log.info("removing %s, left by a run that stopped without cleaning up", path)
        stale = RuntimeDir(path)
        stale.remove({p for p in stale.pids() if p != os.getpid()}, shm)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
