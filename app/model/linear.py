"""Linear layers that own their tensor-parallel sharding: how their weight is cut, and what runs after.

A column-parallel layer keeps a slice of the output features (rows of W) and needs no
communication; a row-parallel layer keeps a slice of the input features (columns of W), so each
rank computes a partial sum and the group all-reduces it. Fused Q/K/V and gate/up projections are
column-parallel layers over concatenated row slices. With a group of one they are plain linears.

Sharding works on the file's quantized blocks (QuantizedTensor); each layer packs its weight for the
kernels when it is built, with the `activations` mode of app/model/quant.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from app import kernels
from app.model.batch import RowRun
from app.model.quant import PackedWeight, QuantizedTensor, Weight, fuse_rows, linear, pack, storage

log = logging.getLogger(__name__)


class ColumnParallelLinear:
    """y = x W^T + b for this rank's output features."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None, activations: str = "int16"):
        self.weight, self.bias = pack(weight, activations), bias

    @staticmethod
    def shard(full: Weight, rows: range) -> Weight:
        """This rank's part of a full weight [out, in] (or bias [out]): its output rows."""
        if isinstance(full, QuantizedTensor):
            return full.rows(rows)
        return full[rows.start:rows.stop].clone()  # a copy, so the full tensor can be freed

    def __call__(self, x: torch.Tensor, runs: Sequence[RowRun] = ()) -> torch.Tensor:
        return linear(x, self.weight, self.bias, runs)

    def tensors(self) -> list[torch.Tensor]:
        return storage(self.weight) + ([self.bias] if self.bias is not None else [])


class RowParallelLinear:
    """y = sum over ranks of x_r W_r^T: each rank holds the input features its x_r covers."""

    def __init__(self, weight: Weight, group, activations: str = "int16"):
        self.weight, self.group = pack(weight, activations), group

    @staticmethod
    def shard(full: Weight, columns: range) -> Weight:
        """This rank's part of a full weight [out, in]: its input columns."""
        if isinstance(full, QuantizedTensor):
            part = full.columns(columns)
            if part is not None:
                return part
            log.info("input features %d..%d do not fall on blocks of 32 (%s): that shard is dequantized",
                     columns.start, columns.stop, full.type_name)
            full = full.dequantize()
        return full[:, columns.start:columns.stop].contiguous().clone()

    def __call__(self, x: torch.Tensor, runs: Sequence[RowRun] = ()) -> torch.Tensor:
        if self.group.size == 1:
            return linear(x, self.weight, runs=runs)
        # bfloat16: partial sums stay float32 through the all-reduce: one rounding to bfloat16, as at tp=1
        if isinstance(self.weight, PackedWeight):
            return self.group.all_reduce(linear(x, self.weight, runs=runs, out_dtype=torch.float32)).to(x.dtype)
        if self.weight.dtype == torch.bfloat16:
            return self.group.all_reduce(kernels.linear_f32_out(x, self.weight)).to(torch.bfloat16)
        return self.group.all_reduce(linear(x, self.weight))

    def tensors(self) -> list[torch.Tensor]:
        return storage(self.weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V of this rank's heads in one GEMM; `split` gives the three back."""

    def __init__(self, q: Weight, k: Weight, v: Weight, biases: tuple | None = None, activations: str = "int16"):
        super().__init__(fuse_rows([q, k, v]), torch.cat(biases) if biases is not None else None, activations)
        self.sizes = [q.shape[0], k.shape[0], v.shape[0]]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split(self.sizes, dim=-1)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Gate and up projections of this rank's MLP features in one GEMM: [gate | up]."""

    def __init__(self, gate: Weight, up: Weight, activations: str = "int16"):
        super().__init__(fuse_rows([gate, up]), activations=activations)
