"""NUMA nodes as the kernel reports them: each node's CPUs, memory and distances.

A node's CPUs come from its `cpulist`, or its `cpumap` mask on older kernels. A CPU that no node
lists takes the node its `cpuN/nodeM` link names: an offline node has no directory, but its CPUs
may stay online. On broken firmware several nodes list the same CPU; such a CPU keeps every node
that lists it, so that the planner can tell it belongs to none of them alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from app.topology.cpulist import format_cpulist as fmt
from app.topology.root import Root

SYS_CPU = "sys/devices/system/cpu"
SYS_NODE = "sys/devices/system/node"


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node; memory-only nodes (CXL, HBM) have no CPUs."""

    id: int
    cpus: tuple[int, ...]
    mem_total: int
    mem_available: int
    distances: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeMap:
    nodes: dict[int, NumaNode]
    claims: dict[int, tuple[int, ...]]  # CPU -> the nodes that list it: one, or several on broken firmware
    memory_files: tuple[str, ...]  # where the memory sizes were looked for
    notes: tuple[str, ...]


def read_nodes(root: Root, online: tuple[int, ...]) -> NodeMap:
    ids = sorted(int(name[4:]) for name in root.listdir(SYS_NODE) if re.fullmatch(r"node\d+", name))
    system_total, system_available = _meminfo(root.text("proc/meminfo") or "")
    if not ids:  # a kernel without NUMA: one node with everything
        node = NumaNode(0, online, system_total, system_available, (10,))
        return NodeMap({0: node}, {cpu: (0,) for cpu in online}, ("proc/meminfo",), ())
    nodes = {node: _node(root, node, online) for node in ids}
    nodes, notes = _add_linked_cpus(root, nodes, online)
    claims, claim_notes = _claims(nodes, online)
    memory_files = tuple(f"{SYS_NODE}/node{node}/meminfo" for node in ids)
    if len(ids) == 1:
        memory_files = ("proc/meminfo",) + memory_files
        only = nodes[ids[0]]
        if system_total > only.mem_total:
            # Seen on VMs with hot-plugged memory: /proc/meminfo counts memory no node claims.
            nodes[only.id] = replace(only, mem_total=system_total, mem_available=system_available)
            notes.append(f"node {only.id} meminfo shows less memory than /proc/meminfo; using /proc/meminfo")
    return NodeMap(nodes, claims, memory_files, tuple(notes + claim_notes))


def _node(root: Root, node: int, online: tuple[int, ...]) -> NumaNode:
    base = f"{SYS_NODE}/node{node}"
    listed = root.cpulist(f"{base}/cpulist")
    if listed is None:  # kernels before cpulist existed give only the mask
        listed = root.cpumask(f"{base}/cpumap") or ()
    total, available = _meminfo(root.text(f"{base}/meminfo") or "")
    distances = root.integers(f"{base}/distance") or ()
    return NumaNode(node, tuple(c for c in listed if c in online), total, available, distances)


def _add_linked_cpus(root: Root, nodes: dict[int, NumaNode],
                     online: tuple[int, ...]) -> tuple[dict[int, NumaNode], list[str]]:
    """Place the CPUs no node lists by their cpuN/nodeM link; a node known only that way has no memory."""
    listed = {cpu for node in nodes.values() for cpu in node.cpus}
    linked: dict[int, list[int]] = {}
    for cpu in online:
        if cpu not in listed:
            links = root.links(f"{SYS_CPU}/cpu{cpu}", r"node\d+")
            if links:
                linked.setdefault(int(links[0][4:]), []).append(cpu)
    nodes, notes = dict(nodes), []
    for node, cpus in sorted(linked.items()):
        note = f"node {node}: CPUs {fmt(cpus)} only through their cpuN/node{node} links"
        if node in nodes:
            nodes[node] = replace(nodes[node], cpus=tuple(sorted(nodes[node].cpus + tuple(cpus))))
            notes.append(note)
        else:
            nodes[node] = NumaNode(node, tuple(cpus), 0, 0)
            notes.append(f"{note} (no node{node} directory); no memory")
    return dict(sorted(nodes.items())), notes


def _claims(nodes: dict[int, NumaNode], online: tuple[int, ...]) -> tuple[dict[int, tuple[int, ...]], list[str]]:
    claims = {cpu: tuple(n for n, node in nodes.items() if cpu in node.cpus) for cpu in online}
    notes = []
    unclaimed = [cpu for cpu, claimed in claims.items() if not claimed]
    if unclaimed:  # seen on odd firmware
        first = min(nodes)
        claims.update({cpu: (first,) for cpu in unclaimed})
        notes.append(f"CPUs {fmt(unclaimed)} are on no node's list and have no node link; taken as node {first}'s")
    shared = [cpu for cpu, claimed in claims.items() if len(claimed) > 1]
    if shared:
        owners = sorted({n for cpu in shared for n in claims[cpu]})
        notes.append(f"CPUs {fmt(shared)} are listed by several NUMA nodes ({', '.join(map(str, owners))}): "
                     "a firmware table error; the planner takes them as one node and interleaves their memory")
    return claims, notes


def memory_available(root: Root, nodes: tuple[int, ...] | None = None) -> int:
    """What the machine (/proc/meminfo's MemAvailable), or these NUMA nodes together, can hand out now, in bytes."""
    if nodes is None:
        return _meminfo(root.text("proc/meminfo") or "")[1]
    return sum(_meminfo(root.text(f"sys/devices/system/node/node{n}/meminfo") or "")[1] for n in nodes)


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
