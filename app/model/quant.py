"""GGUF weights kept in their quantized blocks, and the ops that run on them without expanding them.

Q4_0, Q4_1 and Q8_0 (32 weights a block, along each row) stay as the file stores them: a decode
step then reads 5 (Q4_1) or 8.5 (Q8_0) bits a weight instead of 32. The native kernels dequantize a
few rows at a time into cache and accumulate in float32, so results equal dequantize-then-matmul up
to the order of the sums. Other GGUF types are dequantized at load (the loader says which).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app import kernels
from app.model.gguf_header import KEPT_QUANT_TYPES as KEPT_TYPES  # GGML type id: (name, bytes a block)

BLOCK = 32
GEMM_ROWS = 64  # more activation rows than this: expand the weight and use torch's GEMM (measured, see linear)


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, in_features] weight as GGUF blocks: `data` is uint8 [rows, in_features / 32 * block bytes]."""

    data: torch.Tensor
    qtype: int
    in_features: int

    def __post_init__(self):
        name, size = KEPT_TYPES[self.qtype]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.in_features % BLOCK \
                or self.data.shape[1] != self.in_features // BLOCK * size:
            raise ValueError(f"{name} data of shape {tuple(self.data.shape)} does not hold rows of "
                             f"{self.in_features} weights")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def type_name(self) -> str:
        return KEPT_TYPES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, rows: range | torch.Tensor) -> QuantizedTensor:
        """A copy of some rows (a range, or a LongTensor of indices)."""
        picked = self.data[rows.start:rows.stop] if isinstance(rows, range) else self.data[rows]
        return QuantizedTensor(picked.clone(), self.qtype, self.in_features)

    def columns(self, columns: range) -> QuantizedTensor | None:
        """A copy of the input features `columns`, or None when they do not fall on block boundaries."""
        if columns.start % BLOCK or columns.stop % BLOCK:
            return None
        size = KEPT_TYPES[self.qtype][1]
        part = self.data[:, columns.start // BLOCK * size:columns.stop // BLOCK * size]
        return QuantizedTensor(part.contiguous().clone(), self.qtype, len(columns))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return kernels.dequantize(self.data, self.qtype, self.in_features, dtype)

    def linear(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., in_features] @ W^T -> [..., rows], accumulated in float32, in out_dtype (default x's).

        Up to GEMM_ROWS rows of x (decode) run on the native kernel, which reads the blocks once; a
        prompt's many rows are compute-bound instead, so the weight is expanded to x's dtype for the
        call and torch's GEMM (oneDNN: AMX / AVX512-BF16 where the CPU has them) runs it."""
        rows = x.numel() // self.in_features if self.in_features else 0
        if rows <= GEMM_ROWS or (out_dtype is not None and out_dtype != x.dtype):
            return kernels.quant_linear(x, self.data, self.qtype, self.in_features, out_dtype)
        return torch.nn.functional.linear(x, self.dequantize(x.dtype))

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` (token ids), dequantized: an embedding lookup."""
        return kernels.dequantize(self.data[ids], self.qtype, self.in_features, dtype)

    @staticmethod
    def cat(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """Rows of weights of one type and width, stacked (fused Q/K/V, gate/up)."""
        return QuantizedTensor(torch.cat([p.data for p in parts]), parts[0].qtype, parts[0].in_features)


Weight = torch.Tensor | QuantizedTensor


def fuse_rows(parts: Sequence[Weight]) -> Weight:
    """Stack weights by rows; quantized ones stay quantized when they all share one type, else every
    part is expanded to the compute dtype of the float parts (float32 if there are none)."""
    if all(isinstance(p, QuantizedTensor) for p in parts) and len({(p.qtype, p.in_features) for p in parts}) == 1:
        return QuantizedTensor.cat(parts)
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantizedTensor) else p for p in parts])


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, QuantizedTensor):
        out = weight.linear(x)
        return out.add_(bias) if bias is not None else out
    return torch.nn.functional.linear(x, weight, bias)


def storage(weight: Weight) -> torch.Tensor:
    """The tensor that holds a weight's bytes."""
    return weight.data if isinstance(weight, QuantizedTensor) else weight
