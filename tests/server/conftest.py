"""Black-box tests start the real appliance (`python -m app serve`) as a child process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO

# float32 activations (the cache's "auto" is then float16, as the offline references here take it) and a small
# cache: quick to start
BASE_SPEC = """
model:
  dtype: float32
  name: smollm2
kv_cache:
  memory: 512MiB
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Appliance:
    started: list[Appliance] = []  # every one this test run, so that a failed test's can be stopped after it

    def __init__(self, tmp: Path, spec: str = BASE_SPEC, sets: tuple[str, ...] = (), env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"appliance-{self.port}.log"
        self.spec_path = spec_path = tmp / f"spec-{self.port}.yaml"
        spec_path.write_text(spec)
        args = [sys.executable, "-m", "app", "serve", "-c", str(spec_path), "--set", f"server.port={self.port}",
                "--set", "server.host=127.0.0.1"]
        for s in sets:
            args += ["--set", s]
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        Appliance.started.append(self)

    def wait_ready(self, timeout: float = 120) -> Appliance:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the appliance exited ({self.process.returncode}):\n{self.logs()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"not ready in {timeout} s:\n{self.logs()[-4000:]}")

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        return int(re.search(r"engine process started \(pid (\d+)\)", self.logs()).group(1))

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))


@pytest.fixture(autouse=True)
def _no_appliance_outlives_its_test():
    """A test that fails between starting an appliance and stopping it would leave it serving (and its engine
    holding a core) for the rest of the run: stopped here. The package's shared one was started before."""
    before = len(Appliance.started)
    yield
    for app in Appliance.started[before:]:
        app.stop(timeout=30)
    del Appliance.started[before:]


@pytest.fixture(scope="package")
def appliance(tmp_path_factory):
    app = Appliance(tmp_path_factory.mktemp("appliance")).wait_ready()
    yield app
    assert app.stop() == 0, app.logs()[-3000:]
