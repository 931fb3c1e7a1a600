"""The layers every Llama-family model is made of, on the native kernels (GEMMs stay with torch).

Each layer holds this rank's shard: its attention heads and MLP features (see app/parallel/shard.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app import kernels
from app.model.batch import ForwardBatch, RowRun
from app.model.config import ModelConfig
from app.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

KVCache = tuple[torch.Tensor, torch.Tensor]  # key [blocks, kv_heads, head_dim, block_size], value [.., block_size, head_dim]
# (bfloat16 ones pair neighbours within a block: kernels.kv_cache_from_blocks says how)


class Attention:
    """Fused QKV projection, optional per-head Q/K norm, RoPE, paged cache write and attention."""

    def __init__(self, cfg: ModelConfig, heads: int, kv_heads: int, qkv: QKVParallelLinear, o: RowParallelLinear,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, cfg.head_dim  # this rank's heads
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.qkv, self.o, self.q_norm, self.k_norm = qkv, o, q_norm, k_norm

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, cos_sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H] (summed over the TP group by the output projection)
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv.split(self.qkv(x, batch.row_runs))  # [T, Hq D], [T, Hk D], [T, Hk D]
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's features, before RoPE
            q = kernels.rms_norm(q.reshape(t * self.heads, d), self.q_norm, self.eps).view(t, -1)
            k = kernels.rms_norm(k.reshape(t * self.kv_heads, d), self.k_norm, self.eps).view(t, -1)
        kernels.rotary_embedding(batch.positions, q, k, cos_sin, d)
        kernels.write_kv_cache(k.view(t, self.kv_heads, d), v.view(t, self.kv_heads, d), *cache, batch.slot_mapping)
        out = kernels.paged_attention(q.view(t, self.heads, d), *cache, batch.block_tables, batch.context_lens,
                                      batch.q_starts, self.scale)
        return self.o(out.view(t, self.heads * d), batch.row_runs)


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, gate_up: MergedColumnParallelLinear, down: RowParallelLinear):
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, runs: Sequence[RowRun] = ()) -> torch.Tensor:
        # x: [T, H] -> [T, H] (summed over the TP group by the down projection); runs: x's rows by role
        return self.down(kernels.silu_and_mul(self.gate_up(x, runs)), runs)


class DecoderLayer:
    def __init__(self, attention: Attention, mlp: MLP, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float):
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_norm, self.eps = input_norm, post_norm, eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H]. The residual stream is carried separately so each norm fuses its add.
        if residual is None:
            residual = x
            x = kernels.rms_norm(x, self.input_norm, self.eps)
        else:
            kernels.add_rms_norm(x, residual, self.input_norm, self.eps)
        x = self.attention(x, batch, cache, cos_sin)
        kernels.add_rms_norm(x, residual, self.post_norm, self.eps)
        return self.mlp(x, batch.row_runs), residual
