"""Placement plans on captured machines, asserted exactly (CPUs per rank, node, frontend, OpenMP env).

The expectations are written out by hand from the rules in app/placement/cores.py's docstring.
"""

from __future__ import annotations

import pytest

from app.placement.memory import RUNTIME_RESERVE
from app.placement.plan import make_plan
from app.spec.errors import SpecError
from app.spec.load import parse_spec
from app.topology.cpulist import format_cpulist as fmt
from app.topology.cpulist import parse_cpulist
from tests.conftest import REPO, SMOLLM2, topology

SPECS = {
    "tp1": "parallel: {tp: 1}",
    "tp2": "parallel: {tp: 2}",
    "dp2": "parallel: {dp: 2}",
    "tp2dp2": "parallel: {tp: 2, dp: 2}",
}
EXPLICIT = {  # machine -> the explicit spec tried on it (tp=2, two lists)
    "2s-2n-32c-smt2": "0-31|32-63", "1s-4n-nps4": "0-3|4-7", "k8s-cpuset8-smt": "4-5|6-7",
    "memory-only-node": "0-7|8-15", "arm64-64c": "0-31|32-63", "offline-cpus": "0-4|6-7",
    "this-machine": "0|1", "numa-vm-2node": "0-1|2-3", "numa-vm-cpuset": "1|2",
    "old-kernel-masks": "0-4|16-20", "offline-node-links": "0-5|6-11", "cpuset-v1-noprefix": "2-3|4-5",
    "same-cpus-every-node": "0-15|16-31", "hybrid-8p16e": "0,2,4,6|8,10,12,14", "arm-biglittle-4x4": "4-5|6-7",
}
ERROR = "error"
NO_MEMORY = "no memory"  # the CPUs are there, but a node cannot hold its ranks' weights and runtime
SHARED = "shared"

# machine -> spec -> ([(cpus, node) per rank, replica-major], frontend CPUs or SHARED) or ERROR
EXPECTED = {
    "2s-2n-32c-smt2": {
        "tp1": ([("0-31", 0)], "127"),
        "tp2": ([("0-31", 0), ("32-63", 1)], "127"),
        "dp2": ([("0-31", 0), ("32-63", 1)], "127"),
        "tp2dp2": ([("0-15", 0), ("16-31", 0), ("32-47", 1), ("48-63", 1)], "127"),
        "explicit": ([("0-31", 0), ("32-63", 1)], "64-127"),
    },
    "1s-4n-nps4": {
        "tp1": ([("0-7", 0)], "63"),
        "tp2": ([("0-7", 0), ("8-15", 1)], "63"),
        "dp2": ([("0-7", 0), ("8-15", 1)], "63"),
        "tp2dp2": ([("0-7", 0), ("8-15", 1), ("16-23", 2), ("24-31", 3)], "63"),
        "explicit": ([("0-3", 0), ("4-7", 0)], "8-63"),
    },
    "k8s-cpuset8-smt": {
        "tp1": ([("4-7", 0)], "39"),
        "tp2": ([("4-5", 0), ("6-7", 0)], "39"),
        "dp2": ([("4-5", 0), ("6-7", 0)], "39"),
        "tp2dp2": ([("4", 0), ("5", 0), ("6", 0), ("7", 0)], "39"),
        "explicit": ([("4-5", 0), ("6-7", 0)], "36-39"),
    },
    "memory-only-node": {
        "tp1": ([("0-15", 0)], "31"),
        "tp2": ([("0-7", 0), ("8-15", 0)], "31"),
        "dp2": ([("0-7", 0), ("8-15", 0)], "31"),
        "tp2dp2": ([("0-3", 0), ("4-7", 0), ("8-11", 0), ("12-15", 0)], "31"),
        "explicit": ([("0-7", 0), ("8-15", 0)], "16-31"),
    },
    "arm64-64c": {
        "tp1": ([("0-62", 0)], "63"),
        "tp2": ([("0-31", 0), ("32-62", 0)], "63"),
        "dp2": ([("0-31", 0), ("32-62", 0)], "63"),
        "tp2dp2": ([("0-15", 0), ("16-31", 0), ("32-47", 0), ("48-62", 0)], "63"),
        "explicit": ([("0-31", 0), ("32-63", 0)], SHARED),
    },
    "offline-cpus": {
        "tp1": ([("0-4,6-7", 0)], "15"),
        "tp2": ([("0-4,6-7", 0), ("8-11,13-14", 1)], "15"),
        "dp2": ([("0-4,6-7", 0), ("8-11,13-14", 1)], "15"),
        "tp2dp2": ([("0-3", 0), ("4,6-7", 0), ("8-10", 1), ("11,13-14", 1)], "15"),
        "explicit": ([("0-4", 0), ("6-7", 0)], "8-11,13-15"),
    },
    # fewer than 8 CPUs: "auto" keeps none for the frontend, which shares the ranks' CPUs
    "this-machine": {
        "tp1": ([("0-1", 0)], SHARED),
        "tp2": ([("0", 0), ("1", 0)], SHARED),
        "dp2": ([("0", 0), ("1", 0)], SHARED),
        "tp2dp2": ERROR,
        "explicit": ([("0", 0), ("1", 0)], SHARED),
    },
    "numa-vm-2node": {
        "tp1": ([("0-1", 0)], SHARED),
        "tp2": ([("0-1", 0), ("2-3", 1)], SHARED),
        "dp2": ([("0-1", 0), ("2-3", 1)], SHARED),
        "tp2dp2": NO_MEMORY,  # 1 GiB nodes
        "explicit": ([("0-1", 0), ("2-3", 1)], SHARED),
    },
    "numa-vm-cpuset": {
        "tp1": ([("1", 0)], SHARED),
        "tp2": ([("1", 0), ("2", 1)], SHARED),
        "dp2": ([("1", 0), ("2", 1)], SHARED),
        "tp2dp2": ERROR,
        "explicit": ([("1", 0), ("2", 1)], SHARED),
    },
    # nodes from cpumap masks, SMT from thread_siblings masks, CPUs 5, 37, 44 offline by cpuN/online:
    # node 0 keeps 15 cores (0-4,6-15), node 1 has 16; CPU 63 (core 31's second thread) is the frontend's
    "old-kernel-masks": {
        "tp1": ([("16-31", 1)], "63"),
        "tp2": ([("0-4,6-15", 0), ("16-31", 1)], "63"),
        "dp2": ([("0-4,6-15", 0), ("16-31", 1)], "63"),
        "tp2dp2": ([("0-4,6-8", 0), ("9-15", 0), ("16-23", 1), ("24-31", 1)], "63"),
        "explicit": ([("0-4", 0), ("16-20", 1)], "6-15,21-36,38-43,45-63"),
    },
    # node 0 (CPUs 0-5, from cpuN/node0 links) is offline and has no memory: its ranks' memory is on node 1
    "offline-node-links": {
        "tp1": ([("6-14", 1)], "15"),
        "tp2": ([("0-5", 1), ("6-14", 1)], "15"),
        "dp2": ([("0-5", 1), ("6-14", 1)], "15"),
        "tp2dp2": ([("0-2", 1), ("3-5", 1), ("6-10", 1), ("11-14", 1)], "15"),
        "explicit": ([("0-5", 1), ("6-11", 1)], "12-15"),
    },
    # the cpuset (/dev/cpuset/appliance/cpus) is 2-5,10-13: 4 cores, the frontend on a spare sibling
    "cpuset-v1-noprefix": {
        "tp1": ([("2-5", 0)], "13"),
        "tp2": ([("2-3", 0), ("4-5", 0)], "13"),
        "dp2": ([("2-3", 0), ("4-5", 0)], "13"),
        "tp2dp2": ([("2", 0), ("3", 0), ("4", 0), ("5", 0)], "13"),
        "explicit": ([("2-3", 0), ("4-5", 0)], "10-13"),
    },
    # both nodes list every CPU: one group of 32 cores, memory interleaved over both nodes (node = the first)
    "same-cpus-every-node": {
        "tp1": ([("0-31", 0)], "63"),
        "tp2": ([("0-15", 0), ("16-31", 0)], "63"),
        "dp2": ([("0-15", 0), ("16-31", 0)], "63"),
        "tp2dp2": ([("0-7", 0), ("8-15", 0), ("16-23", 0), ("24-31", 0)], "63"),
        "explicit": ([("0-15", 0), ("16-31", 0)], "32-63"),
    },
    # 8 P-cores (0-15, siblings adjacent) and 16 E-cores (16-31): ranks on P-cores, the frontend on an E-core
    "hybrid-8p16e": {
        "tp1": ([("0,2,4,6,8,10,12,14", 0)], "31"),
        "tp2": ([("0,2,4,6", 0), ("8,10,12,14", 0)], "31"),
        "dp2": ([("0,2,4,6", 0), ("8,10,12,14", 0)], "31"),
        "tp2dp2": ([("0,2", 0), ("4,6", 0), ("8,10", 0), ("12,14", 0)], "31"),
        "explicit": ([("0,2,4,6", 0), ("8,10,12,14", 0)], "1,3,5,7,9,11,13,15-31"),
    },
    # little A55s 0-3, big A76s 4-7: ranks on the big ones, the frontend on a little one
    "arm-biglittle-4x4": {
        "tp1": ([("4-7", 0)], "3"),
        "tp2": ([("4-5", 0), ("6-7", 0)], "3"),
        "dp2": ([("4-5", 0), ("6-7", 0)], "3"),
        "tp2dp2": ([("4", 0), ("5", 0), ("6", 0), ("7", 0)], "3"),
        "explicit": ([("4-5", 0), ("6-7", 0)], "0-3"),
    },
}

CASES = [(machine, spec) for machine, specs in EXPECTED.items() for spec in specs]


# The emulated guest's pod has 3 GiB for two ranks: 20% of 1.5 GiB holds no 8192-token fp32 sequence.
SMALL_CONTEXT = {"numa-vm-cpuset": "model: {max_model_len: 4096}\n", "numa-vm-2node": "model: {max_model_len: 4096}\n"}


def _spec_text(machine: str, name: str) -> str:
    extra = SMALL_CONTEXT.get(machine, "")
    if name == "explicit":
        return f'parallel: {{tp: 2}}\ncores: {{ranks: "{EXPLICIT[machine]}"}}\n' + extra
    return SPECS[name] + "\n" + extra


def _plan(machine: str, text: str, runtime: str = "gnu"):
    return make_plan(parse_spec(text).spec, topology(machine), SMOLLM2, runtime)


@pytest.mark.parametrize(("machine", "name"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_plan_places_ranks_exactly(machine, name):
    expected = EXPECTED[machine][name]
    text = _spec_text(machine, name)
    if expected in (ERROR, NO_MEMORY):
        with pytest.raises(SpecError) as error:
            _plan(machine, text)
        assert error.value.problems[0].path == ("parallel" if expected == ERROR else "kv_cache.memory")
        assert "rank" in error.value.render()
        return
    ranks, frontend = expected
    plan = _plan(machine, text)
    assert [(r.cpus, r.node) for r in plan.ranks] == [(parse_cpulist(c), n) for c, n in ranks]
    tp = 1 if name == "dp2" else (2 if name != "tp1" else 1)
    assert [(r.replica, r.rank) for r in plan.ranks] == [(i // tp, i % tp) for i in range(len(ranks))]
    if frontend == SHARED:
        assert plan.frontend_shared and plan.frontend_cpus == topology(machine).allowed
    else:
        assert not plan.frontend_shared and plan.frontend_cpus == parse_cpulist(frontend)
    for rank in plan.ranks:
        assert not set(rank.cpus) & (set() if plan.frontend_shared else set(plan.frontend_cpus))


@pytest.mark.parametrize(("machine", "name"), [c for c in CASES if EXPECTED[c[0]][c[1]] not in (ERROR, NO_MEMORY)])
def test_openmp_environment_for_each_runtime(machine, name):
    ranks, _ = EXPECTED[machine][name]
    for runtime in ("intel", "gnu", "llvm"):
        plan = _plan(machine, _spec_text(machine, name), runtime)
        assert plan.openmp_runtime == runtime
        for rank, (cpus_text, _) in zip(plan.ranks, ranks, strict=True):
            cpus = parse_cpulist(cpus_text)
            env = {"OMP_NUM_THREADS": str(len(cpus))}
            if runtime == "gnu":
                env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
            else:  # Intel's runtime and LLVM's read the same variable (app/placement/openmp.py)
                env["KMP_AFFINITY"] = "granularity=fine,explicit,proclist=[" + ",".join(map(str, cpus)) + "]"
            assert rank.openmp_env == env


def test_openmp_literals():
    plan = _plan("offline-cpus", SPECS["tp2dp2"], "intel")
    assert plan.ranks[1].openmp_env == {"OMP_NUM_THREADS": "3",
                                        "KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,6,7]"}
    plan = _plan("offline-cpus", SPECS["tp2dp2"], "gnu")
    assert plan.ranks[3].openmp_env == {"OMP_NUM_THREADS": "3", "GOMP_CPU_AFFINITY": "11 13 14"}
    plan = _plan("k8s-cpuset8-smt", SPECS["tp2"], "llvm")
    assert plan.ranks[1].openmp_env == {"OMP_NUM_THREADS": "2",
                                        "KMP_AFFINITY": "granularity=fine,explicit,proclist=[6,7]"}


def test_openmp_auto_takes_the_resolved_runtime_and_explicit_wins():
    assert _plan("1s-4n-nps4", SPECS["tp1"], "intel").openmp_runtime == "intel"
    text = SPECS["tp1"] + "\nruntime: {openmp: llvm}"
    assert _plan("1s-4n-nps4", text, "intel").openmp_runtime == "llvm"


def test_smt_threads_when_asked():
    plan = _plan("k8s-cpuset8-smt", "cores: {use_smt: true}")
    # the frontend takes the highest CPU (39); the rank gets every other thread of the 4 cores
    assert plan.frontend_cpus == (39,)
    assert plan.ranks[0].cpus == (4, 5, 6, 7, 36, 37, 38)


def test_no_frontend_reservation_shares_all_cpus():
    plan = _plan("this-machine", "parallel: {tp: 2}\ncores: {reserve_frontend: 0}")
    assert [r.cpus for r in plan.ranks] == [(0,), (1,)]
    assert plan.frontend_shared
    assert [(r.heads, r.kv_heads) for r in plan.ranks] == [(6, 2), (3, 1)]  # SmolLM2's 9/3 heads by KV groups


def test_numa_nodes_filter_and_explicit_frontend():
    plan = _plan("1s-4n-nps4", "parallel: {tp: 2}\ncores: {numa_nodes: [2, 3], frontend: '0-1'}")
    assert [(r.cpus, r.node) for r in plan.ranks] == [(tuple(range(16, 24)), 2), (tuple(range(24, 32)), 3)]
    assert plan.frontend_cpus == (0, 1)


def test_more_ranks_than_cores_falls_back_to_smt_siblings_with_a_warning():
    plan = _plan("k8s-cpuset8-smt", "parallel: {dp: 6}")
    # 7 CPUs left after the frontend's 39, one unit each, core by core (4,36,5,37,6,38,7);
    # the first rank takes the odd one out, so it holds both threads of core 4
    assert [r.cpus for r in plan.ranks] == [(4, 36), (5,), (37,), (6,), (38,), (7,)]
    assert any("fewer physical cores (4) than ranks (6)" in w for w in plan.warnings)
    assert any("rank 1 and rank 2 share 1 physical core" in w for w in plan.warnings)
    assert not any(w.startswith("rank 0 ") for w in plan.warnings)


def test_unequal_nodes_give_the_smallest_rank_the_most_cores():
    # offline-cpus: node 0 has 7 usable cores, node 1 has 6 (CPU 15 is the frontend's)
    plan = _plan("offline-cpus", "parallel: {dp: 3}")
    assert [len(r.cpus) for r in plan.ranks] == [4, 3, 6]
    assert [r.node for r in plan.ranks] == [0, 0, 1]


def test_explicit_rank_spanning_nodes_is_interleaved_with_a_warning():
    plan = _plan("2s-2n-32c-smt2", 'cores: {ranks: "0-15,32-47"}')
    rank = plan.ranks[0]
    assert rank.memory_policy == "interleave" and rank.memory_nodes == (0, 1)
    assert any("spans NUMA nodes [0, 1]" in w for w in plan.warnings)


def test_warnings_name_idle_nodes_memory_only_nodes_and_dtype_fallback():
    assert "NUMA node 1 (32 cores) runs no rank" in " ".join(_plan("2s-2n-32c-smt2", SPECS["tp1"]).warnings)
    assert "memory-only" in " ".join(_plan("memory-only-node", SPECS["tp1"]).warnings)
    k8s = _plan("k8s-cpuset8-smt", SPECS["tp1"])
    assert k8s.dtype == "float32" and "auto chose float32" in k8s.warnings[0]
    assert _plan("2s-2n-32c-smt2", SPECS["tp1"]).dtype == "bfloat16"
    assert _plan("arm64-64c", SPECS["tp1"]).dtype == "bfloat16"


def _blocks(budget: float, fraction: float, per_token: int, block_size: int = 16) -> int:
    return int(fraction * budget) // (per_token * block_size)


def test_kv_fraction_is_of_the_node_share():
    # 2 nodes x 256 GiB, tp2dp2: two ranks per node -> each rank's budget is 128 GiB
    plan = _plan("2s-2n-32c-smt2", SPECS["tp2dp2"])
    per_token = 2 * 30 * 2 * 64 * 2  # K and V, 30 layers, ceil(3/2) KV heads, head_dim 64, bf16
    assert {r.kv_blocks for r in plan.ranks} == {_blocks(128 * 1024**3, 0.2, per_token)}
    assert plan.ranks[0].kv_bytes == plan.ranks[0].kv_blocks * per_token * 16
    # tp=2 of 9 / 3 heads: rank 0 has 6 query and 2 KV heads, rank 1 3 and 1; half the MLP each; the
    # tied embedding and the norms on both (test_tp.py checks these figures against the loaded shards)
    embedding, q, kv, mlp, norms = 28_311_552, 19_906_560, 6_635_520, 79_626_240, 35_136
    assert [r.weight_bytes for r in plan.ranks[:2]] == [
        2 * (embedding + norms + q * 6 // 9 + kv * 2 // 3 + mlp // 2),
        2 * (embedding + norms + q * 3 // 9 + kv * 1 // 3 + mlp // 2)]


def test_kv_fraction_respects_the_cgroup_limit():
    # 16 GiB cgroup limit, 1 rank: min(128 GiB node, 16 GiB) * 0.2; float32 compute (no native BF16), so "auto"
    # takes a float16 cache
    plan = _plan("k8s-cpuset8-smt", SPECS["tp1"])
    assert (plan.dtype, plan.kv_dtype) == ("float32", "float16")
    assert plan.ranks[0].kv_blocks == _blocks(16 * 1024**3, 0.2, 2 * 30 * 3 * 64 * 2)
    exact = _plan("k8s-cpuset8-smt", SPECS["tp1"] + "\nkv_cache: {dtype: float32}")
    assert exact.kv_dtype == "float32" and exact.ranks[0].kv_blocks == _blocks(16 * 1024**3, 0.2, 2 * 30 * 3 * 64 * 4)


def test_kv_absolute_size_and_block_size():
    plan = _plan("1s-4n-nps4", "kv_cache: {memory: 1GiB, block_size: 32}")
    assert plan.ranks[0].kv_blocks == 1024**3 // (2 * 30 * 3 * 64 * 2 * 32)
    assert plan.block_size == 32


def test_kv_too_large_for_the_node_gives_the_numbers():
    with pytest.raises(SpecError) as error:
        _plan("1s-4n-nps4", "kv_cache: {memory: 70GiB}")
    text = error.value.render()
    assert "kv_cache.memory" in text and "NUMA node 0's 64.00 GiB" in text and "70.00 GiB of KV per rank" in text


def test_kv_over_the_cgroup_limit_gives_the_numbers():
    with pytest.raises(SpecError) as error:
        _plan("k8s-cpuset8-smt", "kv_cache: {memory: 16GiB}")
    assert "the cgroup memory limit of 16.00 GiB (lower kv_cache.memory, or raise the memory limit)" in \
        error.value.render()
    fits = 16 * 1024**3 - 134_515_008 * 4 - RUNTIME_RESERVE - 1024**2
    _plan("k8s-cpuset8-smt", f"kv_cache: {{memory: {fits}B}}")


def test_kv_must_hold_one_full_sequence():
    with pytest.raises(SpecError) as error:
        _plan("1s-4n-nps4", "kv_cache: {memory: 1MiB}")
    assert "to hold one sequence of 8192 tokens" in error.value.render()
    plan = _plan("1s-4n-nps4", "kv_cache: {memory: 64MiB}\nmodel: {max_model_len: 2048}")
    assert plan.max_model_len == 2048


def test_tp_ranks_of_a_replica_get_the_same_kv_blocks():
    # tp=3 on two equal nodes: node 0 holds two ranks (16 cores each), node 1 one rank (32 cores)
    plan = _plan("2s-2n-32c-smt2", "parallel: {tp: 3}")
    assert [len(r.cpus) for r in plan.ranks] == [16, 16, 32]
    assert len({r.kv_blocks for r in plan.ranks}) == 1  # one block table for the whole TP group
    per_token = 2 * 30 * 1 * 64 * 2
    assert plan.ranks[2].kv_blocks == _blocks(128 * 1024**3, 0.2, per_token)  # node 0's ranks bound it
    assert any("unequal threads [16, 16, 32]" in w for w in plan.warnings)


def test_every_rank_must_hold_a_sequence_not_just_the_first():
    # rank 0 alone on node 1 would have room; ranks 1 and 2 share node 0 and do not
    text = 'parallel: {tp: 3}\ncores: {ranks: "32-47|0-7|8-15"}\nkv_cache: {memory: 0.0003}'
    with pytest.raises(SpecError, match="to hold one sequence"):
        _plan("2s-2n-32c-smt2", text)


def test_tp_beyond_the_attention_heads_is_refused():
    with pytest.raises(SpecError, match="at most the model's 9 attention heads"):
        _plan("2s-2n-32c-smt2", "parallel: {tp: 16}")


def test_memory_follows_the_cgroup_cpuset_mems(tmp_path):
    import shutil

    tree = tmp_path / "pod"
    shutil.copytree(topology("k8s-cpuset8-smt").root, tree)
    (tree / "sys/fs/cgroup/cpuset.mems.effective").write_text("1\n")
    from app.topology.machine import read_topology

    plan = make_plan(parse_spec("").spec, read_topology(tree), SMOLLM2, "gnu")
    assert plan.ranks[0].node == 1 and plan.ranks[0].memory_nodes == (1,)
    assert any("cgroup allows memory only on [1] (cpuset.mems)" in w for w in plan.warnings)
    assert topology("k8s-cpuset8-smt").allowed_mems == (0,)


def _with_quota(tmp_path, machine: str, files: dict[str, str]):
    import shutil

    from app.topology.machine import read_topology

    tree = tmp_path / machine
    shutil.copytree(topology(machine).root, tree)
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    return read_topology(tree)


def test_auto_ranks_keep_to_the_cgroups_cpu_quota(tmp_path):
    """A CPU limit without the static CPU manager's whole cores (`docker run --cpus`, a Burstable pod): the ranks run
    ceil(quota) threads in all, shared evenly, at least one each, and the plan says why (v2's cpu.max, v1's CFS
    files); explicit ranks are kept, with a warning."""
    pod = _with_quota(tmp_path, "k8s-cpuset8-smt", {"sys/fs/cgroup/cpu.max": "150000 100000\n"})
    assert pod.cgroup.cpu_quota == 1.5 and pod.cgroup.cpu_quota_source.endswith("sys/fs/cgroup/cpu.max")
    plan = make_plan(parse_spec("").spec, pod, SMOLLM2, "gnu")
    unlimited = make_plan(parse_spec("").spec, topology("k8s-cpuset8-smt"), SMOLLM2, "gnu")
    assert len(unlimited.ranks[0].cpus) > 2 and plan.ranks[0].cpus == unlimited.ranks[0].cpus[:2]
    assert any("CPU quota is 1.5 CPUs" in w and "run 2 threads in all" in w for w in plan.warnings), plan.warnings
    scope = "sys/fs/cgroup/user.slice/user-0.slice/session-1.scope/cpu.max"
    two = _with_quota(tmp_path, "2s-2n-32c-smt2", {scope: "400000 100000\n"})
    plan = make_plan(parse_spec("parallel: {tp: 2}").spec, two, SMOLLM2, "gnu")
    assert [len(r.cpus) for r in plan.ranks] == [2, 2] and [r.node for r in plan.ranks] == [0, 1]
    odd = _with_quota(tmp_path / "odd", "2s-2n-32c-smt2", {scope: "300000 100000\n"})  # 3 CPUs for 2 ranks
    assert [len(r.cpus) for r in make_plan(parse_spec("parallel: {tp: 2}").spec, odd, SMOLLM2, "gnu").ranks] == [1, 1]
    smt = make_plan(parse_spec("parallel: {tp: 2}\ncores: {use_smt: true}").spec, two, SMOLLM2, "gnu")
    assert [len({two.cpus[cpu].core for cpu in r.cpus}) for r in smt.ranks] == [2, 2]  # two cores each, not siblings
    explicit = make_plan(parse_spec('parallel: {tp: 2}\ncores: {ranks: "0-3|32-35"}').spec, two, SMOLLM2, "gnu")
    assert [len(r.cpus) for r in explicit.ranks] == [4, 4]
    assert any("the ranks run 8 threads, but the cgroup's CPU quota is 4 CPUs" in w for w in explicit.warnings)
    v1 = _with_quota(tmp_path, "this-machine", {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "50000\n",
                                                 "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert v1.cgroup.cpu_quota == 0.5
    assert [len(r.cpus) for r in make_plan(parse_spec("").spec, v1, SMOLLM2, "gnu").ranks] == [1]
    none = _with_quota(tmp_path / "none", "k8s-cpuset8-smt", {"sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert none.cgroup.cpu_quota is None


def test_bf16_forced_on_a_cpu_without_it_is_refused():
    with pytest.raises(SpecError) as error:
        _plan("k8s-cpuset8-smt", "model: {dtype: bfloat16}")
    assert error.value.problems[0].path == "model.dtype"
    assert "avx512_bf16 or amx_bf16" in error.value.render()


def test_cpu_without_avx2_is_refused():
    with pytest.raises(SpecError) as error:
        _plan("x86-no-avx2", SPECS["tp1"])
    assert "without AVX2" in error.value.render()


def test_cpu_with_avx2_but_without_f16c_is_refused_by_name(tmp_path):
    """The x86 kernels are built with -mf16c too: a CPU that lacks it is refused, not sent a SIGILL."""
    import shutil

    from app.bootstrap.isa import check_isa
    from app.topology.machine import read_topology

    root = tmp_path / "no-f16c"
    shutil.copytree(REPO / "tests" / "topologies" / "k8s-cpuset8-smt", root)
    cpuinfo = root / "proc" / "cpuinfo"
    cpuinfo.write_text(cpuinfo.read_text().replace(" f16c", ""))
    check_isa(read_topology(REPO / "tests" / "topologies" / "k8s-cpuset8-smt"))  # the capture as it is passes
    with pytest.raises(SpecError) as error:
        check_isa(read_topology(root))
    rendered = error.value.render()
    assert "without F16C (no 'f16c' in /proc/cpuinfo)" in rendered and "an x86_64 CPU with AVX2, FMA and F16C" in rendered


def test_without_chunked_prefill_one_step_must_hold_the_longest_sequence():
    text = "scheduler: {chunked_prefill: false, max_num_batched_tokens: 2048}"
    with pytest.raises(SpecError, match="at least max_model_len \\(8192\\) while scheduler.chunked_prefill is off"):
        _plan("1s-4n-nps4", text)
    assert _plan("1s-4n-nps4", text + "\nmodel: {max_model_len: 2048}").max_model_len == 2048


def test_auto_reserve_keeps_a_frontend_cpu_only_on_machines_of_eight_or_more():
    assert _plan("k8s-cpuset8-smt", SPECS["tp1"]).frontend_cpus == (39,)  # 8 usable: one kept
    assert _plan("k8s-cpuset8-smt", "parallel: {dp: 8}").frontend_shared  # ... unless every CPU is a rank's
    assert _plan("this-machine", SPECS["tp1"]).frontend_shared  # 2 usable: shared
    assert _plan("this-machine", SPECS["tp1"] + "\ncores: {reserve_frontend: 1}").frontend_cpus == (1,)  # as told


def test_too_many_ranks_names_cores_numa_nodes_only_when_it_is_set():
    with pytest.raises(SpecError) as error:
        _plan("this-machine", "parallel: {dp: 4}\ncores: {reserve_frontend: 1}")
    assert "numa_nodes" not in error.value.render()
    assert "1 CPU (0) left for ranks after 1 for the frontend (cores.reserve_frontend or cores.frontend)" \
        in error.value.render()
    with pytest.raises(SpecError) as error:
        _plan("1s-4n-nps4", "parallel: {dp: 20}\ncores: {numa_nodes: [0]}")
    assert "16 CPUs (0-7,32-39) left for ranks after 0 for the frontend (cores.reserve_frontend or " \
           "cores.frontend) in cores.numa_nodes [0]" in error.value.render()


def test_ranks_on_a_node_without_memory_get_memory_elsewhere_with_a_warning():
    plan = _plan("offline-node-links", SPECS["tp2"])
    assert plan.ranks[0].cpus == tuple(range(6)) and plan.ranks[0].memory_nodes == (1,)
    assert "rank 0's CPUs are on NUMA node(s) [0], which have no memory: its memory goes to [1]" in plan.warnings


def test_nodes_that_list_the_same_cpus_are_one_node_with_interleaved_memory():
    plan = _plan("same-cpus-every-node", SPECS["tp2"])
    assert [(r.memory_policy, r.memory_nodes) for r in plan.ranks] == [("interleave", (0, 1))] * 2
    assert ("NUMA nodes [0, 1] list the same CPUs (a firmware table error?): which node a CPU is on is "
            "unknown, so rank(s) 0, 1 interleave their memory over the nodes that list their CPUs") in plan.warnings
    assert (plan.dtype, plan.kv_dtype) == ("float32", "float16")  # no native BF16 on this CPU
    per_token = 2 * 30 * 2 * 64 * 2  # K and V, 30 layers, ceil(3/2) KV heads, head_dim 64, float16
    assert plan.ranks[0].kv_blocks == _blocks(128 * 1024**3, 0.2, per_token)  # 256 GiB over two ranks


def test_no_memory_figure_anywhere_is_a_clear_error():
    with pytest.raises(SpecError) as error:
        _plan("no-meminfo", SPECS["tp1"])
    text = error.value.render()
    assert error.value.problems[0].path == "(machine)"
    assert "no MemTotal in" in text and "proc/meminfo" in text and "sys/devices/system/node/node0/meminfo" in text


def test_hybrid_frontend_on_a_little_core_and_idle_little_cores_are_named():
    plan = _plan("hybrid-8p16e", SPECS["tp1"])
    assert ("the 15 E-cores (CPUs 16-30) run no rank: the ranks fit on faster cores, and a rank's threads "
            "wait for its slowest core at every barrier") in plan.warnings
    assert not any("mixes" in w for w in plan.warnings)
    arm = _plan("arm-biglittle-4x4", SPECS["tp1"])
    assert arm.frontend_cpus == (3,) and any("the 3 capacity-397 cores (CPUs 0-2) run no rank" in w
                                             for w in arm.warnings)


def test_hybrid_ranks_past_the_big_cores_take_little_cores_whole():
    # 10 ranks > 8 P-cores: D'Hondt over (node, kind) groups, so no rank mixes P- and E-cores
    plan = _plan("hybrid-8p16e", "parallel: {dp: 10}")
    assert [fmt(r.cpus) for r in plan.ranks] == [
        "0,2,4", "6,8,10", "12,14", "16-18", "19-20", "21-22", "23-24", "25-26", "27-28", "29-30"]
    assert not any("mixes" in w or "run no rank" in w for w in plan.warnings)
    arm = _plan("arm-biglittle-4x4", "parallel: {dp: 5}")
    assert [fmt(r.cpus) for r in arm.ranks] == ["4-5", "6", "7", "0-1", "2"]


def test_hybrid_rank_mixing_kinds_is_warned():
    plan = _plan("hybrid-8p16e", 'parallel: {tp: 2}\ncores: {ranks: "0,2,4,16|6,8,10,12"}')
    assert ("rank 0 (0,2,4,16) mixes P-cores and E-cores: its threads wait for the slowest at every barrier"
            in plan.warnings)
    assert not any(w.startswith("rank 1 (") for w in plan.warnings)  # all P-cores
