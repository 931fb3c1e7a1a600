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

from app.spec.errors import Described, Problem, SpecError
from app.topology.cgroup import CgroupLimits, read_cgroup_limits
from app.topology.cpulist import parse_cpulist
from app.topology.nodes import SYS_CPU, NumaNode, read_nodes
from app.topology.root import Root

# ISA flags the appliance cares about, as /proc/cpuinfo spells them.
X86_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
ARM_FLAGS = ("asimd", "asimdhp", "bf16", "i8mm", "sve", "sve2")

# Intel hybrid CPUs register one perf PMU per kind of core, each listing its CPUs.
INTEL_HYBRID = (("sys/devices/cpu_core/cpus", "P-core"), ("sys/devices/cpu_atom/cpus", "E-core"))


@dataclass(frozen=True)
class Cpu:
    """One logical CPU (hardware thread)."""

    id: int
    core: int  # physical core: the lowest CPU id among its SMT siblings
    socket: int
    node: int
    siblings: tuple[int, ...]  # SMT siblings including itself
    nodes: tuple[int, ...] = ()  # every node that lists it: (node,), or several on broken firmware
    kind: int = 0  # 0 is the fastest kind of core; hybrid CPUs (P/E, big.LITTLE) have slower kinds too


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
    kinds: tuple[str, ...] = ()  # names of the kinds of core, fastest first; () when all cores are alike
    memory_files: tuple[str, ...] = ()  # where the reader looked for memory sizes, below root

    def node_of(self, cpu: int) -> int:
        return self.cpus[cpu].node

    def nodes_of(self, cpu: int) -> tuple[int, ...]:
        """Every node that lists `cpu`; more than one only when the firmware's table is broken."""
        return self.cpus[cpu].nodes or (self.cpus[cpu].node,)

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
    _check_root(root)
    online = _online_cpus(root)
    numa = read_nodes(root, online)
    kind_of, kinds = _kinds(root, online)
    cpus = {cpu: _cpu(root, cpu, online, numa.claims[cpu], kind_of.get(cpu, 0)) for cpu in online}
    cgroup = read_cgroup_limits(root)
    allowed = set(online) & set(_affinity(root, online))
    if cgroup.cpuset is not None:
        allowed &= set(cgroup.cpuset)
    arch, model, isa = _isa(root)
    return Topology(arch, model, isa, online, tuple(sorted(allowed)), cpus, numa.nodes, cgroup, str(root.path),
                    numa.notes, kinds, numa.memory_files)


def _check_root(root: Root) -> None:
    """A root that is not a machine tree is named as such, not read as a machine of unknown architecture."""
    where = "(machine)" if root.is_live else "--root"
    allowed = "a machine's root directory holding proc/cpuinfo and sys/ (as `topology --capture DIR` writes)"
    if not root.path.is_dir():
        state = "which does not exist" if not root.path.exists() else "which is not a directory"
        raise SpecError([Problem(where, allowed, Described(f"{root.path}, {state}"))])
    if root.text("proc/cpuinfo") is None:
        raise SpecError([Problem(where, allowed, Described(f"{root.path} without proc/cpuinfo"))])


def _online_cpus(root: Root) -> tuple[int, ...]:
    online = root.cpulist(f"{SYS_CPU}/online")
    if online:
        return online
    # Older kernels have no cpu/online file: a present CPU is online unless its cpuN/online says 0.
    for name in ("present", "possible"):
        cpus = root.cpulist(f"{SYS_CPU}/{name}")
        if cpus:
            return tuple(cpu for cpu in cpus if _is_online(root, cpu))
    processors = re.findall(r"^processor\s*:\s*(\d+)", root.text("proc/cpuinfo") or "", re.M)
    return tuple(sorted(int(p) for p in processors))


def _is_online(root: Root, cpu: int) -> bool:
    state = root.line(f"{SYS_CPU}/cpu{cpu}/online")
    if state is None:  # CPUs that cannot be unplugged (often cpu0) have no online file
        return root.exists(f"{SYS_CPU}/cpu{cpu}")
    return state != "0"


def _cpu(root: Root, cpu: int, online: tuple[int, ...], nodes: tuple[int, ...], kind: int) -> Cpu:
    base = f"{SYS_CPU}/cpu{cpu}/topology"
    siblings = (root.cpulist(f"{base}/thread_siblings_list") or root.cpulist(f"{base}/core_cpus_list")
                or root.cpumask(f"{base}/thread_siblings") or root.cpumask(f"{base}/core_cpus") or (cpu,))
    siblings = tuple(s for s in siblings if s in online) if cpu in siblings else (cpu,)
    socket = (root.integers(f"{base}/physical_package_id") or (0,))[0]
    return Cpu(cpu, min(siblings), max(socket, 0), nodes[0], siblings, nodes, kind)


def _kinds(root: Root, online: tuple[int, ...]) -> tuple[dict[int, int], tuple[str, ...]]:
    """Each CPU's kind of core (0 = fastest) and the kinds' names; no kinds when all cores are alike.

    The kernel's cpu_capacity (Arm big.LITTLE, newer x86 kernels) ranks cores by speed; Intel hybrid
    CPUs without it list their P- and E-cores in the cpu_core and cpu_atom PMUs.
    """
    capacity = {cpu: (root.integers(f"{SYS_CPU}/cpu{cpu}/cpu_capacity") or (0,))[0] for cpu in online}
    levels = sorted(set(capacity.values()) - {0}, reverse=True)
    if len(levels) > 1:
        return ({cpu: levels.index(c) if c else len(levels) - 1 for cpu, c in capacity.items()},
                tuple(f"capacity-{c} core" for c in levels))
    lists = [(root.cpulist(path), name) for path, name in INTEL_HYBRID]
    if all(cpus for cpus, _ in lists):
        big = set(lists[0][0])
        return {cpu: 0 if cpu in big else 1 for cpu in online}, tuple(name for _, name in lists)
    return {}, ()


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
