"""A fast read of a GGUF file's header: scalar metadata and tensor shapes, skipping array bodies.

The planner needs only a handful of numbers (layers, heads, parameter count), and the engine's loader
the tensors' shapes, types and offsets. `gguf.GGUFReader` parses every tokenizer string into its own
array (2-4 s for a 49k-token vocabulary, most of a cold start; a minute in the emulated NUMA guest);
this scan steps over them. Dequantizing the types without a kernel is still `gguf`'s.
`read_gguf_metadata` reads the arrays too, for the tokenizer's export (app/model/tokenizer.py).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

_MAGIC = b"GGUF"
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's length


class QuantType(NamedTuple):
    name: str
    weights: int  # a block's, along a row
    bytes: int  # a block's, as QuantizedTensor rows hold it
    packed_bytes: int  # a row's share of the packed layout per block (PackedWeight; with a superblock's head)


# The quantized block types our kernels run (app/model/quant.py, native/include/kernels.h), by id. GGML's
# ids for the types run as the file stores them (Q2_K to Q6_K and IQ4_XS in their superblocks of 256); 100-104
# for the exact blocks of 32 that the superblock types convert into where a tensor-parallel cut is off 256.
PACKED_QUANT_TYPES = {2: QuantType("Q4_0", 32, 18, 18), 3: QuantType("Q4_1", 32, 20, 20),
                      6: QuantType("Q5_0", 32, 22, 22), 7: QuantType("Q5_1", 32, 24, 24),
                      8: QuantType("Q8_0", 32, 34, 34), 10: QuantType("Q2_K", 256, 84, 100),
                      11: QuantType("Q3_K", 256, 110, 116), 12: QuantType("Q4_K", 256, 144, 148),
                      13: QuantType("Q5_K", 256, 176, 180), 14: QuantType("Q6_K", 256, 210, 212),
                      20: QuantType("IQ4_NL", 32, 18, 18), 23: QuantType("IQ4_XS", 256, 136, 140),
                      100: QuantType("Q4_M32", 32, 24, 24), 101: QuantType("Q8_M32", 32, 40, 40),
                      102: QuantType("Q8_H32", 32, 40, 40), 103: QuantType("IQ4_F32", 32, 20, 20),
                      104: QuantType("Q4_HM32", 32, 32, 32)}
# Superblock types, and the blocks of 32 they load as where a tensor-parallel cut does not fall on 256.
IN_BLOCKS_OF_32 = {10: 104, 11: 102, 12: 100, 13: 101, 14: 102, 23: 103}
# The GGUF types kept quantized, by GGML id: (name, the packed type above they run as). Here, torch-free,
# so that placement can size them without importing torch.
KEPT_QUANT_TYPES = {2: ("Q4_0", 2), 3: ("Q4_1", 3), 8: ("Q8_0", 8), 6: ("Q5_0", 6), 7: ("Q5_1", 7),
                    10: ("Q2_K", 10), 11: ("Q3_K", 11), 12: ("Q4_K", 12), 13: ("Q5_K", 13), 14: ("Q6_K", 14),
                    20: ("IQ4_NL", 20), 23: ("IQ4_XS", 23)}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, object]  # scalars and strings; arrays as their length only (but `read_gguf_metadata`)
    tensor_shapes: dict[str, tuple[int, ...]]
    tensor_types: dict[str, int]  # ggml type id per tensor
    tensor_offsets: dict[str, int]  # where each tensor's data starts in the file (bytes, absolute)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _Scanner(buf).header()


def read_gguf_metadata(path: str | Path, string_arrays: Container[str] = ()) -> dict[str, object]:
    """The file's metadata with its arrays as lists: numeric ones always, string ones (a vocabulary, the
    merges) only where their key is in `string_arrays`, the others as their length."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _Scanner(buf, string_arrays).header().metadata


class _Scanner:
    def __init__(self, buf: mmap.mmap, string_arrays: Container[str] | None = None):
        self.buf = buf
        self.pos = 0
        self.string_arrays = string_arrays  # None: every array as its length (the header's fast scan)

    def take(self, fmt: str) -> object:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError("the file ends inside its header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, errors: str = "replace") -> str:
        length = self.take("Q")
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors=errors)

    def value(self, kind: int, key: str = "") -> object:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.skip_array() if self.string_arrays is None else self.array(key in self.string_arrays)
        raise GGUFFormatError(f"unknown metadata value type {kind}")

    def array(self, strings: bool) -> list | int:
        """A numeric array as a list; a string array as a list if `strings`, else as its length."""
        kind, count = self.take("I"), self.take("Q")
        if kind in _SCALARS:
            fmt = f"<{count}{_SCALARS[kind]}"
            try:
                values = list(struct.unpack_from(fmt, self.buf, self.pos))
            except struct.error:
                raise GGUFFormatError("the file ends inside its header") from None
            self.pos += struct.calcsize(fmt)
            return values
        if kind == _STRING and strings:
            try:
                return [self.string(errors="strict") for _ in range(count)]  # a vocabulary: exact, or an error
            except UnicodeDecodeError as exc:
                raise GGUFFormatError(f"a string of a metadata array is not UTF-8: {exc}") from None
        return self.skip_values(kind, count)

    def skip_array(self) -> int:
        return self.skip_values(self.take("I"), self.take("Q"))

    def skip_values(self, kind: int, count: int) -> int:
        if kind in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:  # a vocabulary: step over each string without decoding it, in a loop of locals
            buf, pos, length = self.buf, self.pos, _LENGTH.unpack_from  # (one take() a string was half a load of a
            try:                                                        # small model: 0.3 s for SmolLM2's arrays)
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
            except (struct.error, OverflowError):  # (a corrupt length past any offset: the latter)
                raise GGUFFormatError("the file ends inside its header") from None
            self.pos = pos
        else:
            for _ in range(count):
                self.value(kind)
        return count

    def header(self) -> GGUFHeader:
        if self.buf[:4] != _MAGIC:
            raise GGUFFormatError("the file does not start with the GGUF magic bytes")
        self.pos = 4
        version, tensor_count, kv_count = self.take("I"), self.take("Q"), self.take("Q")
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is too old (2 or later is supported)")
        metadata = {}
        for _ in range(kv_count):
            key = self.string()
            metadata[key] = self.value(self.take("I"), key)
        shapes, types, offsets = {}, {}, {}
        for _ in range(tensor_count):
            name = self.string()
            dims = tuple(self.take("Q") for _ in range(self.take("I")))
            types[name], offsets[name] = self.take("I"), self.take("Q")
            shapes[name] = dims
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFFormatError(f"general.alignment is {alignment!r}, not a positive integer")
        data_start = (self.pos + alignment - 1) // alignment * alignment
        header = GGUFHeader(version, metadata, shapes, types, {name: data_start + o for name, o in offsets.items()})
        _check_sizes(header, len(self.buf))
        return header


def _check_sizes(header: GGUFHeader, file_bytes: int) -> None:
    """GGUFFormatError where a tensor (of a type gguf knows) ends past the file's end: a truncated file is refused
    when its header is read (`validate`), not seconds into loading the weights."""
    from gguf import GGML_QUANT_SIZES

    for name, dims in header.tensor_shapes.items():
        if header.tensor_types[name] not in GGML_QUANT_SIZES:
            continue  # the loader names the type it does not know
        block, size = GGML_QUANT_SIZES[header.tensor_types[name]]
        end = header.tensor_offsets[name] + math.prod(dims) // block * size
        if end > file_bytes:
            raise GGUFFormatError(f"tensor {name!r} ends at byte {end:,}, past the end of the file ({file_bytes:,} "
                                  "bytes): a truncated file?")
