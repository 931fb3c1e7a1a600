"""The Hugging Face directory loader: the GGUF converted to an HF folder by transformers gives the same model."""

from __future__ import annotations

import pytest
import torch

from app.model.loader import load_model
from app.model.source import resolve_source
from app.spec.schema import ModelSpec
from tests.model.test_parity import PROMPTS, Session, assert_follows


@pytest.fixture(scope="module")
def hf_dir(request):
    """transformers dequantizes the GGUF and saves config, tokenizer and float32 safetensors (cached)."""
    out = request.config.cache.mkdir("smollm2-135m-hf-fp32")
    if not (out / "model.safetensors").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        gguf = resolve_source(ModelSpec()).path
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
        model.config.quantization_config = None
        model.hf_quantizer = None
        model.save_pretrained(str(out))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def test_hf_directory_gives_the_same_outputs_as_the_gguf(hf_dir):
    source = resolve_source(ModelSpec(path=str(hf_dir)))
    assert source.format == "hf"
    from_hf = load_model(source, "float32")
    # both expanded to float32 at load, so the same GEMMs run (the kept-Q4_1 path is checked in test_parity)
    from_gguf = load_model(resolve_source(ModelSpec()), "float32", quantized="dequantize")
    assert from_hf.config == from_gguf.config  # same hyper-parameters through both readers
    ids = [from_gguf.tokenizer(p).input_ids for p in PROMPTS]
    assert [from_hf.tokenizer(p).input_ids for p in PROMPTS] == ids
    a = Session(from_hf.model, len(ids)).step(ids)
    b = Session(from_gguf.model, len(ids)).step(ids)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert from_hf.chat_template == from_gguf.chat_template


def test_sharded_safetensors_load_the_same(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    sharded = load_model(resolve_source(ModelSpec(path=str(tmp_path))), "float32", tokenizer=False)
    single = load_model(resolve_source(ModelSpec(path=str(hf_dir))), "float32", tokenizer=False)
    # the weights, not GEMM results: oneDNN may pick another path for the same weights at another address
    a, b = sharded.model.tensors(), single.model.tensors()
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_bfloat16_safetensors_under_float32_stay_bfloat16(hf_dir, tmp_path, caplog):
    """A directory of bfloat16 safetensors (how most Hugging Face models ship) served with dtype float32 (a CPU
    without native BF16): its linears, embedding and head stay bfloat16, packed, as a BF16 GGUF's do, and give the
    logits of the same directory expanded to float32 on torch (model.quantized: dequantize) up to float32 rounding,
    and its greedy tokens. The plan sizes them as they load: half the bytes."""
    from safetensors.torch import load_file, save_file

    from app.model.footprint import read_footprint
    from app.model.quant import PackedWeight

    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    source = resolve_source(ModelSpec(path=str(tmp_path)))
    with caplog.at_level("INFO", logger="app.model.loader"):
        ours = load_model(source, "float32", tokenizer=False).model
    assert "bfloat16 weights kept as bfloat16, multiplied in float32" in caplog.text
    first = ours.layers[0]
    for weight in (ours.embed, first.attention.qkv.weight, first.attention.o.weight, first.mlp.gate_up.weight,
                   first.mlp.down.weight):
        assert isinstance(weight, PackedWeight) and weight.type_name == "BF16"
    assert ours._native_stack(ours.new_kv_cache(16, 16)) is not None
    footprint = read_footprint(source)
    held = ours.resident_bytes() - ours.cos_sin.numel() * ours.cos_sin.element_size()
    assert held == footprint.weight_bytes("float32")
    expanded = load_model(source, "float32", tokenizer=False, quantized="dequantize").model
    assert isinstance(expanded.layers[0].attention.qkv.weight, torch.Tensor)
    full = expanded.resident_bytes() - expanded.cos_sin.numel() * expanded.cos_sin.element_size()
    assert full == footprint.dequantized().weight_bytes("float32") and held < 0.55 * full
    assert_follows(ours, expanded, [1, 9690, 314, 253, 1789, 2330, 30, 216])
