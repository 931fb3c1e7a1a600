"""Memory of each rank: NUMA policy, weights, KV-cache bytes and blocks, and whether it all fits.

A fractional `kv_cache.memory` is a fraction of the rank's memory budget: its NUMA node's memory
divided among the ranks bound to that node, and never more than its share of the cgroup limit.

A rank's memory is bound to the node its CPUs are on. Where the firmware has several nodes list
the same CPUs, which node a CPU is on is unknown: binding to any one of them could be the remote
one, so such a rank's memory is interleaved over every node that lists its CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.model.footprint import ModelFootprint
from app.spec.errors import Described, Problem, SpecError
from app.spec.schema import KvCacheSpec
from app.topology.machine import Topology
from app.units import format_size as size

RUNTIME_RESERVE = 512 * 1024**2
"""Per rank, besides weights and KV: the Python runtime, torch, activations and thread stacks."""


@dataclass(frozen=True)
class RankMemory:
    nodes: tuple[int, ...]  # NUMA nodes the rank's CPUs are on
    policy: str  # "bind" (one node) or "interleave" (several)
    weight_bytes: int
    kv_bytes: int
    kv_blocks: int


def size_memory(kv: KvCacheSpec, ranks: tuple[tuple[int, ...], ...], topo: Topology, model: ModelFootprint,
                dtype: str, kv_dtype: str, tp: int, max_model_len: int) -> tuple[list[RankMemory], list[str]]:
    _check_memory_known(topo)
    nodes, warnings = _memory_nodes(ranks, topo)
    sharing = {n: sum(n in rank_nodes for rank_nodes in nodes) for n in topo.nodes}
    block_bytes = model.kv_bytes_per_token(kv_dtype, tp) * kv.block_size
    wanted = [int(kv.memory * _budget(rank_nodes, sharing, topo, len(ranks))) if isinstance(kv.memory, float)
              else kv.memory for rank_nodes in nodes]
    plans = []
    for index, rank_nodes in enumerate(nodes):
        # The TP ranks of a replica share one block table: each gets the block count of the smallest.
        replica = range(index - index % tp, index - index % tp + tp)
        blocks = min(wanted[i] for i in replica) // block_bytes
        policy = "bind" if len(rank_nodes) == 1 else "interleave"
        weights = model.weight_bytes(dtype, tp, index % tp)
        plans.append(RankMemory(rank_nodes, policy, weights, blocks * block_bytes, blocks))
    _check_holds_a_sequence(min(plans, key=lambda p: p.kv_blocks), kv, max_model_len, block_bytes)
    warnings += _check_fit(plans, topo)
    return plans, warnings


def _check_memory_known(topo: Topology) -> None:
    """Without any memory size there is nothing to size the KV cache from: name the files that lack one."""
    if any(node.mem_total > 0 for node in topo.nodes.values()):
        return
    files = ", ".join(str(Path(topo.root) / rel) for rel in topo.memory_files) or f"the meminfo files below {topo.root}"
    raise SpecError([Problem("(machine)", "a MemTotal line in one of them: the memory of a NUMA node or of the machine",
                             Described(f"no MemTotal in {files}"))])


def _memory_nodes(ranks: tuple[tuple[int, ...], ...], topo: Topology) -> tuple[list[tuple[int, ...]], list[str]]:
    """Each rank's memory nodes: those of its CPUs, within the nodes the cgroup lets us allocate on."""
    allowed = topo.allowed_mems
    result, warnings = [], []
    for index, cpus in enumerate(ranks):
        own = tuple(sorted({node for cpu in cpus for node in topo.nodes_of(cpu)}))
        usable = tuple(n for n in own if n in allowed) or allowed
        if usable != own:
            warnings.append(_elsewhere(index, own, usable, topo))
        result.append(usable)
    return result, warnings + _ambiguous_nodes(ranks, topo)


def _elsewhere(index: int, own: tuple[int, ...], usable: tuple[int, ...], topo: Topology) -> str:
    missing = [n for n in own if n not in usable]
    if all(topo.nodes[n].mem_total == 0 for n in missing):
        return (f"rank {index}'s CPUs are on NUMA node(s) {missing}, which have no memory: "
                f"its memory goes to {list(usable)}")
    return (f"rank {index}'s CPUs are on NUMA node(s) {list(own)} but the cgroup allows memory only on "
            f"{list(topo.allowed_mems)} (cpuset.mems): its memory goes to {list(usable)}")


def _ambiguous_nodes(ranks: tuple[tuple[int, ...], ...], topo: Topology) -> list[str]:
    """One warning for the ranks on CPUs that several nodes list (a broken firmware table)."""
    shared = [i for i, cpus in enumerate(ranks) if any(len(topo.nodes_of(cpu)) > 1 for cpu in cpus)]
    if not shared:
        return []
    owners = sorted({n for i in shared for cpu in ranks[i] if len(topo.nodes_of(cpu)) > 1 for n in topo.nodes_of(cpu)})
    return [f"NUMA nodes {owners} list the same CPUs (a firmware table error?): which node a CPU is on is unknown, "
            f"so rank(s) {', '.join(map(str, shared))} interleave their memory over the nodes that list their CPUs"]


def _budget(rank_nodes: tuple[int, ...], sharing: dict[int, int], topo: Topology, world: int) -> float:
    memory = sum(topo.nodes[n].mem_total for n in rank_nodes)
    budget = memory / max(sharing[n] for n in rank_nodes)
    if topo.memory_limit is not None:
        budget = min(budget, topo.memory_limit / world)
    return budget


def _check_holds_a_sequence(rank: RankMemory, kv: KvCacheSpec, max_model_len: int, block_bytes: int) -> None:
    """The smallest rank's cache must hold one sequence of max_model_len tokens."""
    needed = -(-max_model_len // kv.block_size)
    if rank.kv_blocks >= needed:
        return
    raise SpecError([Problem(
        "kv_cache.memory",
        f"at least {size(needed * block_bytes)} per rank, to hold one sequence of "
        f"{max_model_len} tokens (or lower model.max_model_len)",
        Described(f"{size(rank.kv_bytes)} per rank = {rank.kv_blocks} blocks of {kv.block_size} tokens"))])


def _demand(rank: RankMemory) -> int:
    return rank.weight_bytes + rank.kv_bytes + RUNTIME_RESERVE


def _check_fit(plans: list[RankMemory], topo: Topology) -> list[str]:
    per_node: dict[int, float] = {}
    for rank in plans:
        for node in rank.nodes:
            per_node[node] = per_node.get(node, 0) + _demand(rank) / len(rank.nodes)
    problems, warnings = [], []
    for node, demand in sorted(per_node.items()):
        total, available = topo.nodes[node].mem_total, topo.nodes[node].mem_available
        if demand > total:
            problems.append(_too_much(plans, f"NUMA node {node}'s {size(total)}", demand, node))
        elif demand > available:
            warnings.append(f"NUMA node {node}: the plan needs {size(demand)} but {size(available)} is free "
                            "now (memory over-committed)")
    limit = topo.memory_limit
    whole = sum(_demand(rank) for rank in plans)
    if limit is not None and whole > limit:
        problems.append(_too_much(plans, f"the cgroup memory limit of {size(limit)}", whole, None))
    if problems:
        raise SpecError(problems)
    return warnings + _idle_memory_nodes(topo)


def _too_much(plans: list[RankMemory], where: str, demand: float, node: int | None) -> Problem:
    ranks = [r for r in plans if node is None or node in r.nodes]
    rank = ranks[0]
    fixed = rank.weight_bytes + RUNTIME_RESERVE
    return Problem(
        "kv_cache.memory",
        f"weights, KV and runtime of all {len(ranks)} rank(s) within {where} "
        f"(lower kv_cache.memory, or {'use more NUMA nodes' if node is not None else 'raise the memory limit'})",
        Described(f"{size(rank.kv_bytes)} of KV per rank; with weights {size(rank.weight_bytes)} and runtime "
                  f"reserve {size(RUNTIME_RESERVE)} per rank ({size(fixed)} fixed), {len(ranks)} rank(s) "
                  f"need {size(demand)}"))


def _idle_memory_nodes(topo: Topology) -> list[str]:
    return [f"NUMA node {n.id} has {size(n.mem_total)} of memory but no CPUs (memory-only); no rank binds to it"
            for n in topo.nodes.values() if not n.cpus and n.mem_total > 0]
