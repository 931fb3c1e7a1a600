"""`plan`, binding and kernel dispatch inside a real two-node NUMA Linux guest: about 15 s a boot."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.numa.conftest import NUMA_VM

pytestmark = pytest.mark.numa_vm


def _plan(child: subprocess.CompletedProcess) -> dict:
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout)


def test_tp2_is_placed_on_nodes_0_and_1(run_in_guest):
    plan = _plan(run_in_guest(sys.executable, "-m", "app", "plan", "-c", "config/tp2-numa.yaml", "--json"))
    assert plan["machine"]["numa_nodes"] == [0, 1]
    assert [(r["node"], r["memory_policy"]) for r in plan["ranks"]] == [(0, "bind"), (1, "bind")]
    assert plan["ranks"][0]["cpus"] == [0, 1] and plan["ranks"][1]["cpus"] == [2, 3]
    assert plan["frontend_shared"] and plan["frontend_cpulist"] == "0-3"  # 4 CPUs: "auto" reserves none


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


def _kernel_sums(child: subprocess.CompletedProcess) -> dict:
    assert child.returncode == 0, f"exit {child.returncode} (-4 or 132: SIGILL)\n" + child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("cpu", "best"), [("max", "avx2"), ("Westmere", "portable")])
def test_every_kernel_runs_on_an_older_cpu_as_on_this_one(run_in_guest, cpu, best):
    # qemu's "max" CPU has AVX2 but no AVX-512; Westmere has no AVX at all: no SIGILL on either (an
    # AVX-512 copy of std::vector code shared by every ISA's kernels was one), and the same results
    script = "tests/numa/guest_kernels.py"
    host = _kernel_sums(subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=60))
    guest = _kernel_sums(run_in_guest(sys.executable, script, cpu=cpu))
    assert guest["best"] == best and list(guest["sums"])[0] == best
    reference = host["sums"]["portable"]
    for isa, sums in guest["sums"].items():
        assert sums.keys() == reference.keys()
        for kernel, (total, magnitude) in sums.items():
            ref_total, ref_magnitude = reference[kernel]
            assert abs(total - ref_total) <= 1e-3 * ref_magnitude and abs(magnitude - ref_magnitude) <= 1e-3 * ref_magnitude, \
                (isa, kernel, sums[kernel], reference[kernel])
