"""Placement plans on captured machines, asserted exactly (CPUs per rank, node, frontend, OpenMP env).

The expectations are written out by hand from the rules in app/placement/cores.py's docstring.
"""

from __future__ import annotations

import pytest

from app.placement.memory import RUNTIME_RESERVE
from app.placement.plan import make_plan
from app.spec.errors import SpecError
from app.spec.load import parse_spec
from app.topology.cpulist import parse_cpulist
from tests.conftest import SMOLLM2, topology

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
}
ERROR = "error"
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
    "this-machine": {
        "tp1": ([("0", 0)], "1"),
        "tp2": ERROR, "dp2": ERROR, "tp2dp2": ERROR,
        "explicit": ([("0", 0), ("1", 0)], SHARED),
    },
    "numa-vm-2node": {
        "tp1": ([("0-1", 0)], "3"),
        "tp2": ([("0-1", 0), ("2", 1)], "3"),
        "dp2": ([("0-1", 0), ("2", 1)], "3"),
        "tp2dp2": ERROR,
        "explicit": ([("0-1", 0), ("2-3", 1)], SHARED),
    },
    "numa-vm-cpuset": {
        "tp1": ([("1", 0)], "2"),
        "tp2": ERROR, "dp2": ERROR, "tp2dp2": ERROR,
        "explicit": ([("1", 0), ("2", 1)], SHARED),
    },
}

CASES = [(machine, spec) for machine, specs in EXPECTED.items() for spec in specs]


# The emulated guest's pod has 3 GiB for two ranks: 20% of 1.5 GiB holds no 8192-token fp32 sequence.
SMALL_CONTEXT = {"numa-vm-cpuset": "model: {max_model_len: 4096}\n"}


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
    if expected == ERROR:
        with pytest.raises(SpecError) as error:
            _plan(machine, text)
        assert error.value.problems[0].path == "parallel"
        assert "ranks" in error.value.render()
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


@pytest.mark.parametrize(("machine", "name"), [c for c in CASES if EXPECTED[c[0]][c[1]] != ERROR])
def test_openmp_environment_for_each_runtime(machine, name):
    ranks, _ = EXPECTED[machine][name]
    for runtime in ("intel", "gnu", "llvm"):
        plan = _plan(machine, _spec_text(machine, name), runtime)
        assert plan.openmp_runtime == runtime
        for rank, (cpus_text, _) in zip(plan.ranks, ranks, strict=True):
            cpus = parse_cpulist(cpus_text)
            env = {"OMP_NUM_THREADS": str(len(cpus))}
            if runtime == "intel":
                env["KMP_AFFINITY"] = "granularity=fine,explicit,proclist=[" + ",".join(map(str, cpus)) + "]"
            elif runtime == "gnu":
                env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
            else:
                env["OMP_PLACES"] = ",".join("{%d}" % c for c in cpus)
                env["OMP_PROC_BIND"] = "close"
            assert rank.openmp_env == env


def test_openmp_literals():
    plan = _plan("offline-cpus", SPECS["tp2dp2"], "intel")
    assert plan.ranks[1].openmp_env == {"OMP_NUM_THREADS": "3",
                                        "KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,6,7]"}
    plan = _plan("offline-cpus", SPECS["tp2dp2"], "gnu")
    assert plan.ranks[3].openmp_env == {"OMP_NUM_THREADS": "3", "GOMP_CPU_AFFINITY": "11 13 14"}
    plan = _plan("k8s-cpuset8-smt", SPECS["tp2"], "llvm")
    assert plan.ranks[1].openmp_env == {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{6},{7}", "OMP_PROC_BIND": "close"}


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
    assert plan.ranks[0].weight_bytes == 134_515_008 * 2 // 2


def test_kv_fraction_respects_the_cgroup_limit():
    # 16 GiB cgroup limit, 1 rank: min(128 GiB node, 16 GiB) * 0.2, fp32 (no native BF16)
    plan = _plan("k8s-cpuset8-smt", SPECS["tp1"])
    assert plan.ranks[0].kv_blocks == _blocks(16 * 1024**3, 0.2, 2 * 30 * 3 * 64 * 4)


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
    assert "the cgroup memory limit of 16.00 GiB" in error.value.render()
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


def test_bf16_forced_on_a_cpu_without_it_is_refused():
    with pytest.raises(SpecError) as error:
        _plan("k8s-cpuset8-smt", "model: {dtype: bfloat16}")
    assert error.value.problems[0].path == "model.dtype"
    assert "avx512_bf16 or amx_bf16" in error.value.render()


def test_cpu_without_avx2_is_refused():
    with pytest.raises(SpecError) as error:
        _plan("x86-no-avx2", SPECS["tp1"])
    assert "without AVX2" in error.value.render()


def test_without_chunked_prefill_one_step_must_hold_the_longest_sequence():
    text = "scheduler: {chunked_prefill: false, max_num_batched_tokens: 2048}"
    with pytest.raises(SpecError, match="at least max_model_len \\(8192\\) while scheduler.chunked_prefill is off"):
        _plan("1s-4n-nps4", text)
    assert _plan("1s-4n-nps4", text + "\nmodel: {max_model_len: 2048}").max_model_len == 2048
