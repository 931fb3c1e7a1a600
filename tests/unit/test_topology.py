"""The topology reader on captured trees, the live machine, and trees built here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.spec.errors import SpecError
from app.topology.capture import capture
from app.topology.cgroup import memory_group, memory_headroom
from app.topology.cpulist import format_cpulist, parse_cpulist, parse_cpumask
from app.topology.machine import read_topology
from app.topology.nodes import memory_available
from app.topology.root import Root
from tests.conftest import TOPOLOGIES, run_cli, topology

GiB = 1024**3


@given(st.sets(st.integers(min_value=0, max_value=2000)))
def test_cpulist_round_trips(cpus):
    assert parse_cpulist(format_cpulist(cpus)) == tuple(sorted(cpus))


def test_cpulist_forms():
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist(" 0-6:3 ,1 ") == (0, 1, 3, 6)
    assert format_cpulist([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert parse_cpulist("") == ()


def _mask(cpus: set[int], words: int) -> str:
    """The kernel's bitmap format, written independently of the reader: 32-bit words, high first."""
    bits = sum(1 << cpu for cpu in cpus)
    return ",".join(f"{(bits >> (32 * i)) & 0xffffffff:08x}" for i in reversed(range(words)))


@given(st.sets(st.integers(min_value=0, max_value=255)))
def test_cpumask_reads_the_kernel_bitmap_format(cpus):
    assert parse_cpumask(_mask(cpus, 8)) == tuple(sorted(cpus))


def test_cpumask_forms():
    assert parse_cpumask("00000000,0000ffff") == tuple(range(16))
    assert parse_cpumask("ffff0000,ffff0000\n") == tuple(range(16, 32)) + tuple(range(48, 64))
    assert parse_cpumask("f,ffffffff") == tuple(range(36))  # the first word only as wide as needed
    assert parse_cpumask("0000") == () and parse_cpumask("") == ()
    for bad in ("xyz", "1,,2", "123456789", "0x1", "ff,"):
        with pytest.raises(ValueError):
            parse_cpumask(bad)


def test_two_socket_smt2():
    t = topology("2s-2n-32c-smt2")
    assert t.arch == "x86_64" and t.online == tuple(range(128)) and t.allowed == tuple(range(128))
    assert t.cpus[0].siblings == (0, 64) and t.cpus[64].core == 0 and t.cpus[64].node == 0
    assert t.cpus[127].siblings == (63, 127) and t.cpus[127].socket == 1 and t.cpus[127].node == 1
    assert t.nodes[1].cpus == tuple(range(32, 64)) + tuple(range(96, 128))
    assert t.nodes[0].mem_total == 256 * GiB and t.nodes[0].distances == (10, 21)
    assert {"amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2"} <= t.isa
    assert t.cgroup.cpuset == tuple(range(128)) and t.memory_limit is None  # memory.max is "max"


def test_kubernetes_static_policy_container():
    t = topology("k8s-cpuset8-smt")
    assert t.allowed == (4, 5, 6, 7, 36, 37, 38, 39)
    assert t.cgroup.cpuset_source == "/sys/fs/cgroup/cpuset.cpus.effective"  # the namespaced group is the mount
    assert t.memory_limit == 16 * GiB
    assert "avx512_bf16" not in t.isa and "avx512_vnni" in t.isa


def test_offline_cpus_and_cgroup_v1():
    t = topology("offline-cpus")
    assert t.online == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 13, 14, 15)
    assert 5 not in t.allowed and 12 not in t.allowed  # the cpuset still says 0-15
    assert t.nodes[0].cpus == (0, 1, 2, 3, 4, 6, 7)
    assert t.cgroup.cpuset == tuple(range(16)) and t.memory_limit is None  # v1 "unlimited" is LONG_MAX


def test_memory_only_node():
    t = topology("memory-only-node")
    assert t.nodes[1].cpus == () and t.nodes[1].mem_total == 64 * GiB
    assert t.nodes[0].cpus == tuple(range(32))


def test_arm64_without_smt():
    t = topology("arm64-64c")
    assert t.arch == "aarch64" and {"asimd", "bf16", "sve", "i8mm"} <= t.isa
    assert all(t.cpus[c].siblings == (c,) for c in t.online)
    assert t.cpu_model == "arm64 implementer 0x41 part 0xd40"


def test_four_nodes_on_one_socket():
    t = topology("1s-4n-nps4")
    assert len(t.nodes) == 4 and {t.cpus[c].socket for c in t.online} == {0}
    assert t.nodes[2].cpus == tuple(range(16, 24)) + tuple(range(48, 56))
    assert t.nodes[3].distances == (12, 12, 12, 10)


def test_node_cpus_from_cpumap_when_there_is_no_cpulist():
    t = topology("old-kernel-masks")  # nodes give "0000ffff,0000ffff" and "ffff0000,ffff0000"
    assert set(t.nodes[1].cpus) == set(range(16, 32)) | set(range(48, 64))
    assert set(t.nodes[0].cpus) - {5, 37, 44} == (set(range(16)) | set(range(32, 48))) - {5, 37, 44}
    assert t.cpus[40].node == 0 and t.cpus[20].node == 1 and t.cpus[63].node == 1


def test_malformed_cpumap_names_the_file(tmp_path):
    import shutil

    shutil.copytree(TOPOLOGIES / "old-kernel-masks", tmp_path / "tree")
    (tmp_path / "tree/sys/devices/system/node/node1/cpumap").write_text("ffff0000,zz\n")
    with pytest.raises(SpecError, match="node1/cpumap") as error:
        read_topology(tmp_path / "tree")
    assert "a CPU mask ('zz' is not a 32-bit hex word" in error.value.render()


def test_offline_cpus_from_cpu_online_files_and_siblings_from_masks():
    t = topology("old-kernel-masks")  # no cpu/online file; no thread_siblings_list
    assert t.online == tuple(c for c in range(64) if c not in (5, 37, 44))
    assert 5 not in t.cpus and 5 not in t.allowed and 5 not in t.nodes[0].cpus
    assert t.cpus[0].siblings == (0, 32) and t.cpus[32].core == 0 and t.cpus[63].siblings == (31, 63)
    assert t.cpus[12].siblings == (12,)  # its sibling 44 is offline


def test_cpus_of_an_offline_node_come_from_their_cpu_node_links(tmp_path):
    tree = TOPOLOGIES / "offline-node-links"  # no node0 directory; cpu0-5 link to node0
    t = read_topology(tree)
    assert sorted(t.nodes) == [0, 1]
    assert t.nodes[0].cpus == tuple(range(6)) and t.nodes[0].mem_total == 0
    assert t.nodes[1].cpus == tuple(range(6, 16)) and t.cpus[3].node == 0
    assert "node 0: CPUs 0-5 only through their cpuN/node0 links (no node0 directory); no memory" in t.notes
    capture(str(tree), str(tmp_path / "cap"))  # the links are captured too
    assert os.readlink(tmp_path / "cap/sys/devices/system/cpu/cpu0/node0") == "../../node/node0"
    again = read_topology(tmp_path / "cap")
    assert {n: v.cpus for n, v in again.nodes.items()} == {n: v.cpus for n, v in t.nodes.items()}


def test_legacy_cpuset_with_noprefix_found_through_proc_self_cpuset():
    t = topology("cpuset-v1-noprefix")
    assert t.allowed == (2, 3, 4, 5, 10, 11, 12, 13)
    assert t.cgroup.cpuset_source == "/dev/cpuset/appliance/cpus" and t.cgroup.mems == (0,)


def test_noprefix_cpuset_named_in_proc_self_cgroup(tmp_path):
    _write(tmp_path, {
        "proc/cpuinfo": "processor\t: 0\nflags\t\t: avx2\n\n",
        "proc/self/status": "Cpus_allowed_list:\t0-7\n",
        "proc/mounts": "cgroup /sys/fs/cgroup/cpuset cgroup rw,nosuid,cpuset,noprefix 0 0\n",
        "proc/self/cgroup": "4:cpuset:/job\n",
        "sys/devices/system/cpu/online": "0-7\n",
        "sys/fs/cgroup/cpuset/cpus": "0-7\n",
        "sys/fs/cgroup/cpuset/job/cpus": "1-2\n",
        "sys/fs/cgroup/cpuset/job/effective_cpus": "2\n",
    })
    t = read_topology(tmp_path)
    assert t.allowed == (2,) and t.cgroup.cpuset_source == "/sys/fs/cgroup/cpuset/job/effective_cpus"


def test_prefixed_v1_cpuset_found_only_through_proc_self_cpuset(tmp_path):
    _write(tmp_path, {
        "proc/cpuinfo": "processor\t: 0\nflags\t\t: avx2\n\n",
        "proc/self/status": "Cpus_allowed_list:\t0-7\n",
        "proc/mounts": "cgroup /sys/fs/cgroup/cpuset cgroup rw,nosuid,cpuset 0 0\n",
        "proc/self/cgroup": "1:name=systemd:/\n",
        "proc/self/cpuset": "/batch/job7\n",
        "sys/devices/system/cpu/online": "0-7\n",
        "sys/fs/cgroup/cpuset/batch/job7/cpuset.cpus": "4-5\n",
    })
    assert read_topology(tmp_path).allowed == (4, 5)


def test_cpus_that_every_node_lists_belong_to_all_of_them():
    t = topology("same-cpus-every-node")
    assert t.nodes[0].cpus == t.nodes[1].cpus == tuple(range(64))
    assert t.cpus[40].nodes == (0, 1) and t.cpus[40].node == 0  # placed as one node, not the last one read
    assert any("listed by several NUMA nodes" in note for note in t.notes)


def test_hybrid_cpus_have_kinds_fastest_first(tmp_path):
    intel = topology("hybrid-8p16e")
    assert intel.kinds == ("P-core", "E-core")
    assert {intel.cpus[c].kind for c in range(16)} == {0} and {intel.cpus[c].kind for c in range(16, 32)} == {1}
    assert intel.cpus[3].siblings == (2, 3) and intel.cpus[20].siblings == (20,)
    arm = topology("arm-biglittle-4x4")
    assert arm.kinds == ("capacity-1024 core", "capacity-397 core")
    assert [arm.cpus[c].kind for c in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert all(topology(name).kinds == () for name in ("2s-2n-32c-smt2", "arm64-64c", "this-machine"))
    for name, machine in (("intel", intel), ("arm", arm)):  # the capture holds what the kinds come from
        capture(machine.root, str(tmp_path / name))
        assert read_topology(tmp_path / name).cpus == machine.cpus


def test_a_root_that_does_not_exist_or_lacks_cpuinfo_is_named(tmp_path):
    with pytest.raises(SpecError, match="which does not exist"):
        read_topology(tmp_path / "nope")
    _write(tmp_path / "tree", {"sys/devices/system/cpu/online": "0-3\n"})
    with pytest.raises(SpecError, match="proc/cpuinfo"):
        read_topology(tmp_path / "tree")
    for root, missing in ((tmp_path / "nope", "which does not exist"), (tmp_path / "tree", "proc/cpuinfo")):
        for command in ("plan", "topology"):
            result = run_cli(command, "--root", str(root))
            assert result.code == 2 and missing in result.err and "Traceback" not in result.err
            assert "architecture" not in result.err


def test_real_guest_captures():
    two = topology("numa-vm-2node")
    assert sorted(two.nodes) == [0, 1] and two.nodes[0].cpus == (0, 1) and two.nodes[1].cpus == (2, 3)
    assert two.nodes[0].distances == (10, 21)
    pod = topology("numa-vm-cpuset")
    assert pod.allowed == (1, 2) and pod.memory_limit == 3 * GiB
    assert pod.cgroup.cpuset_source.endswith("/cpuset.cpus.effective")


def test_this_machine_capture_reads_like_a_small_vm():
    t = topology("this-machine")
    assert t.allowed == (0, 1) and len(t.nodes) == 1
    assert t.notes and "using /proc/meminfo" in t.notes[0]  # node meminfo undercounts on this VM


def test_live_machine_matches_the_kernel():
    t = read_topology("/")
    assert set(t.allowed) == set(os.sched_getaffinity(0)) & set(t.online)
    assert sum(len(n.cpus) for n in t.nodes.values()) == len(t.online)


def test_capture_reads_back_the_same(tmp_path):
    capture("/", str(tmp_path))
    live, captured = read_topology("/"), read_topology(tmp_path)
    for field in ("arch", "cpu_model", "isa", "online", "allowed", "cpus"):
        assert getattr(captured, field) == getattr(live, field), field
    assert {n: (v.cpus, v.mem_total) for n, v in captured.nodes.items()} == \
           {n: (v.cpus, v.mem_total) for n, v in live.nodes.items()}
    assert captured.cgroup.cpuset == live.cgroup.cpuset and captured.memory_limit == live.memory_limit


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_limit_of_a_parent_binds_the_child(tmp_path):
    _write(tmp_path, {
        "proc/cpuinfo": "processor\t: 0\nflags\t\t: avx2 fma\n\n",
        "proc/self/status": "Cpus_allowed_list:\t0-3\n",
        "proc/mounts": "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/devices/system/cpu/online": "0-3\n",
        "sys/fs/cgroup/cgroup.controllers": "cpuset memory\n",
        "sys/fs/cgroup/kubepods/memory.max": "max\n",
        "sys/fs/cgroup/kubepods/pod1/memory.max": f"{2 * GiB}\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/cpuset.cpus.effective": "2-3\n",
        "proc/meminfo": "MemTotal:  8388608 kB\nMemAvailable:  4194304 kB\n",
    })
    t = read_topology(tmp_path)
    assert t.memory_limit == 2 * GiB and t.cgroup.memory_source.endswith("pod1/memory.max")
    assert t.allowed == (2, 3)
    assert t.nodes[0].mem_total == 8 * GiB and t.nodes[0].cpus == (0, 1, 2, 3)  # no NUMA: one node


def test_memory_headroom_is_the_tightest_limit_less_its_usage(tmp_path):
    _write(tmp_path, {
        "proc/mounts": "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/fs/cgroup/cgroup.controllers": "cpuset memory\n",
        "sys/fs/cgroup/kubepods/memory.max": "max\n",
        "sys/fs/cgroup/kubepods/memory.current": f"{40 * GiB}\n",
        "sys/fs/cgroup/kubepods/pod1/memory.max": f"{6 * GiB}\n",
        "sys/fs/cgroup/kubepods/pod1/memory.current": f"{5 * GiB}\n",  # (its other container: 4 GiB)
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": f"{4 * GiB}\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.current": f"{1 * GiB}\n",
    })
    assert memory_headroom(Root(tmp_path)) == 1 * GiB  # the pod's 6 - 5, not the container's 4 - 1
    (tmp_path / "sys/fs/cgroup/kubepods/pod1/memory.max").write_text("max\n")
    assert memory_headroom(Root(tmp_path)) == 3 * GiB
    (tmp_path / "sys/fs/cgroup/kubepods/pod1/ctr/memory.max").write_text("max\n")
    assert memory_headroom(Root(tmp_path)) is None  # no limit on the way up


def test_memory_headroom_counts_memory_high_and_leaves_out_inactive_page_cache(tmp_path):
    _write(tmp_path, {
        "proc/mounts": "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
        "proc/self/cgroup": "0::/ctr\n",
        "sys/fs/cgroup/cgroup.controllers": "memory\n",
        "sys/fs/cgroup/ctr/memory.max": f"{8 * GiB}\n",
        "sys/fs/cgroup/ctr/memory.high": f"{6 * GiB}\n",  # throttled past this: the tighter one
        "sys/fs/cgroup/ctr/memory.current": f"{5 * GiB}\n",
        "sys/fs/cgroup/ctr/memory.stat": f"anon {2 * GiB}\nfile {3 * GiB}\ninactive_file {2 * GiB}\n",
    })
    assert memory_headroom(Root(tmp_path)) == 3 * GiB  # 6 - (5 - 2 of inactive file pages)
    group = memory_group(Root(tmp_path))  # found once (the KV residency thread), its files read on each call
    assert group is not None and group.version == 2 and group.directories == ("/sys/fs/cgroup/ctr", "/sys/fs/cgroup/")
    (tmp_path / "sys/fs/cgroup/ctr/memory.current").write_text(f"{6 * GiB}\n")
    assert memory_headroom(Root(tmp_path), group) == 2 * GiB
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset\n")
    assert memory_group(Root(tmp_path)) is None and memory_headroom(Root(tmp_path)) is None  # no memory controller


def test_memory_available_of_the_machine_or_of_some_nodes(tmp_path):
    _write(tmp_path, {
        "proc/meminfo": "MemTotal:  16777216 kB\nMemFree:  1048576 kB\nMemAvailable:  8388608 kB\n",
        "sys/devices/system/node/node0/meminfo": "Node 0 MemTotal:  8388608 kB\nNode 0 MemFree:  1048576 kB\n"
                                                 "Node 0 FilePages:  2097152 kB\nNode 0 Shmem:  1048576 kB\n",
        "sys/devices/system/node/node1/meminfo": "Node 1 MemTotal:  8388608 kB\nNode 1 MemFree:  3145728 kB\n",
    })
    root = Root(tmp_path)
    assert memory_available(root) == 8 * GiB
    assert memory_available(root, (0,)) == 2 * GiB  # free, plus file pages that are not shared memory
    assert memory_available(root, (0, 1)) == 5 * GiB


def test_memory_headroom_of_cgroup_v1(tmp_path):
    _write(tmp_path, {
        "proc/mounts": "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n",
        "proc/self/cgroup": "5:memory:/docker/abc\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: unlimited
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{30 * GiB}\n",
        "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{2 * GiB}\n",
        "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
        "sys/fs/cgroup/memory/docker/abc/memory.stat": f"cache {GiB // 2}\ntotal_inactive_file {GiB // 2}\n",
    })
    assert memory_headroom(Root(tmp_path)) == 3 * GiB // 2


def test_hybrid_cgroup_prefers_v1_controllers_and_unescapes_mounts(tmp_path):
    _write(tmp_path, {
        "proc/cpuinfo": "processor\t: 0\nflags\t\t: avx2\n\n",
        "proc/self/status": "Cpus_allowed_list:\t0-7\n",
        "proc/mounts": "cgroup /sys/fs/cgroup/my\\040cpuset cgroup rw,cpuset 0 0\n"
                       "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n",
        "proc/self/cgroup": "3:cpuset:/job\n0::/\n",
        "sys/devices/system/cpu/online": "0-7\n",
        "sys/fs/cgroup/my cpuset/job/cpuset.effective_cpus": "0-1,6\n",
        "sys/fs/cgroup/unified/cgroup.controllers": "\n",
    })
    t = read_topology(tmp_path)
    assert t.allowed == (0, 1, 6) and t.memory_limit is None


def test_synthetic_trees_match_their_generator():
    child = subprocess.run([sys.executable, str(TOPOLOGIES / "synthesize.py"), "--check"], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr


def test_topology_command_prints_and_captures(tmp_path):
    shown = run_cli("topology", "--root", str(TOPOLOGIES / "k8s-cpuset8-smt"))
    assert "allowed: 4-7,36-39" in shown.out and "cgroup memory limit: 16.00 GiB" in shown.out
    hybrid = run_cli("topology", "--root", str(TOPOLOGIES / "hybrid-8p16e"))
    assert "P-cores (fastest): CPUs 0-15" in hybrid.out and "E-cores: CPUs 16-31" in hybrid.out
    as_json = run_cli("topology", "--root", str(TOPOLOGIES / "arm64-64c"), "--json")
    assert '"arch": "aarch64"' in as_json.out
    assert run_cli("topology", "--capture", str(tmp_path / "cap")).code == 0
    assert (tmp_path / "cap" / "proc" / "cpuinfo").is_file()
