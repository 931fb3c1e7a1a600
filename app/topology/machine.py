"""The machine as the planner sees it: CPUs, physical cores, NUMA nodes, memory, ISA, cgroup limits.

`read_topology(root)` reads it the way the kernel reports it (sysfs, procfs, cgroup files) from a
root directory: "/" on a live machine, a captured tree in tests.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from app.spec.errors import Problem, SpecError
from app.topology.cgroup import CgroupLimits, read_cgroup_limits
from app.topology.cpulist import parse_cpulist
from app.topology.root import Root

SYS_CPU = "sys/devices/system/cpu"
SYS_NODE = "sys/devices/system/node"

# ISA flags the appliance cares about, as /proc/cpuinfo spells them.
X86_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
ARM_FLAGS = ("asimd", "asimdhp", "bf16", "i8mm", "sve", "sve2")


@dataclass(frozen=True)
class Cpu:
    """One logical CPU (hardware thread)."""

    id: int
    core: int  # physical core: the lowest CPU id among its SMT siblings
    socket: int
    node: int
    siblings: tuple[int, ...]  # SMT siblings including itself


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node; memory-only nodes (CXL, HBM) have no CPUs."""

    id: int
    cpus: tuple[int, ...]
    mem_total: int
    mem_available: int
    distances: tuple[int, ...] = ()


@dataclass(frozen=True)
class Topology:
    arch: str  # "x86_64" or "aarch64"
    cpu_model: str
    isa: frozenset[str]
    online: tuple[int, ...]
    allowed: tuple[int, ...]  # online CPUs this process may run on (affinity and cgroup cpuset)
    cpus: dict[int, Cpu]
    nodes: dict[int, NumaNode]
    cgroup: CgroupLimits
    root: str = "/"
    notes: tuple[str, ...] = field(default=())

    def node_of(self, cpu: int) -> int:
        return self.cpus[cpu].node

    @property
    def memory_limit(self) -> int | None:
        return self.cgroup.memory_max

    @property
    def allowed_mems(self) -> tuple[int, ...]:
        """NUMA nodes with memory this process may allocate on (the cgroup's cpuset.mems)."""
        with_memory = tuple(n for n, node in sorted(self.nodes.items()) if node.mem_total > 0)
        if self.cgroup.mems is None:
            return with_memory
        return tuple(n for n in with_memory if n in self.cgroup.mems) or with_memory

    def has(self, flag: str) -> bool:
        return flag in self.isa


def read_topology(root: str | Path = "/") -> Topology:
    """Read the topology below `root`."""
    return read_with(Root(root))


def read_with(root: Root) -> Topology:
    online = _online_cpus(root)
    nodes, notes = _nodes(root, online)
    node_of = {cpu: node.id for node in nodes.values() for cpu in node.cpus}
    first = min(nodes)  # a CPU no node lists (seen on odd firmware) goes to the first node
    cpus = {cpu: _cpu(root, cpu, node_of.get(cpu, first)) for cpu in online}
    cgroup = read_cgroup_limits(root)
    allowed = set(online) & set(_affinity(root, online))
    if cgroup.cpuset is not None:
        allowed &= set(cgroup.cpuset)
    arch, model, isa = _isa(root)
    return Topology(arch, model, isa, online, tuple(sorted(allowed)), cpus, nodes, cgroup,
                    str(root.path), tuple(notes))


def _online_cpus(root: Root) -> tuple[int, ...]:
    for name in ("online", "present", "possible"):
        cpus = root.cpulist(f"{SYS_CPU}/{name}")
        if cpus:
            return cpus
    processors = re.findall(r"^processor\s*:\s*(\d+)", root.text("proc/cpuinfo") or "", re.M)
    return tuple(sorted(int(p) for p in processors))


def _cpu(root: Root, cpu: int, node: int) -> Cpu:
    base = f"{SYS_CPU}/cpu{cpu}/topology"
    siblings = root.cpulist(f"{base}/thread_siblings_list") or root.cpulist(f"{base}/core_cpus_list") or (cpu,)
    if cpu not in siblings:
        siblings = (cpu,)
    socket = (root.integers(f"{base}/physical_package_id") or (0,))[0]
    return Cpu(cpu, min(siblings), max(socket, 0), node, siblings)


def _nodes(root: Root, online: tuple[int, ...]) -> tuple[dict[int, NumaNode], list[str]]:
    ids = sorted(int(name[4:]) for name in root.listdir(SYS_NODE) if re.fullmatch(r"node\d+", name))
    system_total, system_available = _meminfo(root.text("proc/meminfo") or "")
    if not ids:  # a kernel without NUMA: one node with everything
        return {0: NumaNode(0, online, system_total, system_available, (10,))}, []
    nodes = {}
    for node in ids:
        base = f"{SYS_NODE}/node{node}"
        total, available = _meminfo(root.text(f"{base}/meminfo") or "")
        cpus = tuple(c for c in root.cpulist(f"{base}/cpulist") or () if c in online)
        distances = root.integers(f"{base}/distance") or ()
        nodes[node] = NumaNode(node, cpus, total, available, distances)
    notes = []
    if len(nodes) == 1 and system_total > nodes[ids[0]].mem_total:
        # Seen on VMs with hot-plugged memory: /proc/meminfo counts memory no node claims.
        only = nodes[ids[0]]
        nodes[ids[0]] = NumaNode(only.id, only.cpus, system_total, system_available, only.distances)
        notes.append(f"node {only.id} meminfo shows less memory than /proc/meminfo; using /proc/meminfo")
    return nodes, notes


def _meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from /proc/meminfo or a node's meminfo."""
    values = {m.group(1): int(m.group(2)) * 1024
              for m in re.finditer(r"^(?:Node \d+ )?([\w()]+):\s+(\d+) kB", text, re.M)}
    total = values.get("MemTotal", 0)
    if "MemAvailable" in values:
        return total, values["MemAvailable"]
    # Nodes report no MemAvailable: free pages plus clean page cache is what the kernel can hand out.
    available = values.get("MemFree", 0) + max(values.get("FilePages", 0) - values.get("Shmem", 0), 0)
    return total, min(available, total)


def _affinity(root: Root, online: tuple[int, ...]) -> tuple[int, ...]:
    if root.is_live:
        return tuple(sorted(os.sched_getaffinity(0)))
    status = root.text("proc/self/status") or ""
    match = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
    if not match:
        return online
    try:
        return parse_cpulist(match.group(1))
    except ValueError:
        raise SpecError([Problem("(machine)", f"a CPU list in {root.path / 'proc/self/status'}",
                                 match.group(1))]) from None


def _isa(root: Root) -> tuple[str, str, frozenset[str]]:
    text = root.text("proc/cpuinfo") or ""
    first = text.split("\n\n", 1)[0]
    fields = dict(_field(line) for line in first.splitlines() if ":" in line)
    if "flags" in fields:
        arch, wanted, flags = "x86_64", X86_FLAGS, fields["flags"]
    elif "Features" in fields:
        arch, wanted, flags = "aarch64", ARM_FLAGS, fields["Features"]
    else:
        arch, wanted, flags = platform.machine() if root.is_live else "unknown", (), ""
    model = fields.get("model name") or _arm_model(fields)
    present = set(flags.split())
    return arch, model, frozenset(f for f in wanted if f in present)


def _field(line: str) -> tuple[str, str]:
    key, _, value = line.partition(":")
    return key.strip(), value.strip()


def _arm_model(fields: dict[str, str]) -> str:
    implementer, part = fields.get("CPU implementer"), fields.get("CPU part")
    return f"arm64 implementer {implementer} part {part}" if implementer else "unknown"
