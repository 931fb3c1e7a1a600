"""The plan as a table for people and as JSON for tools."""

from __future__ import annotations

import json

from app.model.footprint import ModelFootprint
from app.model.source import ModelSource
from app.placement.plan import Plan
from app.topology.cpulist import format_cpulist as fmt
from app.topology.machine import Topology
from app.units import format_size as size


def plan_json(plan: Plan, source: ModelSource, model: ModelFootprint, topo: Topology) -> str:
    data = {
        "model": {"name": source.served_name, "path": str(source.path), "format": source.format,
                  "architecture": model.architecture, "num_params": model.num_params},
        "machine": {"root": topo.root, "arch": topo.arch, "cpu_model": topo.cpu_model,
                    "allowed_cpus": fmt(topo.allowed), "numa_nodes": sorted(topo.nodes),
                    "memory_limit": topo.memory_limit},
        **plan.to_dict(),
    }
    for rank in data["ranks"]:
        rank["cpulist"] = fmt(rank["cpus"])
    data["frontend_cpulist"] = fmt(plan.frontend_cpus)
    return json.dumps(data, indent=2)


def plan_table(plan: Plan, source: ModelSource, model: ModelFootprint, topo: Topology, warnings: bool = True) -> str:
    """The plan as `plan` prints it; `warnings=False` leaves the warnings out (`serve` logs them as warnings)."""
    replicas = len({r.replica for r in plan.ranks})
    lines = [
        f"model    {source.served_name} ({model.architecture}, {model.num_params / 1e6:.1f}M parameters, "
        f"{source.format}) at {source.path}",
        f"machine  {topo.arch}, {topo.cpu_model}; allowed CPUs {fmt(topo.allowed)}; NUMA nodes "
        f"{', '.join(map(str, sorted(topo.nodes)))}" + (f"; cgroup memory {size(topo.memory_limit)}" if topo.memory_limit else ""),
        f"layout   {replicas} replica(s) x {len(plan.ranks) // replicas} TP rank(s); dtype {plan.dtype}, KV "
        f"{plan.kv_dtype}, block {plan.block_size} tokens, max_model_len {plan.max_model_len}; OpenMP {plan.openmp_runtime}",
        "",
    ]
    header = ("replica", "rank", "heads (q/kv)", "cpus", "threads", "memory", "weights", "kv cache", "kv blocks")
    rows = [header] + [
        (str(r.replica), str(r.rank), f"{r.heads}/{r.kv_heads}", fmt(r.cpus), str(len(r.cpus)),
         f"{r.memory_policy} {','.join(map(str, r.memory_nodes))}", size(r.weight_bytes), size(r.kv_bytes),
         str(r.kv_blocks))
        for r in plan.ranks
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    frontend = "shared with the ranks" if plan.frontend_shared else f"CPUs {fmt(plan.frontend_cpus)}"
    lines += ["", f"frontend {frontend} ({fmt(plan.frontend_cpus)})" if plan.frontend_shared else f"frontend {frontend}"]
    lines += ["", "OpenMP environment per rank:"]
    lines += [f"  {r.replica}/{r.rank}  " + " ".join(f"{k}={_quote(v)}" for k, v in r.openmp_env.items())
              for r in plan.ranks]
    if warnings and plan.warnings:
        lines += ["", "warnings:"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)


def _quote(value: str) -> str:
    return f"'{value}'" if any(ch in value for ch in " {}[]") else value
