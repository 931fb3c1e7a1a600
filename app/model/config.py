"""The hyper-parameters of a Llama-family decoder, read from GGUF metadata or a HF config.json.

Llama 2/3, SmolLM2, TinyLlama and Mistral are the plain architecture; Qwen2 adds a bias to the
Q/K/V projections and Qwen3 an RMSNorm on each head of Q and K. Mixtral (a "llama" GGUF file with
experts) and Qwen3-MoE (Qwen3's attention) replace the MLP with a mixture of experts: a router picks
each token's top-k experts, SwiGLU MLPs of their own, and weighs their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> (GGUF architecture name, qkv_bias, qk_norm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "MixtralForCausalLM": ("llama", False, False),
    "Qwen3MoeForCausalLM": ("qwen3moe", False, True),
}
# (a "llama" file with experts is Mixtral's)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM"}


class UnsupportedModel(ValueError):
    """An architecture or tensor type this appliance does not run; the message lists what it does."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # "none", "llama3" or "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF name, a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rotary_dim: int | None = None  # None: the whole head
    # a mixture of experts (0 experts: every layer's MLP is dense)
    num_experts: int = 0
    experts_per_token: int = 0  # the top k a token is routed to
    expert_intermediate_size: int = 0  # each expert's MLP features
    norm_topk_prob: bool = True  # the k chosen weights rescaled to sum to 1 (Mixtral, Qwen3-MoE)
    dense_layers: frozenset[int] = frozenset()  # an MoE model's layers of a dense MLP (Qwen3-MoE's mlp_only_layers)

    def __post_init__(self):
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise UnsupportedModel(f"a mixture of {self.num_experts} experts that routes each token to "
                                   f"{self.experts_per_token} of them (1 to {self.num_experts} would do; the "
                                   "config's num_experts_per_tok, a GGUF file's expert_used_count)")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def qkv_bias(self) -> bool:
        return ARCHITECTURES[self.architecture][1]

    @property
    def qk_norm(self) -> bool:
        return ARCHITECTURES[self.architecture][2]


def _check_architecture(name: str) -> None:
    if name not in ARCHITECTURES:
        raise UnsupportedModel(f"architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}")


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    name = (cfg.get("architectures") or ["?"])[0]
    _check_architecture(name)
    heads = int(cfg["num_attention_heads"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)  # Qwen3-MoE: every step-th layer has experts
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = {i for i in range(layers) if i in only_mlp or (i + 1) % step}
    if experts and name not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        raise UnsupportedModel(f"{name} with {experts} experts is not supported; mixtures of experts supported: "
                               "MixtralForCausalLM, Qwen3MoeForCausalLM")
    return ModelConfig(
        architecture=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_parameters(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=_hf_rope_scaling(_rope_parameters(cfg)),
        num_experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        expert_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
        # Qwen3-MoE rescales where its config says so (transformers' default: not); Mixtral always does
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if name == "Qwen3MoeForCausalLM" else True,
        dense_layers=frozenset(dense) if experts else frozenset(),
    )


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes "rope_parameters"; older configs "rope_scaling" (and "rope_theta" beside it)."""
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _hf_rope_scaling(params: dict[str, Any]) -> RopeScaling:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "llama3":
        return RopeScaling("llama3", float(params["factor"]), float(params.get("low_freq_factor", 1.0)),
                           float(params.get("high_freq_factor", 4.0)),
                           int(params.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported; supported: default, llama3, linear")


def config_from_gguf(meta: dict[str, Any], vocab_size: int, has_output: bool) -> ModelConfig:
    arch = str(meta.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rot = meta.get(f"{arch}.rope.dimension_count")
    experts = int(meta.get(f"{arch}.expert_count", 0))
    if experts and arch not in ("llama", "qwen3moe"):
        raise UnsupportedModel(f"GGUF architecture {arch!r} with {experts} experts is not supported; mixtures of "
                               "experts supported: llama (Mixtral), qwen3moe")
    ffn = int(meta.get(f"{arch}.feed_forward_length", 0) if experts else meta[f"{arch}.feed_forward_length"])
    return ModelConfig(
        architecture="MixtralForCausalLM" if arch == "llama" and experts else GGUF_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings=not has_output,
        rope_scaling=_gguf_rope_scaling(meta, arch),
        rotary_dim=int(rot) if rot is not None and int(rot) != head_dim else None,
        num_experts=experts,
        experts_per_token=int(meta.get(f"{arch}.expert_used_count", 0)) if experts else 0,
        expert_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length", ffn)) if experts else 0,
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),  # llama.cpp: true for both
    )


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(meta[f"{arch}.rope.scaling.factor"]))
    raise UnsupportedModel(f"GGUF RoPE scaling {kind!r} is not supported; supported: none, linear "
                           "(Llama-3 scaling comes as the rope_freqs tensor)")
