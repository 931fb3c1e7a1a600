"""The image and `docker compose up`, built and run for real with ../shared/tools/containers (a private dockerd
with the compose plugin; local stand-ins for the python:3.11-slim-bookworm base image).

About 6 minutes on two cores, most of it one build: `docker compose build`, as a user runs it, makes the image
every test here runs (BuildKit, Dockerfile.cpu). A second builder (buildah) would build the same Dockerfile
again for 6 more minutes and test nothing more of ours. CI sets APPLIANCE_REQUIRE_CONTAINERS=1 so that a missing
tool fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import string
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.server.conftest import free_port

TOOLS = REPO.parent / "shared" / "tools" / "containers"
HADOLINT = str(Path(sys.executable).parent / "hadolint")
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 24}


def _env_from(script_output: str, base: Mapping[str, str]) -> dict[str, str]:
    """`base` with the `export K='V'` lines the tools print applied (`"$PATH"` expands from `base`)."""
    env = dict(base)
    for line in script_output.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = string.Template(shlex.split(value)[0]).safe_substitute(env) if value else ""
    return env


@pytest.fixture(scope="module")
def containers():
    if not (TOOLS / "setup.sh").is_file() or os.geteuid() != 0:
        if os.environ.get("APPLIANCE_REQUIRE_CONTAINERS") == "1":
            pytest.fail(f"{TOOLS}/setup.sh is missing or not root, but APPLIANCE_REQUIRE_CONTAINERS=1")
        pytest.skip(f"no container tools at {TOOLS} (or not root)")
    setup = subprocess.run(["bash", str(TOOLS / "setup.sh")], capture_output=True, text=True, timeout=900)
    assert setup.returncode == 0, setup.stderr[-3000:]
    env = _env_from(setup.stdout, os.environ)
    base = subprocess.run(["bash", str(TOOLS / "base-images.sh"), "amd64"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert base.returncode == 0, base.stderr[-3000:]
    return env


def _run(env: dict, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    child = subprocess.run(list(args), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check:
        assert child.returncode == 0, f"{' '.join(args)}: exit {child.returncode}\n{child.stdout[-2000:]}\n{child.stderr[-3000:]}"
    return child


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.arm"])
def test_the_dockerfiles_pass_hadolint(dockerfile):
    lint = subprocess.run([HADOLINT, dockerfile], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def _wait_healthy(url: str, timeout: float = 300) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy in {timeout} s")


@pytest.fixture(scope="module")
def docker(containers):
    _run(containers, "bash", str(TOOLS / "dockerd.sh"), "start", timeout=600)
    env = _env_from(_run(containers, "bash", str(TOOLS / "dockerd.sh"), "env").stdout, containers)
    # What earlier builds left goes first (each build moves the tag and leaves ~1.7 GB untagged; they once filled
    # the disk); BuildKit's cache keeps its most recent 4 GB, torch's layer among them.
    _run(env, "docker", "image", "prune", "-f", timeout=600)
    _run(env, "docker", "builder", "prune", "-f", "--keep-storage", "4GB", timeout=600)
    yield {**env, "COMPOSE_PROJECT_NAME": "appliance-test"}
    _run(env, "docker", "rm", "-f", "appliance-test", check=False)
    _run(env, "bash", str(TOOLS / "dockerd.sh"), "stop", timeout=300, check=False)


@pytest.fixture(scope="module")
def image(docker) -> str:
    """compose.yaml's image (appliance:cpu), built as `docker compose build` builds it."""
    _run(docker, "docker", "compose", "config", "--quiet")
    started = time.monotonic()
    # TORCH_INDEX_URL empty: the stand-in base image finds torch 2.13.0+cpu in its /opt/wheels (no other index here)
    _run(docker, "docker", "compose", "build", "--build-arg", "TORCH_INDEX_URL=", timeout=1800)
    image = _run(docker, "docker", "compose", "config", "--images").stdout.split()[0]
    size = _run(docker, "docker", "image", "inspect", image, "--format", "{{.Size}}").stdout.strip()
    print(f"\n{image}: built in {time.monotonic() - started:.0f} s, {int(size) / 2**30:.2f} GiB")
    return image


def test_the_image_serves_as_non_root_on_a_read_only_root_and_stops_within_seconds(docker, image):
    # On the host's network, the default command serves on port 8000 (the sandbox's bridge does not forward -p).
    # As the chart runs it: a read-only root, with empty writable volumes on /tmp, on $HOME and on the
    # calibration cache (an emptyDir: world-writable)
    _run(docker, "docker", "run", "-d", "--name", "appliance-test", "--network", "host", "--read-only",
         "--tmpfs", "/tmp", "--tmpfs", "/var/lib/appliance:uid=10001,gid=10001",
         "--tmpfs", "/var/cache/appliance/calibration:mode=1777", image)
    try:
        ready = _wait_healthy("http://127.0.0.1:8000")
        print(f"\nimage ready in {ready:.0f} s")
        child = _run(docker, "docker", "logs", "appliance-test")
        logs = child.stdout + child.stderr
        # the tokenizer the image's build converted, not hidden by the empty $HOME
        assert "tokenizer exported for the HTTP frontend" in logs and "(copied from the cache)" in logs, logs[-3000:]
        # the step cost's fit was kept where the chart's emptyDir is, for the container's next start in the pod
        kept = _run(docker, "docker", "exec", "appliance-test", "ls", "/var/cache/appliance/calibration").stdout
        assert [name for name in kept.split() if name.endswith(".json")], kept
        answer = httpx.post("http://127.0.0.1:8000/v1/chat/completions", json=CHAT, timeout=120).json()
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
        top = _run(docker, "docker", "top", "appliance-test", "-o", "uid,pid").stdout.splitlines()[1:]
        uids = [line.split()[0] for line in top]
        assert uids and set(uids) == {"10001"}, uids  # every process, PID 1 (tini) included: the image's user
        # SIGHUP passes through tini to the bootstrap: the unchanged spec is read again, nothing restarts
        _run(docker, "docker", "kill", "--signal", "HUP", "appliance-test")
        deadline, logs = time.monotonic() + 30, ""
        while "nothing the engines use has changed" not in logs and time.monotonic() < deadline:
            time.sleep(0.5)
            child = _run(docker, "docker", "logs", "appliance-test")
            logs = child.stdout + child.stderr
        assert "nothing the engines use has changed" in logs, logs[-3000:]
        started = time.monotonic()
        _run(docker, "docker", "stop", "appliance-test", timeout=60)  # SIGTERM, then 10 s before SIGKILL
        stopped = time.monotonic() - started
        code = _run(docker, "docker", "inspect", "appliance-test", "--format", "{{.State.ExitCode}}").stdout
        assert stopped < 5 and code.strip() == "0", (stopped, code)
    finally:
        _run(docker, "docker", "rm", "-f", "appliance-test", check=False)


def test_the_image_serves_tensor_parallel_ranks(docker, image):
    """tp 2: each worker rank loads the native kernels before torch (the image had lacked the GNU OpenMP library they
    link, which only torch's import had brought: every tp spec failed at start)."""
    port = free_port()
    _run(docker, "docker", "run", "-d", "--name", "appliance-test-tp", "--network", "host", "--shm-size", "64m", image,
         "serve", "-c", "/etc/appliance/spec.yaml", "--set", "parallel.tp=2", "--set", f"server.port={port}")
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=120).json()
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
    finally:
        _run(docker, "docker", "rm", "-f", "appliance-test-tp", check=False)


def test_the_image_plans_inside_its_cpuset(docker, image):
    child = _run(docker, "docker", "run", "--rm", "--network", "host", "--cpuset-cpus=1", image, "plan", "-c",
                 "/etc/appliance/spec.yaml", "--json")
    plan = json.loads(child.stdout[child.stdout.index("{"):])
    assert plan["machine"]["allowed_cpus"] == "1" and [r["cpus"] for r in plan["ranks"]] == [[1]]


def test_compose_up_serves_and_down_leaves_nothing(docker, image):
    port = free_port()
    env = {**docker, "APPLIANCE_PORT": str(port)}
    try:
        up = _run(env, "docker", "compose", "up", "-d", "--wait", "--wait-timeout", "300", timeout=400)
        assert "Healthy" in up.stdout + up.stderr
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                            json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).json()
        assert "Paris" in answer["choices"][0]["text"], answer
        logs = _run(env, "docker", "compose", "logs").stdout
        # cap_add SYS_NICE is enough under Docker's default seccomp profile: memory is bound on every thread
        assert re.search(r"memory: bound to NUMA node\(s\) \S+ on (\d+) of \1 thread", logs), logs[-3000:]
    finally:
        _run(env, "docker", "compose", "down", timeout=120)
    assert _run(env, "docker", "ps", "-a", "--filter", "label=com.docker.compose.project=appliance-test",
                "--format", "{{.Names}}").stdout.strip() == ""
