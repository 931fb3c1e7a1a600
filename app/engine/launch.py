"""What one engine rank is started with: a record per rank, built from the plan (`Deployment.launches`).

Torch-free and picklable: the bootstrap hands it to a `spawn`ed process, the offline `LLM` uses it
in-process. Grouped by concern (placement, model, KV cache, scheduler) rather than flat.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.kv_cache import KVCacheConfig
from app.engine.scheduler import SchedulerConfig


@dataclass(frozen=True)
class ModelLaunch:
    path: str
    format: str  # "gguf" or "hf"
    served_name: str
    dtype: str  # "float32" or "bfloat16"
    quantized: str = "keep"  # GGUF quantized weights: "keep" or "dequantize"
    quantized_activations: str = "int16"  # how activations meet kept-quantized weights: "int16", "int8", "float"

    @property
    def model_id(self) -> str:
        """Names the cached KV (prefix-cache hashes): the same weights in the same dtype on the same kernels."""
        return f"{self.path}:{self.dtype}:{self.quantized}:{self.quantized_activations}"


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]  # one OpenMP thread per CPU, in this order
    memory_nodes: tuple[int, ...]
    interleave: bool
    openmp_env: dict[str, str] = field(default_factory=dict)  # set before the process imports torch


@dataclass(frozen=True)
class RankLaunch:
    replica: int
    rank: int  # within its replica's TP group
    tp: int
    placement: Placement
    model: ModelLaunch
    kv: KVCacheConfig
    scheduler: SchedulerConfig
    address: str = ""  # rank 0: the ipc:// endpoint its EngineServer binds
    max_waiting_requests: int = 0
    log_level: str = "info"
    log_format: str = "text"
    cache_dir: str = ""  # app.cache's folder, where rank 0 keeps its step cost's fit ("": none)

    @property
    def name(self) -> str:
        return f"engine-{self.replica}" if self.tp == 1 else f"engine-{self.replica}.{self.rank}"
