"""Load a model for serving: config, weights (with progress on a terminal), tokenizer, chat template."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from app.model.config import ModelConfig
from app.model.llama import LlamaForCausalLM
from app.model.source import ModelSource
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


def load_model(source: ModelSource, dtype: str, tokenizer: bool = True) -> LoadedModel:
    """Read `source` and build the model in `dtype` ("float32" or "bfloat16")."""
    from tqdm import tqdm

    start = time.perf_counter()
    checkpoint = GGUFCheckpoint(source.path) if source.format == "gguf" else HFCheckpoint(source.path)
    weights = {}
    bar = tqdm(total=len(checkpoint), desc=f"loading {source.served_name}", unit="tensor", disable=None, leave=False)
    for name, tensor in checkpoint.tensors():
        weights[name] = tensor
        bar.update()
    bar.close()
    model = LlamaForCausalLM(checkpoint.config, weights, DTYPES[dtype])
    del weights
    tok = load_tokenizer(source) if tokenizer else None
    template = _chat_template(tok, checkpoint.chat_template)
    seconds = time.perf_counter() - start
    log.info("loaded %s (%s, %d layers) as %s in %.1f s: %s of weights resident", source.served_name,
             checkpoint.config.architecture, checkpoint.config.num_layers, dtype, seconds,
             format_size(model.resident_bytes()))
    return LoadedModel(model, checkpoint.config, tok, template, seconds)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    if source.format == "gguf":
        return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    return AutoTokenizer.from_pretrained(str(source.path))


def _chat_template(tok, from_file: str | None) -> str | None:
    return getattr(tok, "chat_template", None) or from_file
