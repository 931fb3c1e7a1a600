"""Every GGUF tensor type we support, in a small random Llama written here, against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.model.config import UnsupportedModel
from app.model.loader import load_model
from app.model.source import ModelSource
from tests.gguf_files import new_gguf, write_gguf
from tests.model.test_parity import Session, assert_follows

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 512, 512
# types gguf cannot quantize (random blocks): where their float16 scales sit, and the scale that keeps the
# weights small (IQ4_XS's scale codes reach 32, its codebook 127)
K_BLOCKS = {"Q2_K": ([80, 82], 2e-3), "Q3_K": ([108], 2e-3), "Q4_K": ([0, 2], 2e-3), "Q5_K": ([0, 2], 2e-3),
            "Q6_K": ([208], 2e-3), "IQ4_NL": ([0], 1e-3), "IQ4_XS": ([0], 3e-5), "IQ1_S": ([0], 1e-2),
            "IQ2_XXS": ([0], 1e-3), "IQ2_XS": ([0], 1e-3), "IQ2_S": ([0], 1e-3), "IQ3_XXS": ([0], 1e-3),
            "IQ3_S": ([0], 5e-4)}
LAYER_TYPES = [  # (q, k, v, o, gate, up, down) for each layer
    ("Q4_K", "Q5_K", "Q8_0", "Q4_0", "F16", "BF16", "Q6_K"),
    ("Q2_K", "Q3_K", "Q4_1", "Q5_0", "Q5_1", "F32", "Q8_0"),
    ("IQ4_XS", "IQ4_XS", "IQ4_NL", "IQ4_NL", "IQ4_XS", "Q3_K", "IQ4_XS"),
    ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_XS"),  # no kernel: dequantized at load
]
K_MIX_TYPES = [  # as llama.cpp's Q4_K_M and Q5_K_M files mix them (Q6_K for V and ffn_down in some layers)
    ("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"),
    ("Q5_K", "Q5_K", "Q5_K", "Q5_K", "Q5_K", "Q5_K", "Q5_0"),
]


def _tensor(rng: np.random.Generator, rows: int, cols: int, kind: str):
    import gguf

    qtype = gguf.GGMLQuantizationType[kind] if kind in gguf.GGMLQuantizationType.__members__ else None
    if kind in K_BLOCKS:  # gguf cannot quantize these: random blocks with small scales
        (per, size), (scale_offsets, scale) = gguf.GGML_QUANT_SIZES[qtype], K_BLOCKS[kind]
        blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
        for offset in scale_offsets:
            blocks[..., offset: offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
        return blocks.reshape(rows, -1), qtype
    values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if kind == "NORM":  # 1-D, near 1, as llama.cpp stores norm weights
        return 1 + values[0], None
    if kind == "F32":
        return values, None
    return gguf.quants.quantize(values, qtype), qtype


def write_tiny_llama(path, layer_types=LAYER_TYPES, embedding: str = "Q6_K", head: str = "Q4_K") -> None:
    rng = np.random.default_rng(0)
    w = new_gguf(path, "llama", layers=len(layer_types), hidden=HIDDEN, inter=INTER, heads=HEADS, kv_heads=KV_HEADS,
                 vocab=VOCAB)

    def add(name: str, rows: int, cols: int, kind: str) -> None:
        data, qtype = _tensor(rng, rows, cols, kind)
        w.add_tensor(name, data, raw_dtype=qtype) if qtype is not None else w.add_tensor(name, data)

    add("token_embd.weight", VOCAB, HIDDEN, embedding)
    add("output.weight", VOCAB, HIDDEN, head)  # untied head
    add("output_norm.weight", 1, HIDDEN, "NORM")
    d = HIDDEN // HEADS
    for i, types in enumerate(layer_types):
        shapes = [(HEADS * d, HIDDEN), (KV_HEADS * d, HIDDEN), (KV_HEADS * d, HIDDEN), (HIDDEN, HEADS * d),
                  (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
        names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
        for name, (rows, cols), kind in zip(names, shapes, types, strict=True):
            add(f"blk.{i}.{name}.weight", rows, cols, kind)
        add(f"blk.{i}.attn_norm.weight", 1, HIDDEN, "NORM")
        add(f"blk.{i}.ffn_norm.weight", 1, HIDDEN, "NORM")
    write_gguf(w)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(path)
    return path


def test_every_tensor_type_loads_like_transformers(tiny, caplog):
    from transformers import AutoModelForCausalLM, GgufConfig

    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny.parent), gguf_file=tiny.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=tiny.name, dequantize=True)).eval()
    with caplog.at_level("INFO", logger="app.model.loader"):
        ours = load_model(ModelSource(tiny, "gguf", "tiny"), "float32", tokenizer=False)
    assert not ours.config.tie_word_embeddings and ours.config.num_kv_heads == KV_HEADS
    third = ours.model.layers[2]  # the IQ4 types kept as stored, beside Q3_K
    assert [w.type_name for w in (third.attention.qkv.weight, third.attention.o.weight, third.mlp.gate_up.weight,
                                  third.mlp.down.weight)] == ["IQ4_XS+IQ4_NL", "IQ4_NL", "IQ4_XS+Q3_K", "IQ4_XS"]
    assert "dequantized to float32 at load: IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS (" in caplog.text
    assert ours.model.layers[1].attention.qkv.weight.type_name == "Q2_K+Q3_K+Q4_1"  # Q2_K kept
    assert isinstance(ours.model.layers[3].attention.qkv.weight, torch.Tensor)  # no kernel: float32
    ids = [[5, 17, 300, 2, 511, 64, 9]]
    with torch.inference_mode():
        expected = reference(torch.tensor(ids)).logits[0, -1]
    got = Session(ours.model, 1).step(ids)[0]
    assert (got - expected).abs().max().item() < 1e-3 * max(1.0, expected.abs().max().item())


@pytest.fixture(scope="module")
def k_mix(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-k-mix.gguf"
    write_tiny_llama(path, K_MIX_TYPES, embedding="Q4_K", head="Q6_K")
    return path


def test_k_quants_stay_quantized_and_load_like_transformers(k_mix, caplog):
    """A Q4_K_M-like file: every linear kept in its blocks (the layer stack runs them natively), logits as
    transformers' from the dequantized file."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from app.model.quant import Packed, PackedParts

    reference = AutoModelForCausalLM.from_pretrained(
        str(k_mix.parent), gguf_file=k_mix.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=k_mix.name, dequantize=True)).eval()
    with caplog.at_level("INFO", logger="app.model.loader"):
        ours = load_model(ModelSource(k_mix, "gguf", "tiny"), "float32", tokenizer=False)
    assert "kept quantized: Q4_K, Q5_0, Q5_K, Q6_K" in caplog.text and "dequantized" not in caplog.text
    layers = ours.model.layers
    kinds = [(lay.attention.qkv.weight, lay.attention.o.weight, lay.mlp.gate_up.weight, lay.mlp.down.weight)
             for lay in layers]
    assert all(isinstance(w, Packed) for group in kinds for w in group)
    assert [w.type_name for w in kinds[0]] == ["Q4_K+Q6_K", "Q4_K", "Q4_K", "Q6_K"]  # QKV mixed: Q and K, then V
    assert isinstance(kinds[0][0], PackedParts) and [p.rows for p in kinds[0][0].parts] == [HIDDEN + HIDDEN // 2, HIDDEN // 2]
    assert ours.model._native_stack(ours.model.new_kv_cache(16, 16)) is not None  # the layer stack runs the parts
    assert [w.type_name for w in kinds[1]] == ["Q5_K", "Q5_K", "Q5_K", "Q5_0"]
    assert ours.model.lm_head.type_name == "Q6_K" and ours.model.embed.type_name == "Q4_K"
    ids = [[5, 17, 300, 2, 511, 64, 9]]
    with torch.inference_mode():
        expected = reference(torch.tensor(ids)).logits[0, -1]
    got = Session(ours.model, 1).step(ids)[0]
    assert (got - expected).abs().max().item() < 1e-3 * max(1.0, expected.abs().max().item())
    # the plan sizes the weights as they load (the QKV of mixed types in its parts included)
    from app.model.footprint import read_footprint

    held = ours.model.resident_bytes() - ours.model.cos_sin.numel() * ours.model.cos_sin.element_size()
    assert held == read_footprint(ModelSource(k_mix, "gguf", "tiny")).weight_bytes("float32")


def test_the_plan_sizes_k_quant_shards_cut_off_their_superblocks(k_mix):
    """At tp=2 each rank's attn_output holds 128 of 256 input features: its Q4_K superblocks are cut, so
    that shard loads as Q4_M32 (6 bits a weight, not 4.6); the plan counts it so."""
    from app.model.footprint import read_footprint

    source = ModelSource(k_mix, "gguf", "tiny")
    footprint = read_footprint(source)
    assert footprint.cut_bytes is not None and footprint.cut_bytes.attention_q > 0
    for rank in range(2):
        loaded = load_model(source, "float32", tokenizer=False, rank=rank, size=2).model
        assert loaded.layers[0].attention.o.weight.type_name == "Q4_M32"
        held = loaded.resident_bytes() - loaded.cos_sin.numel() * loaded.cos_sin.element_size()
        assert held == footprint.weight_bytes("float32", 2, rank), rank


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    write_gguf(w)
    with pytest.raises(UnsupportedModel, match="'falcon' is not supported; supported: llama, qwen2, qwen3"):
        load_model(ModelSource(tmp_path / "m.gguf", "gguf", "m"), "float32", tokenizer=False)


def test_unsupported_tensor_type_lists_the_supported_ones(tiny, tmp_path):
    import gguf

    reader = gguf.GGUFReader(str(tiny))
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    for key in ("llama.block_count", "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count"):
        w.add_uint32(key, int(reader.fields[key].contents()))
    w.add_tensor("token_embd.weight", np.zeros((4, 54), np.uint8), raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    write_gguf(w)
    with pytest.raises(UnsupportedModel, match="TQ1_0 are not supported; supported: F32, F16, BF16, Q8_0"):
        load_model(ModelSource(tmp_path / "iq.gguf", "gguf", "m"), "float32", tokenizer=False)


def test_a_bf16_file_under_float32_keeps_its_weights_bfloat16(tmp_path, caplog):
    """A BF16 GGUF served with dtype float32 (a CPU without native BF16): its linears, embedding and head stay
    bfloat16, packed (half the bytes of float32, the native layer stack), and multiply float32 x by their exactly
    widened values: the logits of the same file expanded to float32 on torch (model.quantized: dequantize) up to
    float32 rounding, and the same greedy tokens. The plan sizes it as it loads. The tiny file's gate (F16) beside
    its up projection (BF16) stays the float32 weight it was (their fused projection is expanded)."""
    from app.model.footprint import read_footprint
    from app.model.quant import PackedWeight
    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec
    from tests.gguf_files import requantize_gguf

    path = tmp_path / "bf16.gguf"
    requantize_gguf(resolve_source(ModelSpec()).path, path, lambda name, columns: "BF16")
    source = ModelSource(path, "gguf", "bf16")
    with caplog.at_level("INFO", logger="app.model.loader"):
        ours = load_model(source, "float32", tokenizer=False)
    assert "BF16 weights kept as bfloat16, multiplied in float32" in caplog.text
    model = ours.model
    first = model.layers[0]
    for weight in (model.embed, model.lm_head, first.attention.qkv.weight, first.attention.o.weight,
                   first.mlp.gate_up.weight, first.mlp.down.weight):
        assert isinstance(weight, PackedWeight) and weight.type_name == "BF16"
    assert model._native_stack(model.new_kv_cache(16, 16)) is not None
    held = model.resident_bytes() - model.cos_sin.numel() * model.cos_sin.element_size()
    assert held == read_footprint(source).weight_bytes("float32")
    expanded = load_model(source, "float32", tokenizer=False, quantized="dequantize").model
    assert isinstance(expanded.layers[0].attention.qkv.weight, torch.Tensor)
    assert held < 0.55 * (expanded.resident_bytes() - expanded.cos_sin.numel() * expanded.cos_sin.element_size())
    assert_follows(model, expanded, [1, 9690, 314, 253, 1789, 2330, 30, 216])


def test_a_fused_projection_of_bf16_and_other_parts_stays_float32(tiny):
    """LAYER_TYPES' first layer: F16 gate beside BF16 up: one float32 weight, sized so by the plan."""
    from app.model.footprint import read_footprint

    ours = load_model(ModelSource(tiny, "gguf", "tiny"), "float32", tokenizer=False).model
    gate_up = ours.layers[0].mlp.gate_up.weight
    assert isinstance(gate_up, torch.Tensor) and gate_up.dtype == torch.float32
    held = ours.resident_bytes() - ours.cos_sin.numel() * ours.cos_sin.element_size()
    assert held == read_footprint(ModelSource(tiny, "gguf", "tiny")).weight_bytes("float32")
