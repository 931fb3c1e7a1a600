"""The Llama-family decoder: Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2 (QKV bias), Qwen3 (Q/K norm), and
the mixtures of experts Mixtral and Qwen3-MoE.

Built from a state dict in Hugging Face's parameter names (both loaders produce those). Q/K/V and
gate/up projections are fused at build time, so each layer runs four GEMMs (a mixture of experts: two
for each expert a step's tokens chose).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.nn.functional as F

from app.model.batch import ForwardBatch
from app.model.config import ModelConfig
from app.model.layers import MLP, Attention, DecoderLayer, KVCache, MoE
from app.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from app.model.quant import Packed, PackedWeight, Weight, pack, storage
from app.model.rope import cos_sin_table, inverse_frequencies
from app.parallel.group import SingleRank
from app.parallel.shard import ShardSpec


class LlamaForCausalLM:
    """One rank's part of the model: `weights` hold the shard `shard` describes (the whole model by default);
    `group` sums the row-parallel outputs. Rank 0 holds the LM head and computes logits. Quantized
    weights meet activations as `activations` says (app/model/quant.py). The model takes `weights` apart as it
    is built: what it uses leaves the mapping."""

    def __init__(self, cfg: ModelConfig, weights: MutableMapping[str, Weight], dtype: torch.dtype, group=None,
                 shard: ShardSpec | None = None, activations: str = "int16"):
        self.cfg, self.dtype, self.activations = cfg, dtype, activations
        self.group = group or SingleRank()
        self.shard = shard or ShardSpec.whole(cfg)
        w = _Weights(weights, dtype)
        self.embed = pack(w.take("model.embed_tokens.weight"), activations)
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.norm = w.take("model.norm.weight")
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        elif "lm_head.weight" in weights:  # rank 0 only
            self.lm_head = pack(w.take("lm_head.weight"), activations)
        else:
            self.lm_head = None
        rot = cfg.rotary_dim or cfg.head_dim
        factors = weights.get("rope_freqs")  # GGUF's precomputed Llama-3 scaling, when present
        self.cos_sin = cos_sin_table(cfg.max_position, inverse_frequencies(rot, cfg.rope_theta, cfg.rope_scaling, factors))
        w.check_all_used(ignore={"rope_freqs", "lm_head.weight"})
        # The layer stack in one native call a step where every layer can (see _native_stack); False: the
        # Python layers always (tests compare the two)
        self.native_stack = True
        self._stack: tuple[list[KVCache], object] | None = None  # (the caches it was built for, the stack or None)

    def _layer(self, w: _Weights, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        biases = tuple(w.take(p + f"self_attn.{n}_proj.bias") for n in "qkv") if self.cfg.qkv_bias else None
        act = self.activations
        qkv = QKVParallelLinear(*(w.take(p + f"self_attn.{n}_proj.weight") for n in "qkv"), biases, act)
        q_norm = w.take(p + "self_attn.q_norm.weight") if self.cfg.qk_norm else None
        k_norm = w.take(p + "self_attn.k_norm.weight") if self.cfg.qk_norm else None
        o = RowParallelLinear(w.take(p + "self_attn.o_proj.weight"), self.group, act)
        attention = Attention(self.cfg, self.shard.num_heads, self.shard.num_kv_heads, qkv, o, q_norm, k_norm)
        if self.cfg.is_moe_layer(i):
            # each expert's down projection is summed over the group once, with the others (MoE)
            experts = [self._mlp(w, p + f"mlp.experts.{e}.", SingleRank()) for e in range(self.cfg.num_experts)]
            mlp = MoE(w.take(p + "mlp.gate.weight"), experts, self.cfg.experts_per_token, self.cfg.norm_topk_prob,
                      self.group)
        else:
            mlp = self._mlp(w, p + "mlp.", self.group)
        return DecoderLayer(attention, mlp, w.take(p + "input_layernorm.weight"),
                            w.take(p + "post_attention_layernorm.weight"), self.cfg.rms_norm_eps)

    def _mlp(self, w: _Weights, prefix: str, group) -> MLP:
        act = self.activations
        gate, up = w.take(prefix + "gate_proj.weight"), w.take(prefix + "up_proj.weight")
        gate_up = MergedColumnParallelLinear(gate, up, act)
        return MLP(gate_up, RowParallelLinear(w.take(prefix + "down_proj.weight"), group, act))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: list[KVCache]) -> torch.Tensor:
        # input_ids: [T] -> final hidden states [T, H] (on the native stack, only batch.hidden_rows' rows: the other
        # rows are left as they are, ForwardBatch.hidden_rows)
        from app import kernels

        if isinstance(self.embed, PackedWeight):
            x = self.embed.embedding(input_ids, self.dtype)
        else:
            x = F.embedding(input_ids, self.embed)
        stack = self._native_stack(caches) if self.native_stack else None
        if stack is not None:
            stack.run(x, batch.positions, batch.slot_mapping, batch.block_tables, batch.context_lens, batch.q_starts,
                      batch.prompt_rows, batch.hidden_rows)
            return x
        residual = None
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = layer(x, residual, batch, cache, self.cos_sin)
        kernels.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def _native_stack(self, caches: list[KVCache]):
        """The native layer stack for these caches (built on first use), or None where a layer needs the
        Python path: float32 weights, quantized ones under float activations."""
        if self._stack is not None and self._stack[0] is caches:
            return self._stack[1]
        self._stack = (caches, self._build_stack(caches))
        return self._stack[1]

    def _build_stack(self, caches: list[KVCache]):
        from app import kernels
        from app.model.quant import ACTIVATIONS, BF16

        weights = [lin.weight for lin in self.linears()]
        # quantized weights under "float" activations take torch's GEMM for prompts: the Python layers
        if (not all(isinstance(w, Packed) for w in weights)
                or self.activations not in ("int8", "int16") and any(p.qtype != BF16 for w in weights for p in w.parts)
                or self.group.size > 1 and getattr(self.group, "native", None) is None):
            return None
        native_group = self.group.native if self.group.size > 1 else None
        dense = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MLP)]
        inter = (dense[0] if dense else self.layers[0].mlp.experts[0]).down.weight.in_features
        stack = kernels.DecoderStack(self.dtype, ACTIVATIONS[self.activations], self.cfg.hidden_size,
                                     self.shard.num_heads, self.shard.num_kv_heads, self.cfg.head_dim, inter,
                                     self.cfg.rms_norm_eps, self.cfg.head_dim ** -0.5, self.cos_sin, self.norm,
                                     native_group)
        for layer, cache in zip(self.layers, caches, strict=True):
            a, m = layer.attention, layer.mlp
            experts = None
            if isinstance(m, MoE):
                experts = kernels.Experts(m.router, [_parts(e.gate_up) for e in m.experts],
                                          [_parts(e.down) for e in m.experts], m.top_k, m.renormalize)
            mlp = ([], []) if experts else (_parts(m.gate_up), _parts(m.down))
            stack.add_layer(_parts(a.qkv), _parts(a.o), *mlp, layer.input_norm, layer.post_norm, a.qkv.bias, *cache,
                            a.q_norm, a.k_norm, experts)
        return stack

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, H] -> [S, vocab] float32. In bfloat16 the head accumulates AND outputs float32:
        # rounded to bf16, close logits would tie or swap and change greedy choices.
        if isinstance(self.lm_head, PackedWeight):
            return self.lm_head.linear(hidden, torch.float32)
        if self.dtype == torch.bfloat16:
            from app import kernels

            return kernels.linear_f32_out(hidden, self.lm_head)
        return F.linear(hidden, self.lm_head)

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        # per layer: keys [blocks, kv_heads, head_dim, block_size] (transposed within a block, so attention scores
        # a vector of keys at a time), values [blocks, kv_heads, block_size, head_dim]; bfloat16 ones pair
        # neighbours within a block (kernels.kv_cache_from_blocks)
        heads, dim, dtype = self.shard.num_kv_heads, self.cfg.head_dim, dtype or self.dtype
        # empty, not zeros: attention reads no slot before a step has written it (tests/kernels pins that down
        # with a NaN-filled cache), and zeroing gigabytes took seconds of every start and made all of it resident
        return [(torch.empty(num_blocks, heads, dim, block_size, dtype=dtype),
                 torch.empty(num_blocks, heads, block_size, dim, dtype=dtype)) for _ in self.layers]

    def resident_bytes(self) -> int:
        tensors = {id(t): t for t in self.tensors()}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def linears(self) -> list:
        """Every layer's linear layers (their `weight`s are what the kernels run)."""
        return [lin for layer in self.layers for lin in (layer.attention.qkv, layer.attention.o, *layer.mlp.linears())]

    def tensors(self) -> list[torch.Tensor]:
        out = [s for t in (self.embed, self.norm, self.lm_head, self.cos_sin) if t is not None for s in storage(t)]
        for layer in self.layers:
            a = layer.attention
            out += a.qkv.tensors() + a.o.tensors() + layer.mlp.tensors()
            out += [layer.input_norm, layer.post_norm] + [t for t in (a.q_norm, a.k_norm) if t is not None]
        return out


def _parts(linear) -> list[tuple[torch.Tensor, int, int]]:
    """A packed linear's parts as the native stack takes them: (packed data, type id, rows) each."""
    return [(p.data, p.qtype, p.rows) for p in linear.weight.parts]


class _Weights:
    """Hands out each named tensor once, in the compute dtype (but a weight the loader kept as bfloat16 for the
    kernels to pack: loader.kept_bfloat16), and notices what was never used. Each leaves the mapping as it is
    taken: the checkpoint's copy is freed once the model has packed or fused it, so a file's blocks and their
    packed form are never all in memory at once (loading a 1.4 GiB Qwen3-MoE-shaped file: 3.5 GiB of anonymous
    memory at the peak when the model kept them all, 1.7 GiB now; AMD Zen 3)."""

    def __init__(self, weights: MutableMapping[str, Weight], dtype: torch.dtype):
        self.weights, self.dtype = weights, dtype

    def take(self, name: str) -> Weight:
        if name not in self.weights:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        weight = self.weights.pop(name)
        if not isinstance(weight, torch.Tensor):
            return weight  # quantized blocks
        if weight.dtype == torch.bfloat16 and weight.dim() == 2:
            return weight.contiguous()  # bfloat16 at any compute dtype: the kernels pack it
        return weight.to(self.dtype).contiguous()

    def check_all_used(self, ignore: set[str]) -> None:
        unused = sorted(set(self.weights) - ignore)
        if unused:
            raise ValueError(f"the checkpoint has tensors this architecture does not use: {', '.join(unused[:5])}"
                             + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))
