"""Thread pinning and memory binding, checked in a child process through /proc."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

CHILD = """
import json, os, re, sys
import torch
from app import kernels
cpus = json.loads(sys.argv[1])
report = kernels.bind_threads(cpus, [0])
tids = [int(t) for t in re.findall(r"tid (\\d+)", report)]
allowed = {t: open(f"/proc/self/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0] for t in tids}
print(json.dumps({"report": report, "allowed": allowed, "main": sorted(os.sched_getaffinity(0)),
                  "torch_threads": torch.get_num_threads()}))
"""


def _bind(cpus: list[int]) -> dict:
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cpus)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_each_openmp_thread_is_pinned_to_its_cpu():
    result = _bind([1, 0])
    tids = [int(t) for t in re.findall(r"tid (\d+)", result["report"])]
    assert len(tids) == 2 and len(set(tids)) == 2
    assert [result["allowed"][str(t)] for t in tids] == ["1", "0"]  # thread i on cpus[i]
    assert result["main"] == [1]  # thread 0 is the calling thread
    assert result["torch_threads"] == 2
    assert "memory: bound to NUMA node(s) 0" in result["report"]


def test_one_cpu():
    result = _bind([0])
    assert result["main"] == [0] and result["torch_threads"] == 1
    assert result["report"].startswith("threads: 1 OpenMP thread(s) pinned")


def test_bad_arguments_are_value_errors():
    from app import kernels

    with pytest.raises(ValueError, match="cpus must not be empty"):
        kernels.bind_threads([])
    with pytest.raises(ValueError, match="CPU -3 is out of range"):
        kernels.bind_threads([-3])


POLICY_CHILD = """
import json, os, re, sys, threading
import torch
from app import kernels
torch.set_num_threads(2)
torch.ones(256, 256) @ torch.ones(256, 256)  # the OpenMP pool exists before binding, as in an engine process
cpus = sorted(os.sched_getaffinity(0))
before = kernels.memory_nodes()
report = kernels.bind_threads([cpus[0], cpus[-1]], [0], sys.argv[1] == "interleave")  # two threads, one CPU or two
tids = [int(t) for t in re.findall(r"tid (\\d+)", report)]
# a thread's numa_maps shows its own policy for every mapping that has none of its own
policies = {t: sorted({line.split()[1] for line in open(f"/proc/self/task/{t}/numa_maps")}) for t in tids}
started = []  # a thread started after binding inherits the calling thread's policy (the KV residency thread)
thread = threading.Thread(target=lambda: started.append(kernels.memory_nodes()))
thread.start(), thread.join()
print(json.dumps({"report": report, "policies": policies, "nodes": [before, kernels.memory_nodes(), started[0]]}))
"""


@pytest.mark.parametrize("policy", ["interleave", "bind"])
def test_every_openmp_thread_gets_the_memory_policy_even_when_the_pool_existed_before(policy):
    child = subprocess.run([sys.executable, "-c", POLICY_CHILD, policy], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(result["policies"]) == 2
    for tid, policies in result["policies"].items():
        assert f"{policy}:0" in policies, f"thread {tid} kept {policies}"
    assert "on 2 of 2 thread(s)" in result["report"]
    assert result["nodes"] == [None, [0], [0]]  # kernels.memory_nodes: the default policy, then the binding's node


RUNTIME_CHILD = """
import json, os
import torch
from app import kernels
x = torch.ones(64, 4096)
kernels.rms_norm(x, torch.ones(4096), 1e-6)  # a parallel region: the runtime starts its threads and binds them
masks = {}
for task in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{task}/status").read()
    masks[task] = status.split("Cpus_allowed_list:")[1].split()[0]
print(json.dumps({"main": masks.pop(str(os.getpid())), "others": sorted(masks.values())}))
"""


@pytest.mark.parametrize("runtime", ["gnu", "llvm", "intel"])
def test_each_openmp_runtime_pins_its_threads_from_the_plans_environment(runtime):
    """The plan's OpenMP variables alone (no bind_threads) put thread i on cpus[i], with the runtime preloaded as
    the bootstrap does; LLVM's libomp 16 put every thread on cpus[0] with OMP_PLACES (app/placement/openmp.py)."""
    import os

    from app.bootstrap.preflight import OPENMP_LIBRARIES, _named, default_search_dirs, find_library
    from app.placement.openmp import openmp_env

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY", "LD_PRELOAD"):
        env.pop(name, None)
    if runtime != "gnu":  # GNU's is torch's own libgomp
        library = find_library(OPENMP_LIBRARIES[runtime], default_search_dirs())
        if library is None:
            pytest.skip(f"no {runtime} OpenMP runtime on this machine")
        if runtime == "intel" and _named(library) != "intel":
            pytest.skip(f"libiomp5.so here is LLVM's libomp ({library}), which the llvm case runs")
        env["LD_PRELOAD"] = library
    cpus = [allowed[1], allowed[0]]  # not in order: thread 0 on the higher CPU
    env.update(openmp_env(runtime, tuple(cpus)))
    child = subprocess.run([sys.executable, "-c", RUNTIME_CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    assert "OMP: Warning" not in child.stderr, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["main"] == str(cpus[0])
    assert str(cpus[1]) in result["others"], result  # the second OpenMP thread, on the other CPU
