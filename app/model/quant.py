"""GGUF weights kept in their quantized blocks, and the ops that run on them without expanding them.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (32 weights a block, along each row) stay quantized: a decode step then reads
4.5-8.5 bits a weight (5 for Q4_1) instead of 16 or 32. Q2_K, Q3_K, Q4_K, Q5_K and Q6_K stay as the file
stores them, superblocks of 256 weights, and run packed with their superblock scales (3.1, 3.6, 4.6, 5.6 and
6.6 bits a weight; the file's are 2.6, 3.4, 4.5, 5.5 and 6.6: Q2_K's quants run as 2-bit crumbs, Q3_K's as
crumbs and a plane of their third bits, Q5_K's and Q6_K's as nibbles and one or two planes of their high bits;
the rest is the scale codes, a byte each).
IQ4_NL and IQ4_XS (4-bit indices into a codebook of 16 values) stay as stored too (4.5 and 4.4 bits a weight,
the file's 4.5 and 4.25); the tile looks the values up. The superblock types convert
(`kernels.convert_quant`) into blocks of 32 that keep every weight's value where a tensor-parallel cut
does not fall on 256 (Q4_K as Q4_M32, 4-bit quants with float32 scale and min per 32, 6 bits; Q5_K as
Q8_M32; Q3_K and Q6_K as Q8_H32, bytes with a float32 scale per 16, 10 bits; IQ4_XS as IQ4_F32, 5 bits;
Q2_K as Q4_HM32, nibbles with a float32 scale and min per 16, 8 bits). At load they are `QuantizedTensor`s, which TP sharding
cuts and fused projections stack (a fused projection whose parts differ in type runs as its parts,
`QuantizedParts` and `PackedParts`, each in its own blocks); the model then packs each into a
`PackedWeight`, the layout the native kernels run on (rows interleaved 16 at a time for int8 dot
products, see native/include/kernels.h). How activations meet them (`ACTIVATIONS`):
  - "int16": each block of 32 activations quantized to about 16 bits (two int8 planes) and multiplied
    with int8 dot products (AVX512-VNNI); agrees with float32 to about 1e-5 of a logit's range. Prompt rows
    (`prompt=True`) take float32 FMAs on weights widened to float32 where that is faster
    (`kernels.widens_prompts(qtype)`: AVX2, native/src/widened.cpp), the reference's products;
  - "int8": one plane, as llama.cpp does: fastest, and answers can differ from float32 ones;
  - "float": float32 FMAs on the exactly widened weights (a prompt's many rows expand the weight for
    torch's GEMM): the reference's arithmetic, slowest.
IQ1_S to IQ3_S are dequantized at load (the loader says so).

Dense bfloat16 weights (a bfloat16 model's, from a BF16 GGUF or safetensors) are packed the same way
(type `BF16`, no scales): the same kernels then run them, vdpbf16ps on AVX512-BF16 where the CPU issues it
fast (else float32 FMAs: kernels.bf16_dot), and the whole layer
stack in one native call; torch's bfloat16 GEMV reached about a third of the memory bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app import kernels
from app.model.batch import RowRun
from app.model.gguf_header import KEPT_QUANT_TYPES as KEPT_TYPES  # GGML type id: (name, packed type id)
from app.model.gguf_header import PACKED_QUANT_TYPES as PACKED_TYPES  # packed type id: QuantType

BLOCK = 32
GEMM_ROWS = 64  # "float": more activation rows than this expand the weight for torch's GEMM (compute-bound)
ACTIVATIONS = {"float": 0, "int8": 1, "int16": 2}  # the native kernels' codes
BF16 = 30  # GGML's type id for bfloat16: dense weights in the packed layout (activations do not apply)


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, in_features] weight as blocks of a packed type (`qtype`, a key of PACKED_TYPES: 32 weights a
    block, or a K-quant superblock's 256): `data` is uint8 [rows, in_features / block weights * block bytes]."""

    data: torch.Tensor
    qtype: int
    in_features: int

    def __post_init__(self):
        name, per, size, _ = PACKED_TYPES[self.qtype]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.in_features % per \
                or self.data.shape[1] != self.in_features // per * size:
            raise ValueError(f"{name} data of shape {tuple(self.data.shape)} does not hold rows of "
                             f"{self.in_features} weights")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def type_name(self) -> str:
        return PACKED_TYPES[self.qtype].name

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, rows: range | torch.Tensor) -> QuantizedTensor:
        """A copy of some rows (a range, or a LongTensor of indices)."""
        picked = self.data[rows.start:rows.stop] if isinstance(rows, range) else self.data[rows]
        return QuantizedTensor(picked.clone(), self.qtype, self.in_features)

    def columns(self, columns: range) -> QuantizedTensor | None:
        """A copy of the input features `columns`, or None when they do not fall on blocks of 32 (a superblock
        type's weight cut within its superblocks of 256 comes back in blocks of 32 that hold the same values)."""
        if columns.start % BLOCK or columns.stop % BLOCK:
            return None
        _, per, size, _ = PACKED_TYPES[self.qtype]
        if columns.start % per or columns.stop % per:
            return self.in_blocks_of_32().columns(columns)
        part = self.data[:, columns.start // per * size:columns.stop // per * size]
        return QuantizedTensor(part.contiguous().clone(), self.qtype, len(columns))

    def in_blocks_of_32(self) -> QuantizedTensor:
        """The same values in blocks of 32: a Q4_K weight as Q4_M32, Q5_K as Q8_M32, Q3_K and Q6_K as Q8_H32,
        IQ4_XS as IQ4_F32, Q2_K as Q4_HM32, any other as it is."""
        if PACKED_TYPES[self.qtype].weights == BLOCK:
            return self
        return QuantizedTensor(*kernels.convert_quant(self.data, self.qtype, self.in_features), self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return kernels.dequantize(self.data, self.qtype, self.in_features, dtype)

    def pack(self, activations: str) -> PackedWeight:
        """The weight in the kernels' layout, multiplied with activations quantized as `activations` says."""
        return PackedWeight(kernels.pack_quant(self.data, self.qtype, self.in_features), self.qtype,
                            self.data.shape[0], self.in_features, activations)

    @staticmethod
    def cat(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """Rows of weights of one type and width, stacked (fused Q/K/V, gate/up)."""
        return QuantizedTensor(torch.cat([p.data for p in parts]), parts[0].qtype, parts[0].in_features)


@dataclass(frozen=True)
class PackedWeight:
    """A [rows, in_features] weight packed for the native kernels (uint8 `data`), and how it meets activations."""

    data: torch.Tensor
    qtype: int
    rows: int
    in_features: int
    activations: str  # a key of ACTIVATIONS

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {self.activations!r}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.in_features

    @property
    def type_name(self) -> str:
        return "BF16" if self.qtype == BF16 else PACKED_TYPES[self.qtype].name

    def linear(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
               prompt: bool = False) -> torch.Tensor:
        """x [..., in_features] @ W^T -> [..., rows], accumulated in float32, in out_dtype (default x's); or
        into `out` ([rows of x, rows], at any row stride: some columns of a fused weight's output). `prompt`:
        x's rows are prompt tokens (int16 runs them as float32 FMAs on widened weights where
        `kernels.widens_prompts(qtype)`)."""
        rows = x.numel() // self.in_features
        if self.activations == "float" and self.qtype != BF16 and rows > GEMM_ROWS and (out_dtype is None or out_dtype == x.dtype):
            result = torch.nn.functional.linear(x, self.dequantize(x.dtype))
            return result if out is None else out.copy_(result.view(-1, self.rows))
        return kernels.packed_linear(x, self.data, self.qtype, self.in_features, self.rows,
                                     ACTIVATIONS[self.activations], out_dtype, out, prompt)

    @property
    def parts(self) -> tuple[PackedWeight, ...]:
        return (self,)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` (token ids), dequantized: an embedding lookup."""
        return kernels.packed_rows(self.data, ids, self.qtype, self.in_features, self.rows, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.embedding(torch.arange(self.rows), dtype)


@dataclass(frozen=True)
class QuantizedParts:
    """A fused weight whose stacked parts differ in type (Q4_K_M files store some layers' V as Q6_K, their Q
    and K as Q4_K): each part keeps its own blocks and runs as its own packed weight, into its own columns
    of the output."""

    parts: tuple[QuantizedTensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].in_features

    @property
    def type_name(self) -> str:
        return "+".join(p.type_name for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def pack(self, activations: str) -> PackedParts:
        return PackedParts(tuple(p.pack(activations) for p in self.parts))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


@dataclass(frozen=True)
class PackedParts:
    """QuantizedParts packed: a linear whose parts each fill their own columns of one output."""

    parts: tuple[PackedWeight, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.in_features

    @property
    def type_name(self) -> str:
        return "+".join(p.type_name for p in self.parts)

    @property
    def activations(self) -> str:
        return self.parts[0].activations

    def linear(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, prompt: bool = False) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], self.rows, dtype=out_dtype or x.dtype)
        columns = out.view(-1, self.rows)
        start = 0
        for part in self.parts:
            part.linear(x, out_dtype, out=columns[:, start:start + part.rows], prompt=prompt)
            start += part.rows
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


Weight = torch.Tensor | QuantizedTensor | QuantizedParts | PackedWeight | PackedParts
Packed = (PackedWeight, PackedParts)  # what the native kernels run


def pack(weight: Weight, activations: str) -> Weight:
    """A file's quantized weight, or a bfloat16 one, in the kernels' layout; float32 weights as they are."""
    if isinstance(weight, QuantizedTensor | QuantizedParts):
        return weight.pack(activations)
    if weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % BLOCK == 0:
        rows, features = weight.shape
        packed = kernels.pack_quant(weight.contiguous().view(torch.uint8), BF16, features)
        return PackedWeight(packed, BF16, rows, features, activations)
    return weight


def fuse_rows(parts: Sequence[Weight]) -> Weight:
    """Stack weights by rows; quantized ones stay quantized: one weight when they share one type, else the
    runs of one type as the parts of one (Q4_K_M files store some layers' V projection as Q6_K, their Q
    and K as Q4_K). With a float part among them, every part is expanded to the float parts' dtype."""
    if all(isinstance(p, QuantizedTensor) for p in parts) and len({p.in_features for p in parts}) == 1:
        runs: list[list[QuantizedTensor]] = []
        for part in parts:
            if runs and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        fused = tuple(QuantizedTensor.cat(run) if len(run) > 1 else run[0] for run in runs)
        return fused[0] if len(fused) == 1 else QuantizedParts(fused)
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantizedTensor) else p for p in parts])


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, runs: Sequence[RowRun] = (),
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ W^T (+ bias); packed weights take x's `runs` of prompt rows and decode rows apart where the kernels
    run a part's prompt rows their own way (int16, `kernels.widens_prompts(qtype)`), as the native stack does."""
    if isinstance(weight, Packed):
        if len(runs) > 1 and weight.activations == "int16" and \
                any(kernels.widens_prompts(p.qtype) for p in weight.parts):
            out = torch.cat([weight.linear(x[r.begin:r.end], out_dtype, prompt=r.prompt) for r in runs])
        else:
            out = weight.linear(x, out_dtype, prompt=bool(runs) and runs[0].prompt)
        return out.add_(bias) if bias is not None else out
    return torch.nn.functional.linear(x, weight, bias)


def storage(weight: Weight) -> list[torch.Tensor]:
    """The tensors that hold a weight's bytes."""
    if isinstance(weight, QuantizedParts | PackedParts):
        return [p.data for p in weight.parts]
    return [weight.data if isinstance(weight, QuantizedTensor | PackedWeight) else weight]
