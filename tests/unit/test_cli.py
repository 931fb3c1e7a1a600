"""`plan` output for people and for tools."""

from __future__ import annotations

import json

from app.placement.plan import make_plan
from app.spec.load import load_spec
from tests.conftest import CONFIG, SMOLLM2, TOPOLOGIES, run_cli, topology


def test_plan_json_is_the_plan():
    result = run_cli("plan", "-c", str(CONFIG / "default.yaml"), "--root", str(TOPOLOGIES / "1s-4n-nps4"),
                     "--set", "parallel.tp=2", "--set", "runtime.openmp=intel", "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    expected = make_plan(load_spec(CONFIG / "default.yaml", ["parallel.tp=2", "runtime.openmp=intel"]),
                         topology("1s-4n-nps4"), SMOLLM2)
    assert [r["cpus"] for r in data["ranks"]] == [list(r.cpus) for r in expected.ranks]
    assert [r["kv_blocks"] for r in data["ranks"]] == [r.kv_blocks for r in expected.ranks]
    assert data["ranks"][1]["openmp_env"]["KMP_AFFINITY"] == "granularity=fine,explicit,proclist=[8,9,10,11,12,13,14,15]"
    assert data["frontend_cpulist"] == "63" and data["model"]["num_params"] == 134_515_008
    assert data["machine"]["numa_nodes"] == [0, 1, 2, 3]


def test_plan_table_shows_ranks_frontend_env_and_warnings():
    # The runtime is given: "auto" would depend on which OpenMP libraries this host has installed.
    result = run_cli("plan", "--root", str(TOPOLOGIES / "k8s-cpuset8-smt"), "--set", "parallel.dp=2",
                     "--set", "runtime.openmp=gnu")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("replica"))
    assert lines[header + 1].split()[:7] == ["0", "0", "9/3", "4-5", "2", "bind", "0"]
    assert lines[header + 2].split()[:7] == ["1", "0", "9/3", "6-7", "2", "bind", "0"]
    assert "frontend CPUs 39" in result.out
    assert "1/0  OMP_NUM_THREADS=2 GOMP_CPU_AFFINITY='6 7'" in result.out
    assert "auto chose float32" in result.out and "cgroup memory 16.00 GiB" in result.out


def test_plan_on_this_machine_without_root():
    result = run_cli("plan", "-c", str(CONFIG / "default.yaml"))
    assert result.code == 0, result.err
    assert "SmolLM2-135M-Instruct" in result.out and "OMP_NUM_THREADS=" in result.out


def test_plan_on_a_machine_without_any_memory_figure_exits_2_naming_the_files():
    result = run_cli("plan", "--root", str(TOPOLOGIES / "no-meminfo"))
    assert result.code == 2 and "Traceback" not in result.err
    assert "(machine): found no MemTotal in" in result.err and "no-meminfo/proc/meminfo" in result.err


def test_serve_port_and_host_are_the_spec_values_they_stand_for():
    # vLLM's and llama-server's `--port`/`--host`: short for --set server.port/host, checked by the spec
    # before any process starts (a valid port would start the server, so the values here are invalid).
    result = run_cli("serve", "-c", str(CONFIG / "default.yaml"), "--host", "", "--port", "70000")
    assert result.code == 2 and "Traceback" not in result.err
    assert "server.port: found 70000; allowed: an integer from 1 to 65535" in result.err
    assert "server.host: found ''" in result.err
    assert run_cli("serve", "--port", "eighty").code == 2


def test_serve_logs_the_plan_and_each_warning_once(caplog):
    """`serve` logs the plan's table at INFO and its warnings at WARNING, each once (the table leaves them out)."""
    import logging

    from app.bootstrap.serve import _log_plan
    from app.bootstrap.startup import prepare

    deployment = prepare(CONFIG / "default.yaml", ["parallel.tp=2", "runtime.openmp=gnu"],
                         root=TOPOLOGIES / "1s-4n-nps4")
    assert deployment.plan.warnings  # tp=2 does not divide SmolLM2's 9 heads
    with caplog.at_level(logging.INFO, logger="app"):
        _log_plan(deployment)
    for warning in deployment.plan.warnings:
        said = [r for r in caplog.records if warning in r.getMessage()]
        assert [r.levelname for r in said] == ["WARNING"], warning
    assert any("OMP_NUM_THREADS=" in r.getMessage() for r in caplog.records if r.levelname == "INFO")
