"""Capture the files the topology reader uses into a tree that `--root` can read back later."""

from __future__ import annotations

from pathlib import Path

from app.topology.cpulist import format_cpulist as fmt
from app.topology.machine import Topology, read_with
from app.topology.root import Root
from app.units import format_size as size


def capture(root: str, dest: str) -> int:
    """Copy every file that reading `root`'s topology touches into `dest`; return how many."""
    reader = Root(root)
    read_with(reader)
    reader.text("proc/self/status")  # a live read takes affinity from the kernel; the capture needs the file
    for rel in sorted(reader.read_paths):
        target = Path(dest) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        # sysfs files report a size of 4096 whatever they hold: copy the text, not the bytes
        target.write_text(reader.text(rel) or "")
    for rel in sorted(reader.dirs_seen):
        (Path(dest) / rel).mkdir(parents=True, exist_ok=True)
    for rel, target in sorted(reader.links_seen.items()):
        link = Path(dest) / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(target)  # as sysfs has it: relative, and dangling when its node is offline
    return len(reader.read_paths)


def describe(topo: Topology) -> str:
    lines = [f"{topo.arch}: {topo.cpu_model}", f"ISA: {' '.join(sorted(topo.isa)) or '(none of interest)'}",
             f"online CPUs: {fmt(topo.online)}; allowed: {fmt(topo.allowed)}"]
    cg = topo.cgroup
    lines.append(f"cgroup cpuset: {fmt(cg.cpuset) if cg.cpuset else 'none'}" + (f" ({cg.cpuset_source})" if cg.cpuset_source else ""))
    lines.append(f"cgroup memory limit: {size(cg.memory_max) if cg.memory_max else 'none'}" + (f" ({cg.memory_source})" if cg.memory_source else ""))
    if cg.cpu_quota is not None:
        lines.append(f"cgroup CPU quota: {cg.cpu_quota:g} CPUs ({cg.cpu_quota_source})")
    for index, kind in enumerate(topo.kinds):
        cpus = [cpu for cpu in topo.online if topo.cpus[cpu].kind == index]
        lines.append(f"{kind}s{' (fastest)' if index == 0 else ''}: CPUs {fmt(cpus)}")
    for node in topo.nodes.values():
        cores = len({topo.cpus[c].core for c in node.cpus})
        lines.append(f"node {node.id}: CPUs {fmt(node.cpus) or '-'} ({cores} cores), memory {size(node.mem_total)} "
                     f"({size(node.mem_available)} available), distances {' '.join(map(str, node.distances))}")
    lines += [f"note: {note}" for note in topo.notes]
    return "\n".join(lines)
