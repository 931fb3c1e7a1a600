"""Linear layers that own their tensor-parallel sharding: how their weight is cut, and what runs after.

A column-parallel layer keeps a slice of the output features (rows of W) and needs no
communication; a row-parallel layer keeps a slice of the input features (columns of W), so each
rank computes a partial sum and the group all-reduces it. Fused Q/K/V and gate/up projections are
column-parallel layers over concatenated row slices. With a group of one they are plain linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app import kernels


class ColumnParallelLinear:
    """y = x W^T + b for this rank's output features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    @staticmethod
    def shard(full: torch.Tensor, rows: range) -> torch.Tensor:
        """This rank's part of a full weight [out, in] (or bias [out]): its output rows."""
        return full[rows.start:rows.stop].clone()  # a copy, so the full tensor can be freed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])


class RowParallelLinear:
    """y = sum over ranks of x_r W_r^T: each rank holds the input features its x_r covers."""

    def __init__(self, weight: torch.Tensor, group):
        self.weight, self.group = weight, group

    @staticmethod
    def shard(full: torch.Tensor, columns: range) -> torch.Tensor:
        """This rank's part of a full weight [out, in]: its input columns."""
        return full[:, columns.start:columns.stop].contiguous().clone()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.linear(x, self.weight)
        if self.weight.dtype == torch.bfloat16:
            # partial sums stay float32 through the all-reduce: one rounding to bfloat16, as at tp=1
            return self.group.all_reduce(kernels.linear_f32_out(x, self.weight)).to(torch.bfloat16)
        return self.group.all_reduce(F.linear(x, self.weight))

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V of this rank's heads in one GEMM; `split` gives the three back."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, biases: tuple | None = None):
        super().__init__(torch.cat([q, k, v]), torch.cat(biases) if biases is not None else None)
        self.sizes = [q.shape[0], k.shape[0], v.shape[0]]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split(self.sizes, dim=-1)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Gate and up projections of this rank's MLP features in one GEMM: [gate | up]."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor):
        super().__init__(torch.cat([gate, up]))
