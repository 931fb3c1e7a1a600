"""Write the synthetic machine trees in this folder, in the file formats the kernel uses.

Real captures (`this-machine`, `numa-vm-*`) come from `python -m app topology --capture DIR`;
the machines we do not have are described here and written out with:

    python tests/topologies/synthesize.py            # rewrite the trees
    python tests/topologies/synthesize.py --check    # exit 1 if a committed tree differs

Each machine lists its CPUs as (cpu, socket, core_id, node, siblings); offline CPUs get no
topology directory, as on a real kernel. CPU masks (`cpumap`, `thread_siblings`) are written the
way the kernel prints bitmaps: comma-separated 32-bit hex words, most significant first.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
GiB_KB = 1024 * 1024  # meminfo counts kB

SPR = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8"
ZEN4 = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
ICX = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni"
BDW = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
WSM = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 popcnt aes"
ADL = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 avx_vnni"
RK3588 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng"

CGROUP2_MOUNT = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0"


@dataclass
class Machine:
    name: str
    model: str
    flags: str
    cpus: list[tuple[int, int, int, int, tuple[int, ...]]]  # (cpu, socket, core_id, node, siblings)
    node_mem_gib: dict[int, int]
    arm: bool = False
    offline: tuple[int, ...] = ()
    allowed: str | None = None  # Cpus_allowed_list; default: every CPU
    cgroup: dict[str, str] = field(default_factory=dict)  # relative path -> content
    self_cgroup: str | None = "0::/\n"
    mounts: str = CGROUP2_MOUNT
    distances: dict[int, str] = field(default_factory=dict)
    old_sysfs: bool = False  # masks only (cpumap, thread_siblings), no cpu/online file (older kernels)
    node_links: bool = False  # cpuN/nodeM symlinks, as the kernel makes them
    hidden_nodes: tuple[int, ...] = ()  # nodes with CPUs but no node directory (an offline node)
    node_cpulists: dict[int, str] = field(default_factory=dict)  # what a node's cpulist says, when not the truth
    meminfo: bool = True
    pmu_cpus: dict[str, str] = field(default_factory=dict)  # Intel hybrid: cpu_core / cpu_atom -> CPU list
    capacity: dict[int, int] = field(default_factory=dict)  # cpuN/cpu_capacity (Arm big.LITTLE)
    arm_part: dict[int, str] = field(default_factory=dict)  # cpuinfo's "CPU part" per CPU (default 0xd40)
    self_cpuset: str | None = None  # /proc/self/cpuset


def smt_grid(sockets: int, cores: int, smt: int, nodes_per_socket: int = 1) -> list:
    """Linux's usual numbering: first every core's first thread, socket by socket, then the siblings."""
    primaries = sockets * cores
    cpus = []
    for thread in range(smt):
        for socket in range(sockets):
            for core in range(cores):
                first = socket * cores + core
                node = socket * nodes_per_socket + core * nodes_per_socket // cores
                siblings = tuple(first + t * primaries for t in range(smt))
                cpus.append((first + thread * primaries, socket, core, node, siblings))
    return sorted(cpus)


def machines() -> list[Machine]:
    return _common_machines() + _quirky_machines()


def _common_machines() -> list[Machine]:
    return [
        Machine("2s-2n-32c-smt2", "Intel(R) Xeon(R) Platinum 8480+", SPR, smt_grid(2, 32, 2), {0: 256, 1: 256},
                self_cgroup="0::/user.slice/user-0.slice/session-1.scope\n",
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
                        "sys/fs/cgroup/user.slice/user-0.slice/session-1.scope/cpuset.cpus.effective": "0-127\n",
                        "sys/fs/cgroup/user.slice/user-0.slice/session-1.scope/memory.max": "max\n"},
                distances={0: "10 21", 1: "21 10"}),
        Machine("1s-4n-nps4", "AMD EPYC 9354 32-Core Processor", ZEN4, smt_grid(1, 32, 2, nodes_per_socket=4),
                {0: 64, 1: 64, 2: 64, 3: 64},
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
                        "sys/fs/cgroup/cpuset.cpus.effective": "0-63\n"},
                distances={n: " ".join("10" if m == n else "12" for m in range(4)) for n in range(4)}),
        # A Guaranteed pod under the kubelet's static CPU manager: its container's cgroup (seen as "/"
        # through the cgroup namespace) holds 4 physical cores with both SMT threads, and 16 GiB.
        Machine("k8s-cpuset8-smt", "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", ICX, smt_grid(2, 16, 2),
                {0: 128, 1: 128}, allowed="4-7,36-39",
                mounts="cgroup2 /sys/fs/cgroup cgroup2 ro,nosuid,nodev,noexec,relatime 0 0",
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
                        "sys/fs/cgroup/cpuset.cpus.effective": "4-7,36-39\n",
                        "sys/fs/cgroup/cpuset.mems.effective": "0\n",
                        "sys/fs/cgroup/memory.max": f"{16 * 1024**3}\n"},
                distances={0: "10 20", 1: "20 10"}),
        Machine("memory-only-node", "Intel(R) Xeon(R) Gold 6430", SPR, smt_grid(1, 16, 2), {0: 128, 1: 64},
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"},
                distances={0: "10 20", 1: "20 10"}),
        Machine("arm64-64c", "", GRAVITON3, smt_grid(1, 64, 1), {0: 128}, arm=True,
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"}),
        # cgroup v1, as on older distributions; CPUs 5 and 12 taken offline with /sys/.../cpuN/online.
        Machine("offline-cpus", "Intel(R) Xeon(R) CPU E5-2620 v4 @ 2.10GHz", BDW, smt_grid(2, 8, 1), {0: 32, 1: 32},
                offline=(5, 12), self_cgroup="7:memory:/user.slice\n4:cpuset:/\n1:name=systemd:/user.slice\n",
                mounts="cgroup /sys/fs/cgroup/cpuset cgroup rw,nosuid,nodev,noexec,relatime,cpuset 0 0\n"
                       "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0",
                cgroup={"sys/fs/cgroup/cpuset/cpuset.effective_cpus": "0-15\n",
                        "sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes": "9223372036854771712\n",
                        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"},
                distances={0: "10 21", 1: "21 10"}),
        Machine("x86-no-avx2", "Intel(R) Xeon(R) CPU X5650 @ 2.67GHz", WSM, smt_grid(1, 4, 1), {0: 16},
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"}),
    ]


def _quirky_machines() -> list[Machine]:
    """Kinds of machine whose files the reader once misread: old kernels, odd firmware, hybrid CPUs."""
    return [
        # An older kernel: nodes give only `cpumap`, SMT only the `thread_siblings` mask, no cgroups and
        # no cpu/online file; CPUs 5 and 37 (both threads of core 5) and 44 are offline by cpuN/online.
        Machine("old-kernel-masks", "Intel(R) Xeon(R) CPU E5-2683 v4 @ 2.10GHz", BDW, smt_grid(2, 16, 2),
                {0: 64, 1: 64}, offline=(5, 37, 44), old_sysfs=True, mounts="", self_cgroup=None,
                distances={0: "10 21", 1: "21 10"}),
        # Node 0 is offline but its CPUs 0-5 are not: only their cpuN/node0 links say where they are.
        Machine("offline-node-links", "Intel(R) Xeon(R) Gold 6326 CPU @ 2.90GHz", ICX,
                [(c, 0, c, 0 if c < 6 else 1, (c,)) for c in range(16)], {1: 64}, node_links=True,
                hidden_nodes=(0,), cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"}),
        # The legacy cpuset file system (Android's /dev/cpuset): cgroup v1 with noprefix, so the files are
        # `cpus` and `mems`; no /proc/self/cgroup, only /proc/self/cpuset names the group. The affinity in
        # /proc/self/status is left wide, so that only the cpuset keeps ranks off CPUs 0-1, 6-9 and 14-15.
        Machine("cpuset-v1-noprefix", "Intel(R) Xeon(R) E-2288G CPU @ 3.70GHz", BDW, smt_grid(1, 8, 2), {0: 32},
                self_cgroup=None, self_cpuset="/appliance\n",
                mounts="none /dev/cpuset cgroup rw,relatime,cpuset,noprefix,"
                       "release_agent=/sbin/cpuset_release_agent 0 0",
                cgroup={"dev/cpuset/cpus": "0-15\n", "dev/cpuset/mems": "0\n",
                        "dev/cpuset/appliance/cpus": "2-5,10-13\n", "dev/cpuset/appliance/mems": "0\n"}),
        # A broken firmware table (SRAT): both nodes claim every CPU.
        Machine("same-cpus-every-node", "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", ICX, smt_grid(2, 16, 2),
                {0: 128, 1: 128}, node_cpulists={0: "0-63", 1: "0-63"},
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"},
                distances={0: "10 20", 1: "20 10"}),
        # No memory figure anywhere: no /proc/meminfo, no node meminfo.
        Machine("no-meminfo", "Intel(R) Xeon(R) E-2236 CPU @ 3.40GHz", BDW, smt_grid(1, 4, 1), {0: 16},
                meminfo=False, cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"}),
        # Intel hybrid (Raptor Lake): 8 P-cores with SMT2 (CPUs 0-15, siblings adjacent), 16 E-cores.
        Machine("hybrid-8p16e", "13th Gen Intel(R) Core(TM) i9-13900K", ADL,
                [(c, 0, c // 2, 0, (c - c % 2, c - c % 2 + 1)) for c in range(16)]
                + [(c, 0, c - 8, 0, (c,)) for c in range(16, 32)], {0: 64},
                pmu_cpus={"cpu_core": "0-15", "cpu_atom": "16-31"},
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"}),
        # Arm big.LITTLE (Rockchip RK3588): 4 Cortex-A55 (CPUs 0-3) and 4 Cortex-A76 (CPUs 4-7).
        Machine("arm-biglittle-4x4", "", RK3588, smt_grid(1, 8, 1), {0: 16}, arm=True,
                capacity={c: 397 if c < 4 else 1024 for c in range(8)},
                arm_part={c: "0xd05" if c < 4 else "0xd0b" for c in range(8)},
                cgroup={"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n"}),
    ]


def cpulist(cpus) -> str:
    from app.topology.cpulist import format_cpulist

    return format_cpulist(cpus)


def cpumask(cpus, nbits: int) -> str:
    """The kernel's bitmap format ("%*pb"): 32-bit hex words, most significant first, the first one
    only as wide as the bits above the last full word need ("ffff" for 16 CPUs)."""
    bits = sum(1 << cpu for cpu in cpus)
    words = max(1, -(-nbits // 32))
    top = nbits - 32 * (words - 1)
    text = [f"{(bits >> (32 * (words - 1))) & 0xffffffff:0{-(-top // 4)}x}"]
    text += [f"{(bits >> (32 * i)) & 0xffffffff:08x}" for i in reversed(range(words - 1))]
    return ",".join(text)


def write(machine: Machine, root: Path) -> None:
    def put(rel: str, text: str) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    every = [c[0] for c in machine.cpus]
    online = [c for c in every if c not in machine.offline]
    put("proc/cpuinfo", "".join(_cpuinfo(machine, cpu) for cpu in online))
    put("proc/self/status", f"Name:\tpython3\nCpus_allowed_list:\t{machine.allowed or cpulist(every)}\n")
    put("proc/mounts", "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n" + machine.mounts + "\n")
    if machine.self_cgroup is not None:
        put("proc/self/cgroup", machine.self_cgroup)
    if machine.self_cpuset is not None:
        put("proc/self/cpuset", machine.self_cpuset)
    if machine.meminfo:
        total = sum(machine.node_mem_gib.values()) * GiB_KB
        put("proc/meminfo", f"MemTotal:       {total} kB\nMemFree:        {total * 9 // 10} kB\n"
                            f"MemAvailable:   {total * 19 // 20} kB\n")
    base = "sys/devices/system/cpu"
    if not machine.old_sysfs:
        put(f"{base}/online", cpulist(online) + "\n")
        put(f"{base}/offline", (cpulist(machine.offline) if machine.offline else "") + "\n")
    put(f"{base}/possible", cpulist(every) + "\n")
    put(f"{base}/present", cpulist(every) + "\n")
    for name, cpus in machine.pmu_cpus.items():
        put(f"sys/devices/{name}/cpus", cpus + "\n")
    for cpu, socket, core, node, siblings in machine.cpus:
        put(f"{base}/cpu{cpu}/online", "0\n" if cpu in machine.offline else "1\n")
        if cpu in machine.offline:
            continue
        if cpu in machine.capacity:
            put(f"{base}/cpu{cpu}/cpu_capacity", f"{machine.capacity[cpu]}\n")
        if machine.node_links:
            link = root / f"{base}/cpu{cpu}/node{node}"
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../node/node{node}", link)
        live = [s for s in siblings if s not in machine.offline]
        if machine.old_sysfs:
            sets = (("thread_siblings", cpumask(live, len(every))), ("core_cpus", cpumask(live, len(every))))
        else:
            sets = (("thread_siblings_list", cpulist(live)), ("core_cpus_list", cpulist(live)))
        for name, value in (("physical_package_id", socket), ("core_id", core)) + sets:
            put(f"{base}/cpu{cpu}/topology/{name}", f"{value}\n")
    _nodes(machine, put)
    for rel, text in machine.cgroup.items():
        put(rel, text)


def _cpuinfo(machine: Machine, cpu: int) -> str:
    if machine.arm:
        return (f"processor\t: {cpu}\nBogoMIPS\t: 2100.00\nFeatures\t: {machine.flags}\n"
                "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\n"
                f"CPU part\t: {machine.arm_part.get(cpu, '0xd40')}\n\n")
    return f"processor\t: {cpu}\nvendor_id\t: GenuineIntel\nmodel name\t: {machine.model}\nflags\t\t: {machine.flags}\n\n"


def _nodes(machine: Machine, put) -> None:
    base = "sys/devices/system/node"
    ids = sorted(machine.node_mem_gib)
    every = [c[0] for c in machine.cpus]
    with_cpus = sorted({c[3] for c in machine.cpus if c[0] not in machine.offline} - set(machine.hidden_nodes))
    put(f"{base}/online", cpulist(ids) + "\n")
    put(f"{base}/possible", cpulist(sorted(set(ids) | set(machine.hidden_nodes))) + "\n")
    put(f"{base}/has_cpu", cpulist(with_cpus) + "\n")
    put(f"{base}/has_memory", cpulist(ids) + "\n")
    for node in ids:
        kb = machine.node_mem_gib[node] * GiB_KB
        cpus = [c[0] for c in machine.cpus if c[3] == node]
        if node in machine.node_cpulists:
            put(f"{base}/node{node}/cpulist", machine.node_cpulists[node] + "\n")
        elif machine.old_sysfs:
            put(f"{base}/node{node}/cpumap", cpumask(cpus, len(every)) + "\n")
        else:
            put(f"{base}/node{node}/cpulist", cpulist(cpus) + "\n")
        put(f"{base}/node{node}/distance", machine.distances.get(node, "10") + "\n")
        if machine.meminfo:
            put(f"{base}/node{node}/meminfo",
                f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree:        {kb * 8 // 10} kB\n"
                f"Node {node} MemUsed:        {kb * 2 // 10} kB\nNode {node} FilePages:      {kb // 10} kB\n"
                f"Node {node} Shmem:          {kb // 100} kB\n")


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(HERE.parent.parent))
    check = "--check" in argv
    out = Path(tempfile.mkdtemp()) if check else HERE
    stale = []
    for machine in machines():
        target = out / machine.name
        shutil.rmtree(target, ignore_errors=True)
        write(machine, target)
        if check and _differs(target, HERE / machine.name):
            stale.append(machine.name)
    if stale:
        print(f"trees differ from synthesize.py: {', '.join(stale)}; rerun it", file=sys.stderr)
    return 1 if stale else 0


def _differs(a: Path, b: Path) -> bool:
    return _entries(a) != _entries(b) or any(
        not filecmp.cmp(a / f, b / f, shallow=False) for f, kind in _entries(a) if kind == "file")


def _entries(tree: Path) -> list[tuple[Path, str]]:
    """Every file and symlink below `tree`; a symlink by its target (it may dangle, as sysfs's do)."""
    if not tree.exists():
        return []
    entries = []
    for path in tree.rglob("*"):
        if path.is_symlink():
            entries.append((path.relative_to(tree), "-> " + os.readlink(path)))
        elif path.is_file():
            entries.append((path.relative_to(tree), "file"))
    return sorted(entries)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
