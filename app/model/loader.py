"""Load a model for serving: config, weights (with progress on a terminal), tokenizer, chat template."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from app.model.config import ModelConfig
from app.model.footprint import fused_siblings, is_router
from app.model.linear import MergedColumnParallelLinear, QKVParallelLinear
from app.model.llama import LlamaForCausalLM
from app.model.source import ModelSource
from app.model.tokenizer import load_tokenizer
from app.model.weights import GGUFCheckpoint, HFCheckpoint
from app.units import format_size

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer
    chat_template: str | None
    seconds: float


def load_model(source: ModelSource, dtype: str, tokenizer: bool = True, quantized: str = "keep", group=None,
               rank: int = 0, size: int = 1, activations: str = "int16") -> LoadedModel:
    """Read `source` and build the model in `dtype` ("float32" or "bfloat16").

    With `quantized` "keep", GGUF weights of the types app/model/quant.py has kernels for stay in
    their blocks, and meet activations as `activations` says; "dequantize" expands every weight to `dtype`.

    With `size` > 1, only TP rank `rank`'s shard is kept: each tensor is cut as it is read, so the
    whole model is never in memory; `group` is the rank's TP group.
    """
    from tqdm import tqdm

    from app.parallel.shard import ShardSpec

    start = time.perf_counter()
    checkpoint = GGUFCheckpoint(source.path) if source.format == "gguf" else HFCheckpoint(source.path)
    shard = ShardSpec.of(checkpoint.config, rank, size)
    weights = {}
    bar = tqdm(total=len(checkpoint), desc=f"loading {source.served_name}", unit="tensor", disable=None, leave=False)
    keep = quantized == "keep"
    gguf = isinstance(checkpoint, GGUFCheckpoint)
    for name, tensor in checkpoint.tensors(keep_quantized=True) if keep and gguf else checkpoint.tensors():
        part = shard.take(name, tensor)
        if part is not None:
            floating = isinstance(part, torch.Tensor) and part.is_floating_point()
            kept = keep and kept_bfloat16(part) and not is_router(name)
            weights[name] = part.to(DTYPES[dtype]) if floating and not kept else part
        del tensor, part
        bar.update()
    bar.close()
    if keep and dtype == "float32":
        _unmix_bfloat16(weights)
    model = LlamaForCausalLM(checkpoint.config, weights, DTYPES[dtype], group, shard, activations)
    del weights
    tok = load_tokenizer(source) if tokenizer else None
    template = _chat_template(tok, checkpoint.chat_template)
    seconds = time.perf_counter() - start
    mlp = f"{len(shard.expert_features)} features of each expert" if checkpoint.config.num_experts \
        else f"{len(shard.intermediate)} MLP features"
    part = f" (TP rank {rank} of {size}: {shard.num_heads} query / {shard.num_kv_heads} KV heads, {mlp})" \
        if size > 1 else ""
    log.info("loaded %s (%s, %d layers) as %s in %.1f s: %s of weights resident%s%s", source.served_name,
             checkpoint.config.architecture, checkpoint.config.num_layers, dtype, seconds,
             format_size(model.resident_bytes()), part, _weight_types(checkpoint, keep, dtype, activations, model))
    return LoadedModel(model, checkpoint.config, tok, template, seconds)


def kept_bfloat16(weight) -> bool:
    """A bfloat16 weight (a GGUF file's BF16 one, GGUFCheckpoint.tensors with keep_quantized; a bfloat16 tensor of
    safetensors) stays bfloat16 under float32 compute too, where the kernels can pack it (rows of whole blocks of
    32): they multiply float32 x by its exactly widened values, the products the float32 reference makes, at half
    its bytes and on the native layer stack (AMD Zen 3, a BF16 file under float32 served one stream at 11.8 tokens/s
    as float32 weights on torch, 39.8 packed)."""
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.dim() == 2 \
        and weight.shape[1] % 32 == 0


def _unmix_bfloat16(weights: dict) -> None:
    """Where a projection the model fuses has bfloat16 parts beside others (F16 or F32 ones, quantized blocks),
    its bfloat16 parts go to float32, so that the fused weight is the float32 one it always was (quant.fuse_rows
    expands to its float parts' dtype; app/model/footprint.py sizes it so)."""
    for name in [n for n, w in weights.items() if kept_bfloat16(w)]:
        if not all(kept_bfloat16(weights[s]) for s in fused_siblings(name, weights)):
            weights[name] = weights[name].float()


def _weight_types(checkpoint, keep: bool, dtype: str, activations: str, model) -> str:
    """What became of the file's weight types: kept quantized (as stored), or dequantized (and why); and the
    fused projections of mixed types, run as their parts."""
    if not isinstance(checkpoint, GGUFCheckpoint):
        from app.model.quant import PackedWeight

        kept = dtype == "float32" and any(isinstance(lin.weight, PackedWeight) and lin.weight.type_name == "BF16"
                                          for lin in model.linears())
        return "; bfloat16 weights kept as bfloat16, multiplied in float32" if kept else ""
    from app.model.quant import KEPT_TYPES, PackedParts

    types = checkpoint.types()
    kept = sorted(t for t in types if keep and t in {name for name, _ in KEPT_TYPES.values()})
    expanded = sorted(t for t in types if t not in kept and t not in ("F32", "F16", "BF16"))
    said = f"; kept quantized: {', '.join(kept)} (activations: {activations})" if kept else ""
    if keep and dtype == "float32" and "BF16" in types:
        said += "; BF16 weights kept as bfloat16, multiplied in float32"
    fused = [lin.weight for lin in model.linears() if isinstance(lin, QKVParallelLinear | MergedColumnParallelLinear)]
    mixed = sum(isinstance(w, PackedParts) for w in fused)
    if mixed:
        said += f"; {mixed} fused projection(s) of mixed types run as their parts"
    if expanded:
        why = "no kernel for them yet" if keep else "model.quantized is dequantize"
        said += f"; dequantized to {dtype} at load: {', '.join(expanded)} ({why})"
    return said


def _chat_template(tok, from_file: str | None) -> str | None:
    return getattr(tok, "chat_template", None) or from_file
