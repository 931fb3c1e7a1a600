"""The placement plan: a pure function of (spec, topology, model footprint) -> where everything runs.

`app plan` prints exactly this; the bootstrap (step 4) spawns ranks from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from app.bootstrap.isa import check_isa, resolve_dtype
from app.model.footprint import ModelFootprint
from app.placement.cores import layout_cores
from app.placement.memory import RankMemory, size_memory
from app.parallel.heads import split_heads
from app.placement.openmp import openmp_env
from app.spec.errors import Problem, SpecError
from app.spec.schema import Spec
from app.topology.machine import Topology


@dataclass(frozen=True)
class RankPlan:
    replica: int
    rank: int  # TP rank within the replica
    cpus: tuple[int, ...]  # one OpenMP thread per CPU, in this order
    node: int  # the NUMA node its memory is bound to (the first, when interleaved)
    memory_policy: str  # "bind" or "interleave"
    memory_nodes: tuple[int, ...]
    openmp_env: dict[str, str]
    weight_bytes: int
    kv_bytes: int
    kv_blocks: int
    heads: int = 0  # attention heads this rank computes (its share of the model's, by whole KV-head groups)
    kv_heads: int = 0


@dataclass(frozen=True)
class Plan:
    ranks: tuple[RankPlan, ...]
    frontend_cpus: tuple[int, ...]
    frontend_shared: bool
    openmp_runtime: str
    dtype: str
    kv_dtype: str
    block_size: int
    max_model_len: int
    warnings: tuple[str, ...]

    def to_dict(self) -> dict:
        return asdict(self)


# kv_cache.dtype "auto": a bfloat16 model keeps a bfloat16 cache; a float32 model takes float16, llama.cpp's default
# cache: the float32 cache's greedy texts in 20 of 20 prompts (docs/PERFORMANCE.md), half its memory, and decode
# attention in 0.56-0.68x its time (AMD Zen 3); "float32" asks for the exact cache.
AUTO_KV_DTYPE = {"bfloat16": "bfloat16", "float32": "float16"}


def make_plan(spec: Spec, topo: Topology, model: ModelFootprint, openmp_runtime: str = "gnu") -> Plan:
    """Place every rank of every replica; raise SpecError naming the spec key when it cannot.

    `openmp_runtime` is the runtime that "auto" resolved to (the bootstrap knows what is installed).
    """
    check_isa(topo)
    dtype, warnings = resolve_dtype(spec.model.dtype, topo)
    kv_dtype = AUTO_KV_DTYPE[dtype] if spec.kv_cache.dtype == "auto" else spec.kv_cache.dtype
    runtime = openmp_runtime if spec.runtime.openmp == "auto" else spec.runtime.openmp
    max_model_len = _max_model_len(spec, model)
    _check_budget(spec, max_model_len)
    tp, dp = spec.parallel.tp, spec.parallel.dp
    if tp > model.num_heads:
        raise SpecError([Problem("parallel.tp", f"at most the model's {model.num_heads} attention heads, "
                                                "so that every rank has one", tp)])
    layout = layout_cores(spec.cores, tp, dp, topo)
    if spec.model.quantized == "dequantize":
        model = model.dequantized()
    memory, memory_warnings = size_memory(spec.kv_cache, layout.ranks, topo, model, dtype, kv_dtype, tp, max_model_len)
    heads = split_heads(model.num_heads, model.num_kv_heads, tp)
    ranks = tuple(
        _rank(index // tp, index % tp, cpus, mem, runtime, heads[index % tp])
        for index, (cpus, mem) in enumerate(zip(layout.ranks, memory, strict=True))
    )
    warnings += _head_split(model, tp) + _uneven_threads(layout.ranks, tp)
    return Plan(ranks, layout.frontend, layout.frontend_shared, runtime, dtype, kv_dtype, spec.kv_cache.block_size,
                max_model_len, tuple(warnings) + layout.warnings + tuple(memory_warnings))


def _uneven_threads(ranks: tuple[tuple[int, ...], ...], tp: int) -> list[str]:
    warnings = []
    for replica in range(len(ranks) // tp):
        threads = [len(cpus) for cpus in ranks[replica * tp:(replica + 1) * tp]]
        if len(set(threads)) > 1:
            warnings.append(f"the TP ranks of replica {replica} have unequal threads {threads}: each step waits "
                            f"for the smallest, so {sum(threads) - min(threads) * tp} thread(s) mostly idle")
    return warnings


def _head_split(model: ModelFootprint, tp: int) -> list[str]:
    if model.num_heads % tp == 0 and (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0):
        return []
    return [f"parallel.tp={tp} does not divide the model's {model.num_heads} attention heads "
            f"({model.num_kv_heads} KV heads) evenly: ranks get unequal shares of the work"]


def _rank(replica: int, rank: int, cpus: tuple[int, ...], mem: RankMemory, runtime: str, heads) -> RankPlan:
    return RankPlan(replica, rank, cpus, mem.nodes[0], mem.policy, mem.nodes, openmp_env(runtime, cpus),
                    mem.weight_bytes, mem.kv_bytes, mem.kv_blocks, len(heads.q_heads), len(heads.kv_heads))


def _check_budget(spec: Spec, max_model_len: int) -> None:
    """Without chunked prefill a sequence is (re)computed in one step, so one step must hold the longest."""
    budget = spec.scheduler.max_num_batched_tokens
    if not spec.scheduler.chunked_prefill and budget < max_model_len:
        raise SpecError([Problem("scheduler.max_num_batched_tokens",
                                 f"at least max_model_len ({max_model_len}) while scheduler.chunked_prefill is off "
                                 "(or turn chunked prefill on, or lower model.max_model_len)", budget)])


def _max_model_len(spec: Spec, model: ModelFootprint) -> int:
    wanted = spec.model.max_model_len
    if wanted is None:
        return model.context_length
    if wanted > model.context_length:
        raise SpecError([Problem("model.max_model_len",
                                 f"at most the model's context length, {model.context_length} tokens", wanted)])
    return wanted
