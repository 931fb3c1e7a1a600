"""The Llama-family decoder: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2 (QKV bias), Qwen3 (Q/K norm).

Built from a state dict in Hugging Face's parameter names (both loaders produce those). Q/K/V and
gate/up projections are fused at build time, so each layer runs four GEMMs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from app.model.batch import ForwardBatch
from app.model.config import ModelConfig
from app.model.layers import MLP, Attention, DecoderLayer, KVCache
from app.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from app.model.quant import QuantizedTensor, Weight, storage
from app.model.rope import cos_sin_table, inverse_frequencies
from app.parallel.group import SingleRank
from app.parallel.shard import ShardSpec


class LlamaForCausalLM:
    """One rank's part of the model: `weights` hold the shard `shard` describes (the whole model by default);
    `group` sums the row-parallel outputs. Rank 0 holds the LM head and computes logits."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, group=None,
                 shard: ShardSpec | None = None):
        self.cfg, self.dtype = cfg, dtype
        self.group = group or SingleRank()
        self.shard = shard or ShardSpec.whole(cfg)
        w = _Weights(weights, dtype)
        self.embed = w.take("model.embed_tokens.weight")
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.norm = w.take("model.norm.weight")
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = w.take("lm_head.weight") if "lm_head.weight" in weights else None  # rank 0 only
        rot = cfg.rotary_dim or cfg.head_dim
        factors = weights.get("rope_freqs")  # GGUF's precomputed Llama-3 scaling, when present
        self.cos_sin = cos_sin_table(cfg.max_position, inverse_frequencies(rot, cfg.rope_theta, cfg.rope_scaling, factors))
        w.check_all_used(ignore={"rope_freqs", "lm_head.weight"})

    def _layer(self, w: _Weights, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        biases = tuple(w.take(p + f"self_attn.{n}_proj.bias") for n in "qkv") if self.cfg.qkv_bias else None
        qkv = QKVParallelLinear(*(w.take(p + f"self_attn.{n}_proj.weight") for n in "qkv"), biases)
        q_norm = w.take(p + "self_attn.q_norm.weight") if self.cfg.qk_norm else None
        k_norm = w.take(p + "self_attn.k_norm.weight") if self.cfg.qk_norm else None
        o = RowParallelLinear(w.take(p + "self_attn.o_proj.weight"), self.group)
        attention = Attention(self.cfg, self.shard.num_heads, self.shard.num_kv_heads, qkv, o, q_norm, k_norm)
        gate_up = MergedColumnParallelLinear(w.take(p + "mlp.gate_proj.weight"), w.take(p + "mlp.up_proj.weight"))
        mlp = MLP(gate_up, RowParallelLinear(w.take(p + "mlp.down_proj.weight"), self.group))
        return DecoderLayer(attention, mlp, w.take(p + "input_layernorm.weight"),
                            w.take(p + "post_attention_layernorm.weight"), self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: list[KVCache]) -> torch.Tensor:
        # input_ids: [T] -> final hidden states [T, H]
        from app import kernels

        if isinstance(self.embed, QuantizedTensor):
            x = self.embed.embedding(input_ids, self.dtype)
        else:
            x = F.embedding(input_ids, self.embed)
        residual = None
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = layer(x, residual, batch, cache, self.cos_sin)
        kernels.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, H] -> [S, vocab] float32. In bfloat16 the head accumulates AND outputs float32:
        # rounded to bf16, close logits would tie or swap and change greedy choices.
        if isinstance(self.lm_head, QuantizedTensor):
            return self.lm_head.linear(hidden, torch.float32)
        if self.dtype == torch.bfloat16:
            from app import kernels

            return kernels.linear_f32_out(hidden, self.lm_head)
        return F.linear(hidden, self.lm_head)

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        shape = (num_blocks, self.shard.num_kv_heads, block_size, self.cfg.head_dim)
        dtype = dtype or self.dtype
        # empty, not zeros: attention reads no slot before a step has written it (tests/kernels pins that down
        # with a NaN-filled cache), and zeroing gigabytes took seconds of every start and made all of it resident
        return [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in self.layers]

    def resident_bytes(self) -> int:
        tensors = {id(t): t for t in self.tensors()}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def tensors(self) -> list[torch.Tensor]:
        out = [storage(t) for t in (self.embed, self.norm, self.lm_head, self.cos_sin) if t is not None]
        for layer in self.layers:
            a = layer.attention
            for linear in (a.qkv, a.o, layer.mlp.gate_up, layer.mlp.down):
                out += linear.tensors()
            out += [layer.input_norm, layer.post_norm] + [t for t in (a.q_norm, a.k_norm) if t is not None]
        return out


class _Weights:
    """Hands out each named tensor once, in the compute dtype, and notices what was never used."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self.weights, self.dtype, self.used = weights, dtype, set()

    def take(self, name: str) -> Weight:
        if name not in self.weights:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        self.used.add(name)
        weight = self.weights[name]
        return weight if isinstance(weight, QuantizedTensor) else weight.to(self.dtype).contiguous()

    def check_all_used(self, ignore: set[str]) -> None:
        unused = sorted(set(self.weights) - self.used - ignore)
        if unused:
            raise ValueError(f"the checkpoint has tensors this architecture does not use: {', '.join(unused[:5])}"
                             + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))
