"""How a Llama-family model is split over a tensor-parallel group (Megatron-style).

Attention is split by KV-head groups: a rank takes whole KV heads with their query heads. Any tp up
to the number of query heads works, not only divisors: KV heads are dealt out as evenly as whole
heads allow (SmolLM2, 9 query / 3 KV heads, at tp=2: 6+3 query and 2+1 KV heads); with more ranks
than KV heads, each KV head is replicated on a run of ranks that split its query heads (vLLM's
rule; 8 / 2 at tp=4: every rank has 2 query heads and 1 KV head). The MLP's intermediate features
are split evenly, in whole blocks of 32 where they can be (gate/up by rows, down by columns;
`split_features`); in a mixture of experts, so are each expert's (every rank runs every expert on its
features; the router is replicated). Q/K/V and gate/up are column-parallel, the output and down
projections row-parallel with one all-reduce each: two per layer. Embeddings and norms are replicated;
the LM head lives on rank 0 only, which samples.

`ShardSpec.take` cuts each checkpoint tensor to this rank's part as it is read, so a rank never
holds the whole model, not even while loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.model.linear import ColumnParallelLinear, RowParallelLinear
from app.parallel.heads import HeadSplit, split_features, split_heads


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    size: int
    heads: HeadSplit
    intermediate: range  # this rank's MLP features
    head_dim: int
    expert_features: range = range(0)  # this rank's features of each expert

    @classmethod
    def of(cls, cfg, rank: int, size: int) -> ShardSpec:
        heads = split_heads(cfg.num_heads, cfg.num_kv_heads, size)[rank]
        return cls(rank, size, heads, split_features(cfg.intermediate_size, size)[rank], cfg.head_dim,
                   split_features(cfg.expert_intermediate_size, size)[rank])

    @classmethod
    def whole(cls, cfg) -> ShardSpec:
        return cls.of(cfg, 0, 1)

    @property
    def num_heads(self) -> int:
        return len(self.heads.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.heads.kv_heads)

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of checkpoint tensor `name` (HF naming), or None when the rank does not keep it."""
        if self.size == 1:
            return tensor
        d = self.head_dim
        q = range(self.heads.q_heads.start * d, self.heads.q_heads.stop * d)
        kv = range(self.heads.kv_heads.start * d, self.heads.kv_heads.stop * d)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return ColumnParallelLinear.shard(tensor, q)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                          "self_attn.k_proj.bias", "self_attn.v_proj.bias")):
            return ColumnParallelLinear.shard(tensor, kv)
        if name.endswith("self_attn.o_proj.weight"):
            return RowParallelLinear.shard(tensor, q)
        if ".mlp.experts." in name:
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                return ColumnParallelLinear.shard(tensor, self.expert_features)
            return RowParallelLinear.shard(tensor, self.expert_features)
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return ColumnParallelLinear.shard(tensor, self.intermediate)
        if name.endswith("mlp.down_proj.weight"):
            return RowParallelLinear.shard(tensor, self.intermediate)
        if name == "lm_head.weight" and self.rank != 0:
            return None
        return tensor  # embeddings, norms, rope factors: every rank
