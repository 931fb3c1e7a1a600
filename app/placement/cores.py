"""Which CPUs each rank and the HTTP frontend get: auto placement, or checked explicit lists.

Auto placement:
- the frontend takes the `reserve_frontend` highest-numbered allowed CPUs, preferring little cores
  on a hybrid CPU, then SMT siblings that no rank thread would use anyway (ranks run one thread per
  physical core by default);
- on a hybrid CPU (P/E cores, big.LITTLE) ranks use only the fastest kind of core when it has a
  core per rank (a rank's threads meet at barriers, so a rank runs at its slowest core's speed);
  slower kinds are added only when the faster ones are too few, and a rank never mixes kinds;
- ranks are spread over groups of cores, one group per NUMA node and kind of core, so that the
  smallest rank is as large as possible (D'Hondt on core counts; ties go to the group with fewer
  ranks, then the lowest node): with as many equal nodes as ranks, each rank gets a whole node; a
  group that holds several ranks is cut into contiguous runs of cores, and a rank never spans two
  nodes;
- slots are filled replica by replica, so the TP ranks of a replica that do not fit one node each
  stay next to each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.spec.errors import Described, Problem, SpecError
from app.spec.schema import CoresSpec
from app.topology.cpulist import format_cpulist as fmt
from app.topology.machine import Topology


@dataclass(frozen=True)
class Layout:
    ranks: tuple[tuple[int, ...], ...]  # CPUs of each rank, replica-major
    frontend: tuple[int, ...]
    frontend_shared: bool  # True: no CPU is reserved; the frontend runs on all allowed CPUs
    warnings: tuple[str, ...]


def layout_cores(cores: CoresSpec, tp: int, dp: int, topo: Topology) -> Layout:
    if isinstance(cores.ranks, str):
        layout = _within_quota(_auto(cores, tp, dp, topo), topo)
    else:
        layout = _explicit(cores, topo)
        layout = Layout(layout.ranks, layout.frontend, layout.frontend_shared,
                        layout.warnings + _over_quota(layout, topo))
    checks = _shared_cores(layout, topo) + _mixed_kinds(layout.ranks, topo)
    return Layout(layout.ranks, layout.frontend, layout.frontend_shared, layout.warnings + checks)


# --- the cgroup's CPU quota -----------------------------------------------------------------------


def _within_quota(layout: Layout, topo: Topology) -> Layout:
    """Auto ranks cut to the cgroup's CPU quota (a pod's CPU limit without the static CPU manager's whole cores,
    `docker run --cpus`): threads past it only wait their turn at every barrier (measured at a quota of 0.5 CPU:
    two threads 2.6x as slow as one). Every rank keeps the same number of threads, ceil(quota) / ranks (at least
    one): a tensor-parallel group waits for its slowest rank at every all-reduce, so a thread more on one rank would
    spend quota for nothing. A rank keeps one CPU of each core before a second (its SMT siblings last)."""
    allowed, threads = _quota_threads(topo), sum(len(rank) for rank in layout.ranks)
    if allowed is None or threads <= allowed:
        return layout
    each = max(1, allowed // len(layout.ranks))

    def first_of_each_core(rank: tuple[int, ...]) -> tuple[int, ...]:
        order = sorted(rank, key=lambda cpu: (sorted(topo.cpus[cpu].siblings).index(cpu), cpu))
        return tuple(sorted(order[:each]))

    ranks = tuple(first_of_each_core(rank) for rank in layout.ranks)
    kept = sum(len(rank) for rank in ranks)
    plural = "s" if kept != 1 else ""
    warning = (f"the cgroup's CPU quota is {topo.cgroup.cpu_quota:g} CPUs ({topo.cgroup.cpu_quota_source}), fewer "
               f"than the {threads} CPUs the ranks would run on: they run {kept} thread{plural} in all "
               f"({', '.join(fmt(rank) for rank in ranks)}; the HTTP frontend shares the quota); a whole-CPU limit "
               "equal to its request, under the kubelet's static CPU manager policy, grants whole cores instead")
    return Layout(ranks, layout.frontend, layout.frontend_shared, layout.warnings + (warning,))


def _over_quota(layout: Layout, topo: Topology) -> tuple[str, ...]:
    """Explicit ranks are kept as written; a quota they exceed is said."""
    allowed, threads = _quota_threads(topo), sum(len(rank) for rank in layout.ranks)
    if allowed is None or threads <= allowed:
        return ()
    return (f"the ranks run {threads} threads, but the cgroup's CPU quota is {topo.cgroup.cpu_quota:g} CPUs "
            f"({topo.cgroup.cpu_quota_source}): threads past it wait their turn at every barrier; list "
            f"{allowed} CPUs in all in cores.ranks",)


def _quota_threads(topo: Topology) -> int | None:
    """The threads the cgroup's CPU quota keeps busy, ceil(quota); None without a quota."""
    quota = topo.cgroup.cpu_quota
    return None if quota is None else math.ceil(quota - 1e-9)


# --- auto ---------------------------------------------------------------------------------------


def _auto(cores: CoresSpec, tp: int, dp: int, topo: Topology) -> Layout:
    usable = _usable(cores, topo)
    if cores.frontend is not None:
        _check_inside(cores.frontend, topo, "cores.frontend")
        frontend = cores.frontend
    else:
        frontend = _reserve(usable, _reserved_count(cores.reserve_frontend, len(usable), tp * dp), cores.use_smt, topo)
    usable -= set(frontend)
    world = tp * dp
    if world > len(usable):
        raise _too_many_ranks(usable, cores, tp, dp, len(frontend))
    units, warnings = _units(usable, world, cores.use_smt, topo)
    units, slower = _fastest(units, world, topo)
    counts = _dhondt(world, {group: len(group_units) for group, group_units in units.items()})
    ranks = []
    for group in sorted(counts):
        ranks.extend(_split(units[group], counts[group]))
    warnings += [_idle(group, len(units[group]), topo) for group in sorted(units) if group not in counts]
    shared = not frontend
    return Layout(tuple(ranks), frontend or topo.allowed, shared, tuple(warnings + slower))


def _usable(cores: CoresSpec, topo: Topology) -> set[int]:
    allowed = set(topo.allowed)
    if cores.numa_nodes is None:
        return allowed
    with_cpus = sorted({topo.node_of(cpu) for cpu in allowed})
    missing = [node for node in cores.numa_nodes if node not in with_cpus]
    if missing:
        raise SpecError([Problem("cores.numa_nodes", f"NUMA nodes with CPUs this process may use: {with_cpus}",
                                 Described(f"node{'s' if len(missing) > 1 else ''} {missing}"))])
    return {cpu for cpu in allowed if topo.node_of(cpu) in cores.numa_nodes}


AUTO_RESERVE_FROM = 8  # usable CPUs from which "auto" keeps one for the HTTP frontend


def _reserved_count(reserve: int | str, usable: int, world: int) -> int:
    if reserve != "auto":
        return reserve
    return 1 if usable >= AUTO_RESERVE_FROM and usable - 1 >= world else 0


def _reserve(usable: set[int], count: int, use_smt: bool, topo: Topology) -> tuple[int, ...]:
    if count == 0:
        return ()
    if count >= len(usable):
        raise SpecError([Problem("cores.reserve_frontend",
                                 f"fewer than the {len(usable)} usable CPUs ({fmt(usable)}), so ranks keep some", count)])
    spare = set() if use_smt else {cpu for cpu in usable if cpu != _first_sibling(cpu, usable, topo)}
    # slowest kind of core first (the frontend waits on the network, not on arithmetic), then spare
    # SMT siblings, then the highest numbers
    order = sorted(usable, key=lambda cpu: (-topo.cpus[cpu].kind, cpu not in spare, -cpu))
    return tuple(sorted(order[:count]))


def _first_sibling(cpu: int, usable: set[int], topo: Topology) -> int:
    return min(s for s in topo.cpus[cpu].siblings if s in usable)


def _too_many_ranks(usable: set[int], cores: CoresSpec, tp: int, dp: int, reserved: int) -> SpecError:
    left = f"{len(usable)} CPU{'s' if len(usable) != 1 else ''} ({fmt(usable)})"
    within = f" in cores.numa_nodes {list(cores.numa_nodes)}" if cores.numa_nodes is not None else ""
    return SpecError([Problem(
        "parallel",
        f"at most one rank per CPU: {left} left for ranks after {reserved} for the frontend "
        f"(cores.reserve_frontend or cores.frontend){within}",
        Described(f"tp x dp = {tp} x {dp} = {tp * dp} ranks"))])


Group = tuple[int, int]  # (NUMA node, kind of core)


def _units(usable: set[int], world: int, use_smt: bool,
           topo: Topology) -> tuple[dict[Group, list[tuple[int, ...]]], list[str]]:
    """Per group, the placement units in core order: a physical core's threads, or single CPUs."""
    by_core: dict[int, list[int]] = {}
    for cpu in sorted(usable):
        by_core.setdefault(topo.cpus[cpu].core, []).append(cpu)
    threads = [tuple(cpus) if use_smt else (cpus[0],) for _, cpus in sorted(by_core.items())]
    warnings = []
    if world > len(threads):
        # one CPU per unit, core by core, so that SMT siblings tend to stay in the same rank
        threads = [(cpu,) for _, cpus in sorted(by_core.items()) for cpu in cpus]
        warnings.append(f"fewer physical cores ({len(by_core)}) than ranks ({world}): "
                        "ranks run on SMT siblings of each other's cores")
    units: dict[Group, list[tuple[int, ...]]] = {}
    for unit in threads:
        units.setdefault((topo.node_of(unit[0]), topo.cpus[unit[0]].kind), []).append(unit)
    return units, warnings


def _fastest(units: dict[Group, list[tuple[int, ...]]], world: int,
             topo: Topology) -> tuple[dict[Group, list[tuple[int, ...]]], list[str]]:
    """Keep the fastest kinds of core that hold one unit per rank; say which slower cores stay idle."""
    kinds = sorted({kind for _, kind in units})
    for used in range(1, len(kinds) + 1):
        kept = {group: group_units for group, group_units in units.items() if group[1] in kinds[:used]}
        if sum(len(group_units) for group_units in kept.values()) >= world:
            break
    warnings = []
    for kind in kinds[used:]:
        cpus = [cpu for group, group_units in units.items() if group[1] == kind for unit in group_units for cpu in unit]
        count = sum(len(group_units) for group, group_units in units.items() if group[1] == kind)
        warnings.append(f"the {count} {topo.kinds[kind]}s (CPUs {fmt(cpus)}) run no rank: the ranks fit on "
                        "faster cores, and a rank's threads wait for its slowest core at every barrier")
    return kept, warnings


def _idle(group: Group, cores: int, topo: Topology) -> str:
    node, kind = group
    if topo.kinds:
        return (f"NUMA node {node}'s {topo.kinds[kind]}s ({cores} cores) run no rank; "
                "raise parallel.tp or parallel.dp to use them")
    return f"NUMA node {node} ({cores} cores) runs no rank; raise parallel.tp or parallel.dp to use it"


def _dhondt(seats: int, sizes: dict[Group, int]) -> dict[Group, int]:
    """Give `seats` ranks to groups, each time to the group whose ranks would be largest.

    Ties go to the group with fewer ranks (spreading ranks over memory controllers), then the lowest.
    """
    counts: dict[Group, int] = {}
    for _ in range(seats):
        best = min((node for node in sorted(sizes) if counts.get(node, 0) < sizes[node]),
                   key=lambda node: (-sizes[node] / (counts.get(node, 0) + 1), counts.get(node, 0), node))
        counts[best] = counts.get(best, 0) + 1
    return counts


def _split(units: list[tuple[int, ...]], parts: int) -> list[tuple[int, ...]]:
    """Cut units into `parts` contiguous runs, sizes differing by at most one (larger first)."""
    size, extra = divmod(len(units), parts)
    runs, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        runs.append(tuple(sorted(cpu for unit in units[start:end] for cpu in unit)))
        start = end
    return runs


# --- explicit -----------------------------------------------------------------------------------


def _explicit(cores: CoresSpec, topo: Topology) -> Layout:
    problems = []
    for index, cpus in enumerate(cores.ranks):
        problems += _outside(cpus, topo, f"cores.ranks[{index}]")
        for other in range(index):
            overlap = set(cpus) & set(cores.ranks[other])
            if overlap:
                problems.append(Problem(f"cores.ranks[{index}]", "CPU lists that do not overlap",
                                        Described(f"CPUs {fmt(overlap)}, also in cores.ranks[{other}]")))
    in_ranks = {cpu for cpus in cores.ranks for cpu in cpus}
    if cores.frontend is not None:
        problems += _outside(cores.frontend, topo, "cores.frontend")
        if set(cores.frontend) & in_ranks:
            problems.append(Problem("cores.frontend", "CPUs that no rank uses",
                                    Described(f"CPUs {fmt(set(cores.frontend) & in_ranks)}, also in cores.ranks")))
    if problems:
        raise SpecError(problems)
    warnings = [f"rank {i} ({fmt(cpus)}) spans NUMA nodes {_nodes(cpus, topo)}: its memory is interleaved"
                for i, cpus in enumerate(cores.ranks) if len(_nodes(cpus, topo)) > 1]
    frontend = cores.frontend or tuple(cpu for cpu in topo.allowed if cpu not in in_ranks)
    if not frontend:
        warnings.append("every allowed CPU is in a rank, so the frontend shares them; "
                        "leave a CPU out of cores.ranks for it")
    return Layout(tuple(cores.ranks), frontend or topo.allowed, not frontend, tuple(warnings))


def _outside(cpus: tuple[int, ...], topo: Topology, path: str) -> list[Problem]:
    outside = set(cpus) - set(topo.allowed)
    if not outside:
        return []
    return [Problem(path, f"CPUs this process may use: {fmt(topo.allowed)}",
                    Described(f"CPUs {fmt(outside)}, outside that set"))]


def _check_inside(cpus: tuple[int, ...], topo: Topology, path: str) -> None:
    problems = _outside(cpus, topo, path)
    if problems:
        raise SpecError(problems)


def _nodes(cpus: tuple[int, ...], topo: Topology) -> list[int]:
    return sorted({topo.node_of(cpu) for cpu in cpus})


def _shared_cores(layout: Layout, topo: Topology) -> tuple[str, ...]:
    """Warn where two ranks, or a rank and the frontend, run on SMT siblings of the same physical core."""
    groups = [(f"rank {i}", cpus) for i, cpus in enumerate(layout.ranks)]
    if not layout.frontend_shared:
        groups.append(("the frontend", layout.frontend))
    cores = [{topo.cpus[cpu].core for cpu in cpus} for _, cpus in groups]
    warnings = []
    for i, (name, _) in enumerate(groups):
        for j in range(i + 1, len(groups)):
            shared = sorted(cores[i] & cores[j])
            if shared:
                cpus = fmt(cpu for core in shared for cpu in topo.cpus[core].siblings)
                warnings.append(f"{name} and {groups[j][0]} share {len(shared)} physical core(s) "
                                f"through SMT siblings (CPUs {cpus})")
    return tuple(warnings)


def _mixed_kinds(ranks: tuple[tuple[int, ...], ...], topo: Topology) -> tuple[str, ...]:
    """Warn where a rank runs on more than one kind of core: each barrier waits for the slowest."""
    warnings = []
    for index, cpus in enumerate(ranks):
        kinds = sorted({topo.cpus[cpu].kind for cpu in cpus})
        if len(kinds) > 1:
            names = [f"{topo.kinds[kind]}s" for kind in kinds]
            warnings.append(f"rank {index} ({fmt(cpus)}) mixes {', '.join(names[:-1])} and {names[-1]}: "
                            "its threads wait for the slowest at every barrier")
    return tuple(warnings)
