"""`plan` inside a real two-node NUMA Linux guest (qemu, ../shared/tools/numa-vm): about 15 s a boot.

CI sets APPLIANCE_REQUIRE_NUMA_VM=1 so that a missing tool fails instead of skipping.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

NUMA_VM = REPO.parent / "shared" / "tools" / "numa-vm"

pytestmark = pytest.mark.numa_vm


@pytest.fixture(scope="module")
def run_in_guest():
    if not (NUMA_VM / "run.sh").is_file():
        if os.environ.get("APPLIANCE_REQUIRE_NUMA_VM") == "1":
            pytest.fail(f"{NUMA_VM}/run.sh is missing but APPLIANCE_REQUIRE_NUMA_VM=1")
        pytest.skip(f"no NUMA guest tool at {NUMA_VM}")

    def run(*command: str, mem: str = "2G", cpu: str = "max") -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(NUMA_VM / "run.sh"), "--mem-per-node", mem, "--cpu", cpu, "--timeout",
                               "300", "--", *command], cwd=REPO, capture_output=True, text=True, timeout=400)

    return run


def _plan(child: subprocess.CompletedProcess) -> dict:
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout)


def test_tp2_is_placed_on_nodes_0_and_1(run_in_guest):
    plan = _plan(run_in_guest(sys.executable, "-m", "app", "plan", "-c", "config/tp2-numa.yaml", "--json"))
    assert plan["machine"]["numa_nodes"] == [0, 1]
    assert [(r["node"], r["memory_policy"]) for r in plan["ranks"]] == [(0, "bind"), (1, "bind")]
    assert plan["ranks"][0]["cpus"] == [0, 1] and plan["ranks"][1]["cpus"] == [2]  # CPU 3 is the frontend's
    assert plan["frontend_cpulist"] == "3"


def test_tp2_inside_a_kubelet_style_cpuset(run_in_guest):
    in_cpuset = str(NUMA_VM / "in-cpuset.sh")
    plan = _plan(run_in_guest(in_cpuset, "1-2", "0,1", "--memory-max", "3G", "--", sys.executable, "-m", "app",
                              "plan", "-c", "config/tp2-numa.yaml", "--set", "cores.reserve_frontend=0",
                              "--set", "model.max_model_len=4096", "--json"))
    assert plan["machine"]["allowed_cpus"] == "1-2" and plan["machine"]["memory_limit"] == 3 * 1024**3
    assert [(r["cpus"], r["node"]) for r in plan["ranks"]] == [([1], 0), ([2], 1)]


GUEST_BIND = """
import mmap, re, sys
import app._native as native  # the extension alone: importing torch takes a minute in the guest
print(native.bind_threads([2, 3], [1], False))
buf = mmap.mmap(-1, 64 << 20)
for offset in range(0, len(buf), 4096):
    buf[offset] = 1  # touch every page so it is allocated now, under the policy
address = hex(__import__("ctypes").addressof(__import__("ctypes").c_char.from_buffer(buf)))[2:]
line = next(l for l in open("/proc/self/numa_maps") if l.startswith(address))
print("NUMA_MAPS", line.strip())
"""


def test_threads_pinned_and_memory_bound_to_node_1(run_in_guest):
    child = run_in_guest(sys.executable, "-c", GUEST_BIND)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "thread 0 (tid" in child.stdout and "-> CPU 2" in child.stdout and "-> CPU 3" in child.stdout
    assert "memory: bound to NUMA node(s) 1" in child.stdout
    numa_maps = next(line for line in child.stdout.splitlines() if line.startswith("NUMA_MAPS"))
    assert " bind:1 " in numa_maps
    pages = dict(re.findall(r" N(\d+)=(\d+)", numa_maps))
    assert int(pages.get("1", 0)) >= 16384 and "0" not in pages  # all 64 MiB of pages on node 1


GUEST_DISPATCH = """
import array, math
import app._native as native  # raw buffers instead of torch tensors: no torch import in the guest
x = array.array("f", [float(i % 7 - 3) for i in range(2 * 37)])
w = array.array("f", [0.5 + i / 37 for i in range(37)])
ref = []
for t in range(2):
    row = x[t * 37:(t + 1) * 37]
    inv = 1 / math.sqrt(sum(v * v for v in row) / 37 + 1e-5)
    ref += [v * inv * w[i] for i, v in enumerate(row)]
print("BEST", native.best_isa(), native.isa())
for isa in [native.best_isa(), "portable"]:
    native.select_isa(isa)
    out = array.array("f", [0.0] * (2 * 37))
    ref_of = lambda buf, shape: (buf.buffer_info()[0], 0, shape, [shape[-1], 1] if len(shape) == 2 else [1])
    native.rms_norm(ref_of(out, [2, 37]), ref_of(x, [2, 37]), ref_of(w, [37]), 1e-5)
    print("DIFF", isa, max(abs(a - b) for a, b in zip(out, ref)))
"""


@pytest.mark.parametrize(("cpu", "best"), [("max", "avx2"), ("Westmere", "portable")])
def test_kernels_dispatch_to_what_an_older_cpu_has(run_in_guest, cpu, best):
    # qemu's "max" CPU has AVX2 but no AVX-512; Westmere has no AVX at all: no SIGILL on either.
    child = run_in_guest(sys.executable, "-c", GUEST_DISPATCH, cpu=cpu)
    assert child.returncode == 0, child.stderr[-3000:]
    assert f"BEST {best} {best}" in child.stdout
    diffs = [float(line.split()[2]) for line in child.stdout.splitlines() if line.startswith("DIFF")]
    assert len(diffs) == 2 and max(diffs) < 1e-5
