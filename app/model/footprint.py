"""The numbers placement needs about a model: its size in memory and its KV cache per token.

Read from the GGUF header or from a Hugging Face directory's config.json and safetensors headers,
without loading any weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app.model.gguf_header import read_gguf_header
from app.model.source import ModelSource
from app.spec.errors import Described, Problem, SpecError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelFootprint:
    architecture: str
    num_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int

    def weight_bytes(self, dtype: str, tp: int = 1) -> int:
        """Resident weights of one rank: weights are loaded (dequantized) at the compute dtype."""
        return self.num_params * DTYPE_BYTES[dtype] // tp

    def kv_bytes_per_token(self, dtype: str, tp: int = 1) -> int:
        """K and V of every layer for one token on one rank (KV heads are split across TP ranks)."""
        kv_heads = -(-self.num_kv_heads // tp)
        return 2 * self.num_layers * kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def read_footprint(source: ModelSource, key: str = "model.path") -> ModelFootprint:
    """Read the footprint; a file that cannot be read as a model is a SpecError on `key`."""
    try:
        footprint = _from_gguf(source.path) if source.format == "gguf" else _from_hf(source.path)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, KeyError) else f"no {exc} in its metadata"
        raise SpecError([Problem(key, "a readable GGUF file or Hugging Face model directory",
                                 Described(f"{source.path}, which cannot be read ({what})"))]) from None
    if min(footprint.num_layers, footprint.num_heads, footprint.num_kv_heads, footprint.head_dim) <= 0:
        raise SpecError([Problem(key, "a model with positive layer, head and head-size counts",
                                 Described(f"{source.path} with {footprint}"))])
    return footprint


def _from_gguf(path: Path) -> ModelFootprint:
    header = read_gguf_header(path)
    meta = header.metadata
    arch = str(meta.get("general.architecture", "unknown"))
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    num_params = sum(_product(shape) for shape in header.tensor_shapes.values())
    return ModelFootprint(
        architecture=arch,
        num_params=num_params,
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        context_length=int(meta.get(f"{arch}.context_length", 2048)),
    )


def _from_hf(path: Path) -> ModelFootprint:
    config = json.loads((path / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    num_params = sum(_safetensors_params(file) for file in sorted(path.glob("*.safetensors")))
    return ModelFootprint(
        architecture=(config.get("architectures") or ["unknown"])[0],
        num_params=num_params,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        context_length=int(config.get("max_position_embeddings", 2048)),
    )


def _safetensors_params(file: Path) -> int:
    from safetensors import safe_open  # only HF directories need it

    with safe_open(str(file), framework="numpy") as tensors:
        return sum(_product(tensors.get_slice(name).get_shape()) for name in tensors.keys())


def _product(shape: tuple[int, ...] | list[int]) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total
