"""Reading checkpoints into Hugging Face-named tensors: one GGUF file, or a HF directory of safetensors.

GGUF weights of the types app/model/quant.py has kernels for stay quantized (a QuantizedTensor);
every other tensor is dequantized to float32 at load. llama.cpp stores the
Q and K projections of "llama" models permuted for its interleaved RoPE; they are put back here so
that one NeoX-layout rotary kernel serves every format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from app.model.config import ModelConfig, UnsupportedModel, config_from_gguf, config_from_hf
from app.model.footprint import expert_features, is_router
from app.model.quant import KEPT_TYPES, QuantizedTensor

GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}
GGUF_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
              "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
# a mixture of experts' weights, all experts of a layer in one tensor (older Mixtral files: one per expert,
# blk.<i>.ffn_gate.<expert>.weight)
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# (IQ1_S to IQ3_S have no kernel: gguf dequantizes them at load)
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


class GGUFCheckpoint:
    """A GGUF file: its config, its tensors (by HF name, dequantized), its chat template."""

    def __init__(self, path: Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from app.model.gguf_header import read_gguf_header

        self.path = path
        header = read_gguf_header(path)  # not gguf.GGUFReader: it parses the whole vocabulary (seconds)
        self.meta = header.metadata  # scalars and strings; an array as its length
        config = config_from_gguf(self.meta, _vocab_size(self.meta), "output.weight" in header.tensor_shapes)
        self.config = _features_as_stored(config, header.tensor_shapes)
        self.chat_template = self.meta.get("tokenizer.chat_template")
        known = {t.value: t.name for t in GGMLQuantizationType}
        unsupported = sorted({known.get(t, f"type {t}") for t in header.tensor_types.values()} - set(GGUF_TYPES))
        if unsupported:
            raise UnsupportedModel(f"GGUF tensor type(s) {', '.join(unsupported)} are not supported; "
                                   f"supported: {', '.join(GGUF_TYPES)}")
        self.header = header
        self._types = {name: GGMLQuantizationType(t) for name, t in header.tensor_types.items()}
        self._sizes = GGML_QUANT_SIZES

    def __len__(self) -> int:
        """How many tensors `tensors` yields (a stack of experts' weights as its experts)."""
        return sum(int(dims[2]) if _EXPERTS.fullmatch(name) else 1 for name, dims in self.header.tensor_shapes.items())

    def _raw(self, data: np.ndarray, name: str) -> np.ndarray:
        """A tensor's bytes in the file, [..., bytes of one innermost row] (outer dimensions first)."""
        dims = self.header.tensor_shapes[name]  # innermost first
        block, size = self._sizes[self._types[name]]
        row_bytes = dims[0] // block * size
        start = self.header.tensor_offsets[name]
        count = row_bytes * int(np.prod(dims[1:], dtype=np.int64))
        if start + count > data.size:
            raise UnsupportedModel(f"GGUF tensor {name!r} ends past the end of {self.path} (a truncated file?)")
        return data[start:start + count].reshape(*reversed(dims[1:]), row_bytes)

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Every tensor by HF name; with `keep_quantized`, 2-D weights of a kept type as QuantizedTensor and BF16
        ones as bfloat16 (their bits: the kernels take them packed, app/model/quant.py `pack`). A mixture of
        experts' stacked weights (ffn_gate_exps: [experts, rows, columns]) come out one expert at a time, as
        the Hugging Face checkpoints name them."""
        arch = self.meta["general.architecture"]
        data = np.memmap(self.path, dtype=np.uint8, mode="c")  # copy-on-write: gguf's dequantizers read it in place
        for gguf_name, dims in self.header.tensor_shapes.items():
            qtype, raw = self._types[gguf_name], self._raw(data, gguf_name)
            stacked = _EXPERTS.fullmatch(gguf_name)
            if stacked:
                layer, kind = stacked.groups()
                for expert in range(int(dims[2])):
                    name = f"model.layers.{layer}.mlp.experts.{expert}.{kind}_proj.weight"
                    yield name, _tensor(raw[expert], qtype, dims[:2], keep_quantized)
                continue
            name = _hf_name(gguf_name)
            weight = _tensor(raw, qtype, dims, keep_quantized and not is_router(gguf_name))
            if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                heads = self.config.num_heads if ".q_proj" in name else self.config.num_kv_heads
                weight = _unpermute(weight, heads)
            yield name, weight
        del data

    def types(self) -> dict[str, int]:
        """How many tensors of each GGUF type the file holds."""
        from collections import Counter

        return dict(Counter(t.name for t in self._types.values()))


def _features_as_stored(config: ModelConfig, shapes: dict) -> ModelConfig:
    """`config` with each expert's features as its weights hold them (the plan reads them so): a file that leaves
    the size out, or a config that gives another, must still split over TP ranks as the weights are."""
    from dataclasses import replace

    features = expert_features(shapes)
    if config.num_experts and features and features != config.expert_intermediate_size:
        return replace(config, expert_intermediate_size=features)
    return config


def _tensor(raw: np.ndarray, qtype, dims, keep_quantized: bool) -> torch.Tensor | QuantizedTensor:
    """One tensor of the file from its bytes `raw` (GGUF type `qtype`, dimensions `dims` innermost first)."""
    import gguf

    if keep_quantized and qtype.value in KEPT_TYPES and len(dims) == 2:
        blocks = torch.from_numpy(np.array(raw)).reshape(int(dims[1]), -1)  # a copy
        return QuantizedTensor(blocks, KEPT_TYPES[qtype.value][1], int(dims[0]))
    if keep_quantized and qtype.name == "BF16" and len(dims) == 2:
        return torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)  # a copy, [rows, cols]
    values = gguf.quants.dequantize(raw, qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is mapped read-only


def _vocab_size(meta: dict) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")  # the vocabulary array, read as its length
    return int(tokens) if tokens is not None else int(meta.get(f"{meta['general.architecture']}.vocab_size", 0))


def _hf_name(name: str) -> str:
    if name in GGUF_TOP:
        return GGUF_TOP[name]
    one = _ONE_EXPERT.fullmatch(name)
    if one:
        layer, kind, expert = one.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{kind}_proj.weight"
    parts = name.split(".")  # blk.<i>.<kind>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{GGUF_BLOCK[parts[2]]}.{parts[3]}"
    raise UnsupportedModel(f"GGUF tensor {name!r} is not part of a supported Llama-family model")


def _unpermute(w: torch.Tensor | QuantizedTensor, heads: int) -> torch.Tensor | QuantizedTensor:
    """Undo llama.cpp's per-head interleave of the rotary halves: rows (h, d/2, 2) -> (h, 2, d/2)."""
    rows = w.shape[0]
    if isinstance(w, QuantizedTensor):  # whole rows move, so the blocks along each row stay intact
        return w.rows(_unpermute(torch.arange(rows), heads))
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class HFCheckpoint:
    """A Hugging Face directory: config.json, tokenizer files, one or more safetensors files."""

    def __init__(self, path: Path):
        self.path = path
        self.config: ModelConfig = config_from_hf(json.loads((path / "config.json").read_text()))
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise UnsupportedModel(f"{path} has no *.safetensors files (PyTorch .bin checkpoints are not supported)")
        if self.config.num_experts:
            from app.model.footprint import safetensors_headers

            shapes = {n: shape for f in self.files for n, (_, shape) in safetensors_headers(f).items()}
            self.config = _features_as_stored(self.config, shapes)
        self.chat_template = None  # the tokenizer files carry it

    def __len__(self) -> int:
        from safetensors import safe_open

        total = 0
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                total += len(list(f.keys()))
        return total

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield _mixtral_name(name), f.get_tensor(name)


_MIXTRAL = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _mixtral_name(name: str) -> str:
    """Mixtral's names for its experts (block_sparse_moe.experts.<e>.w1) as Qwen3-MoE's (mlp.experts.<e>.gate_proj),
    which the model takes."""
    if "block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL.items():
        name = name.replace(old, new)
    return name
