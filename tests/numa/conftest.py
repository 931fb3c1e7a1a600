"""The NUMA guest (qemu, ../shared/tools/numa-vm; two nodes of two CPUs unless asked otherwise): `run_in_guest(*command)`
boots it and runs the command.

CI sets APPLIANCE_REQUIRE_NUMA_VM=1 so that a missing tool fails instead of skipping.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO

NUMA_VM = REPO.parent / "shared" / "tools" / "numa-vm"


@pytest.fixture(scope="module")
def run_in_guest():
    if not (NUMA_VM / "run.sh").is_file():
        if os.environ.get("APPLIANCE_REQUIRE_NUMA_VM") == "1":
            pytest.fail(f"{NUMA_VM}/run.sh is missing but APPLIANCE_REQUIRE_NUMA_VM=1")
        pytest.skip(f"no NUMA guest tool at {NUMA_VM}")

    def run(*command: str, mem: str = "2G", cpu: str = "max", timeout: int = 300, nodes: int = 2,
            cpus_per_node: int = 2, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`command` in the guest, with this process's environment (and `env`: the guest gets what run.sh gets)."""
        return subprocess.run(["bash", str(NUMA_VM / "run.sh"), "--nodes", str(nodes), "--cpus-per-node",
                               str(cpus_per_node), "--mem-per-node", mem, "--cpu", cpu, "--timeout", str(timeout),
                               "--", *command], cwd=REPO, capture_output=True, text=True, timeout=timeout + 100,
                              env={**os.environ, **(env or {})})

    return run
