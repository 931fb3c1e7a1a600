"""The numbers placement needs about a model: its size in memory and its KV cache per token.

Read from the GGUF header or from a Hugging Face directory's config.json and safetensors headers,
without loading any weights.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from app.model.gguf_header import IN_BLOCKS_OF_32, KEPT_QUANT_TYPES, PACKED_QUANT_TYPES, read_gguf_header
from app.model.source import ModelSource
from app.parallel.heads import split_features, split_heads
from app.spec.errors import Described, Problem, SpecError

log = logging.getLogger("app.model")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# llama.cpp's `{arch}.pooling_type` values for the poolings of embeddings (model.pooling; 0, none, and 4, rank, are
# none /v1/embeddings can give: such a file pools "last", the default for a decoder model)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}

# How each checkpoint tensor is split over TP ranks (see app/parallel/shard.py), by a part of its name,
# GGUF's and Hugging Face's; anything else (norms, rope factors) is replicated on every rank.
PARTS = (("embedding", (".token_embd.", ".embed_tokens.")), ("lm_head", (".output.weight", ".lm_head.")),
         ("attention_q", (".attn_q.", ".attn_output.", ".q_proj.", ".o_proj.")),
         ("attention_kv", (".attn_k.", ".attn_v.", ".k_proj.", ".v_proj.")),
         ("experts", (".ffn_gate_exps.", ".ffn_up_exps.", ".ffn_down_exps.", ".experts.")),
         ("mlp", (".ffn_gate.", ".ffn_up.", ".ffn_down.", ".gate_proj.", ".up_proj.", ".down_proj.")))


@dataclass(frozen=True)
class ParamCounts:
    """The model's parameters by how tensor parallelism splits them."""

    embedding: int = 0  # replicated on every rank
    lm_head: int = 0  # on rank 0 only (0 when tied to the embedding)
    attention_q: int = 0  # query and output projections: split with the query heads
    attention_kv: int = 0  # key and value projections: split with the KV heads, replicated past their count
    mlp: int = 0  # split with the intermediate features
    other: int = 0  # replicated (a mixture of experts' router too)
    experts: int = 0  # a mixture of experts' MLPs: split with each expert's features

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...] | list[int]]) -> ParamCounts:
        counts = dict.fromkeys(("embedding", "lm_head", "attention_q", "attention_kv", "mlp", "other", "experts"), 0)
        for name, shape in shapes.items():
            part = next((part for part, marks in PARTS if any(m in f".{name}" for m in marks)), "other")
            counts[part] += _product(shape)
        return cls(**counts)

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention_q + self.attention_kv + self.mlp + self.other \
            + self.experts


@dataclass(frozen=True)
class ModelFootprint:
    architecture: str
    num_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    intermediate_size: int = 0
    expert_intermediate_size: int = 0  # each expert's features in a mixture of experts
    params: ParamCounts | None = None  # None: only the total is known, split evenly
    kept: ParamCounts | None = None  # of the params, those in GGUF blocks that stay quantized at load
    kept_bytes: ParamCounts | None = None  # and their bytes
    # the bytes row-parallel K-quant weights (attn_output, ffn_down) add when a rank's cut of their input
    # features does not fall on their superblocks of 256 and they load in blocks of 32 (QuantizedTensor.columns)
    cut_bytes: ParamCounts | None = None
    # how the file says its embeddings pool the final hidden states (model.pooling): "last" unless it says otherwise
    pooling: str = "last"

    def dequantized(self) -> ModelFootprint:
        """The footprint when every weight is expanded to the compute dtype (model.quantized: dequantize)."""
        return replace(self, kept=None, kept_bytes=None, cut_bytes=None)

    def weight_bytes(self, dtype: str, tp: int = 1, rank: int = 0) -> int:
        """Resident weights of one TP rank: kept-quantized blocks as stored, the rest at the compute dtype;
        its heads' and MLP features' share of the layers, plus what every rank replicates and rank 0's LM head."""
        if self.params is None or (tp > 1 and (self.params.mlp and self.intermediate_size <= 0
                                               or self.params.experts and self.expert_intermediate_size <= 0)):
            return self.num_params * DTYPE_BYTES[dtype] // tp
        expanded = self._share(self.params, tp, rank) - (self._share(self.kept, tp, rank) if self.kept else 0)
        kept = self._share(self.kept_bytes, tp, rank) if self.kept_bytes else 0
        return expanded * DTYPE_BYTES[dtype] + kept + (self._cut_share(tp, rank) if self.cut_bytes else 0)

    def _cut_share(self, tp: int, rank: int) -> int:
        """What this rank's row-parallel K-quant weights add in blocks of 32, where its cut is off 256."""
        if tp == 1:
            return 0
        heads = split_heads(self.num_heads, self.num_kv_heads, tp)[rank].q_heads
        extra = 0
        if heads.start * self.head_dim % 256 or heads.stop * self.head_dim % 256:
            extra += self.cut_bytes.attention_q * len(heads) // self.num_heads
        for cut, size in ((self.cut_bytes.mlp, self.intermediate_size),
                          (self.cut_bytes.experts, self.expert_intermediate_size)):
            features = split_features(size, tp)[rank]
            if cut and (features.start % 256 or features.stop % 256):
                extra += cut * len(features) // size
        return extra

    def _share(self, p: ParamCounts, tp: int, rank: int) -> int:
        if tp == 1:
            return p.total
        heads = split_heads(self.num_heads, self.num_kv_heads, tp)[rank]

        def features(count: int, size: int) -> int:  # this rank's share of `count` split with `size` features
            return count * len(split_features(size, tp)[rank]) // size if count else 0

        return (p.embedding + p.other + (p.lm_head if rank == 0 else 0)
                + p.attention_q * len(heads.q_heads) // self.num_heads
                + p.attention_kv * len(heads.kv_heads) // self.num_kv_heads
                + features(p.mlp, self.intermediate_size) + features(p.experts, self.expert_intermediate_size))

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
    params = ParamCounts.of(header.tensor_shapes)
    kept_as = _kept_as(header)
    kept = {name: shape for name, shape in header.tensor_shapes.items() if kept_as[name] is not None}
    kept_bytes = {name: (_packed_bytes(shape, kept_as[name]),) for name, shape in kept.items()}
    cut_bytes = {name: (_packed_bytes(shape, IN_BLOCKS_OF_32[kept_as[name]]) - kept_bytes[name][0],)
                 for name, shape in kept.items() if kept_as[name] in IN_BLOCKS_OF_32
                 and any(part in f".{name}" for part in (".attn_output.", ".ffn_down.", ".ffn_down_exps."))}
    return ModelFootprint(
        architecture=arch,
        num_params=params.total,
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        context_length=int(meta.get(f"{arch}.context_length", 2048)),
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length", 0)),
        expert_intermediate_size=expert_features(header.tensor_shapes),
        params=params,
        kept=ParamCounts.of(kept) if kept else None,
        kept_bytes=ParamCounts.of(kept_bytes) if kept else None,
        cut_bytes=ParamCounts.of(cut_bytes) if cut_bytes else None,
        pooling=GGUF_POOLING.get(meta.get(f"{arch}.pooling_type"), "last"),
    )


FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_exps", "ffn_up_exps"))  # projections
# the model stacks into one weight (experts: each expert's)
BF16 = 30  # GGML's id: BF16 weights load as bfloat16 at any compute dtype (app/model/loader.py, kept_bfloat16)


def _kept_as(header) -> dict[str, int | None]:
    """The packed type each tensor runs as, None for one expanded to the compute dtype: as app/model/quant.py's
    fuse_rows decides, a fused group with a float part is expanded (one of mixed quantized types runs as its
    parts, each in its own type)."""
    def matrices(name: str, shape) -> bool:  # a weight, or a stack of experts' weights
        return len(shape) == 2 or len(shape) == 3 and "_exps." in name

    kept_as = {name: None if is_router(name) else KEPT_QUANT_TYPES[header.tensor_types[name]][1]
               if header.tensor_types[name] in KEPT_QUANT_TYPES and matrices(name, shape)
               else BF16 if header.tensor_types[name] == BF16 and matrices(name, shape) and int(shape[0]) % 32 == 0
               else None for name, shape in header.tensor_shapes.items()}
    layers = {name.split(".")[1] for name in kept_as if name.startswith("blk.")}
    for layer in layers:
        for group in FUSED:
            names = [f"blk.{layer}.{part}.weight" for part in group if f"blk.{layer}.{part}.weight" in kept_as]
            kinds = {kept_as[name] for name in names}
            if None in kinds or BF16 in kinds and len(kinds) > 1:  # (app/model/loader.py, _unmix_bfloat16)
                for name in names:
                    kept_as[name] = None
    return kept_as


def _from_hf(path: Path) -> ModelFootprint:
    config = json.loads((path / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, (dtype, shape) in safetensors_headers(file).items():
            shapes[name], dtypes[name] = shape, dtype
    params = ParamCounts.of(shapes)
    kept = _kept_bfloat16(shapes, dtypes)
    return ModelFootprint(
        architecture=(config.get("architectures") or ["unknown"])[0],
        num_params=params.total,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        context_length=int(config.get("max_position_embeddings", 2048)),
        intermediate_size=int(config.get("intermediate_size") or 0),
        expert_intermediate_size=expert_features(shapes),
        params=params,
        kept=ParamCounts.of(kept) if kept else None,
        kept_bytes=ParamCounts.of({name: (_product(shape) * 2,) for name, shape in kept.items()}) if kept else None,
        pooling=_sentence_transformers_pooling(path),
    )


def _sentence_transformers_pooling(path: Path) -> str:
    """A sentence-transformers directory's pooling (modules.json names a Pooling module, whose config.json says
    which mode), as vLLM reads it; "last" where there is none or it is one this server has not (max, weighted
    mean): the pooling of decoder embedding models such as Qwen3-Embedding."""
    try:
        modules = json.loads((path / "modules.json").read_text())
        where = next(m["path"] for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        config = json.loads((path / where / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return "last"
    modes = [mode for mode, key in (("mean", "pooling_mode_mean_tokens"), ("cls", "pooling_mode_cls_token"),
                                    ("last", "pooling_mode_lasttoken")) if config.get(key) is True]
    others = sorted(k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_")
                    and v is True and k not in ("pooling_mode_mean_tokens", "pooling_mode_cls_token",
                                                "pooling_mode_lasttoken"))
    dense = [m["path"] for m in modules if str(m.get("type", "")).endswith(".Dense")]
    said = (str(path), *others, *modes, *dense)
    if (others or len(modes) != 1 or dense) and said not in _warned:  # (once: a directory is read more than once)
        _warned.add(said)
        log.warning("%s: its sentence-transformers pipeline %s; embeddings pool %s and will differ from "
                    "sentence-transformers' (set model.pooling to choose)", path,
                    "; ".join(filter(None, [f"pools by {' + '.join(others + modes)}" if others or len(modes) > 1
                                            else "", f"has Dense layers ({', '.join(dense)}) not applied here"
                                            if dense else ""])) or "names no pooling mode",
                    modes[0] if len(modes) == 1 else "by the last token")
    return modes[0] if len(modes) == 1 else "last"


_warned: set[tuple[str, ...]] = set()  # the pipelines warned about


HF_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))  # (HF names) stacked into
# one weight (w1, w3: Mixtral's experts' gate and up)


def fused_siblings(name: str, names) -> list[str]:
    """The weights of `names` (HF names) stacked with `name` into one fused projection, itself included; [] for one
    that is not fused."""
    parent, leaf = name.rsplit(".", 2)[0], name.split(".")[-2]
    group = next((g for g in HF_FUSED if leaf in g), ())
    return [f"{parent}.{part}.weight" for part in group if f"{parent}.{part}.weight" in names]


def _kept_bfloat16(shapes: dict[str, list[int]], dtypes: dict[str, str]) -> dict[str, list[int]]:
    """The safetensors weights that load as bfloat16 at any compute dtype (app/model/loader.py, kept_bfloat16): 2-D
    BF16 ones of whole blocks of 32 in a row, but those of a fused projection with a part that is not (_unmix_bfloat16)."""
    def kept(name: str) -> bool:
        return dtypes[name] == "BF16" and len(shapes[name]) == 2 and int(shapes[name][1]) % 32 == 0 \
            and not is_router(name)

    return {name: shape for name, shape in shapes.items()
            if kept(name) and all(kept(s) for s in fused_siblings(name, shapes))}


def is_router(name: str) -> bool:
    """A mixture of experts' router (GGUF's name or Hugging Face's): loaded in the compute dtype, never packed (its
    few rows, 8 to 128, would be padded to the kernels' interleave)."""
    return name.endswith((".ffn_gate_inp.weight", ".mlp.gate.weight", ".block_sparse_moe.gate.weight"))


def expert_features(shapes: dict[str, tuple[int, ...] | list[int]]) -> int:
    """Each expert's MLP features, from its down projection's shape (GGUF's stack [features, hidden, experts]
    innermost first, an HF expert's [hidden, features]); 0 for a model without experts."""
    for name, shape in shapes.items():
        if name.endswith(".ffn_down_exps.weight"):
            return int(shape[0])
        if ".experts." in name and name.endswith((".down_proj.weight", ".w2.weight")):
            return int(shape[1])
    return 0


def safetensors_headers(file: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in the file, read from its header"""
    from safetensors import safe_open  # only HF directories need it

    with safe_open(str(file), framework="numpy") as tensors:
        slices = {name: tensors.get_slice(name) for name in tensors.keys()}
        return {name: (part.get_dtype(), part.get_shape()) for name, part in slices.items()}


def _packed_bytes(shape: tuple[int, ...] | list[int], qtype: int) -> int:
    if qtype == BF16:
        return _product(shape) * 2
    kind = PACKED_QUANT_TYPES[qtype]
    return _product(shape) // kind.weights * kind.packed_bytes


def _product(shape: tuple[int, ...] | list[int]) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total
