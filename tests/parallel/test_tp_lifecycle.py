"""No process and no shared-memory segment outlives the appliance, however it ends (tp=2 here)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import BASE_SPEC, Appliance


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = task / "children"
            if children.exists():
                for child in map(int, children.read_text().split()):
                    if child not in found:
                        found.add(child)
                        todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(("appliance-tp-", "sem.mp-", "__KMP_REGISTERED_LIB"))}


def _load(app: Appliance, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            httpx.post(app.url + "/v1/completions", json={"prompt": "Count to fifty:", "max_tokens": 64}, timeout=30)
        except httpx.HTTPError:
            time.sleep(0.1)


@pytest.mark.parametrize("how", ["SIGTERM during load", "SIGKILL of the supervisor"])
def test_nothing_survives(tmp_path, how):
    shm_before = _shm()
    app = Appliance(tmp_path, BASE_SPEC, sets=("parallel.tp=2", "cores.reserve_frontend=0")).wait_ready()
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(app, stop)) for _ in range(3)]
    for t in loaders:
        t.start()
    time.sleep(2)
    children = _descendants(app.process.pid)
    assert len(children) >= 4  # engine, its TP worker, gunicorn master and worker (and the spawn tracker)
    app.process.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)
    app.process.wait(60)
    stop.set()
    for t in loaders:
        t.join(60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)], app.logs()[-2000:]
    assert _shm() <= shm_before
    if how.startswith("SIGTERM"):
        assert app.process.returncode == 0
    app.stop()
