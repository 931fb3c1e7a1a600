"""The one start sequence: spec -> topology -> model source -> footprint -> plan.

`validate`, `plan`, `serve` and the offline `LLM` all begin here, so they agree on what a spec
means on this machine. Every SpecError on the way is located in the YAML (file, line, key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.engine.launch import ModelLaunch, Placement, RankLaunch
from app.model.footprint import ModelFootprint
from app.model.source import ModelSource
from app.placement.plan import Plan
from app.spec.load import SpecDocument
from app.spec.schema import Spec
from app.topology.machine import Topology

# Given the spec and the machine, the OpenMP runtime "auto" resolves to (what is installed here).
OpenMPProbe = Callable[[Spec, Topology], str]


@dataclass(frozen=True)
class Deployment:
    doc: SpecDocument
    topology: Topology
    source: ModelSource
    footprint: ModelFootprint
    plan: Plan

    @property
    def spec(self) -> Spec:
        return self.doc.spec

    def chat_template(self) -> str | None:
        """The spec's chat template override (a file's contents, or the template itself); None: the model's."""
        override = self.spec.model.chat_template
        if override and Path(override).is_file():
            return Path(override).read_text()
        return override

    def pooling(self) -> str:
        """How embeddings pool the final hidden states: the spec's model.pooling, or where "auto" the model's."""
        chosen = self.spec.model.pooling
        return self.footprint.pooling if chosen == "auto" else chosen

    def launches(self, sockets: Path | None = None) -> list[RankLaunch]:
        """One launch record per rank of every replica, in plan order; `sockets` is where rank 0s bind."""
        from app.cache import cache_root
        from app.engine.kv_cache import KVCacheConfig
        from app.engine.scheduler import SchedulerConfig

        spec, plan = self.spec, self.plan
        sched = spec.scheduler
        model = ModelLaunch(str(self.source.path), self.source.format, self.source.served_name, plan.dtype,
                            spec.model.quantized, spec.model.quantized_activations)
        scheduler = SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, plan.max_model_len,
                                    sched.chunked_prefill, sched.step_time_budget, sched.speculative.config())
        tp = spec.parallel.tp
        cache = cache_root()
        records = []
        for rank in plan.ranks:
            # a replica's ranks share one block table: its smallest rank's cache sets the count
            blocks = min(r.kv_blocks for r in plan.ranks if r.replica == rank.replica)
            kv = KVCacheConfig(blocks, plan.block_size, plan.kv_dtype, sched.prefix_caching)
            placement = Placement(rank.cpus, rank.memory_nodes, rank.memory_policy == "interleave", rank.openmp_env)
            address = f"ipc://{sockets}/engine-{rank.replica}.ipc" if sockets is not None and rank.rank == 0 else ""
            records.append(RankLaunch(rank.replica, rank.rank, tp, placement, model, kv, scheduler, address,
                                      sched.max_waiting_requests, spec.runtime.log_level, spec.runtime.log_format,
                                      str(cache or "")))
        return records


def prepare(config: str | Path | None, overrides: list[str], *, root: str | Path = "/",
            openmp: OpenMPProbe | None = None) -> Deployment:
    """Read the spec and the machine and plan. `openmp` resolves runtime "auto" (default: look at what is
    installed, without re-executing); `serve` passes its preflight, which may re-execute the process first."""
    from app.model.footprint import read_footprint
    from app.model.source import resolve_source, source_key
    from app.placement.plan import make_plan
    from app.spec.errors import SpecError
    from app.spec.load import read_spec
    from app.topology.machine import read_topology

    doc = read_spec(config, overrides)
    try:
        topo = read_topology(root)
        runtime = (openmp or installed_openmp)(doc.spec, topo)
        source = resolve_source(doc.spec.model)
        footprint = read_footprint(source, source_key(doc.spec.model))
        plan = make_plan(doc.spec, topo, footprint, runtime)
    except SpecError as error:
        raise doc.locate(error) from None
    return Deployment(doc, topo, source, footprint, plan)


def installed_openmp(spec: Spec, topo: Topology) -> str:
    """The OpenMP runtime "auto" means here: what is installed on this machine (even for a captured tree)."""
    from app.bootstrap.preflight import check, default_search_dirs

    return check(spec.runtime, topo.arch, {}, default_search_dirs(), "").openmp_runtime
