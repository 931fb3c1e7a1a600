"""SmolLM2-135M-Instruct requantized as llama.cpp's Q4_K_M files mix types (and some ffn_down as Q3_K, as
Q3_K_M files hold it, some MLPs as IQ4_XS files do), through our model against transformers loading the same
file.

The K-quants stay quantized (Q3_K to Q6_K and IQ4_XS in their superblocks, IQ4_NL, Q5_0, Q5_1 and Q8_0 as
they are, a fused QKV of mixed types in its parts), so float32 activations must give transformers' own greedy
tokens, and the default int16 activations stay as close to them as they do on the Q4_1 file
(tests/model/test_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from app.model.loader import load_model
from app.model.quant import Packed
from app.model.source import ModelSource, resolve_source
from app.spec.schema import ModelSpec
from tests.gguf_files import requantize_gguf
from tests.model.test_parity import PROMPTS, STEPS, Session, reference_greedy


# llama.cpp's, for rows not a multiple of 256
FALLBACK = {"Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def q4_k_m(name: str, columns: int) -> str:
    """Q4_K, with more bits for V and ffn_down in some layers (Q6_K every third, Q5_K the next) and for the
    (tied) embeddings, as llama.cpp's Q4_K_M gives them to the tensors that matter most, and ffn_down as Q3_K
    every fourth layer, gate/up every fifth and ffn_down every eighth as IQ4_XS; and as llama.cpp does,
    K-quants fall back to Q5_0/Q5_1/Q8_0/IQ4_NL where a row is not a multiple of 256 (SmolLM2's 576)."""
    if name == "token_embd.weight":
        kind = "Q6_K"
    elif name.endswith("attn_v.weight"):
        kind = ("Q6_K", "Q5_K", "Q4_K")[int(name.split(".")[1]) % 3]
    elif name.endswith(("ffn_gate.weight", "ffn_up.weight")) and int(name.split(".")[1]) % 5 == 4:
        kind = "IQ4_XS"
    elif name.endswith("ffn_down.weight"):
        layer = int(name.split(".")[1])
        kind = "Q3_K" if layer % 4 == 3 else "IQ4_XS" if layer % 8 == 5 else ("Q6_K", "Q5_K", "Q4_K")[layer % 3]
    else:
        kind = "Q4_K"
    return kind if columns % 256 == 0 else FALLBACK[kind]


@pytest.fixture(scope="module")
def k_file(tmp_path_factory):
    source = resolve_source(ModelSpec())
    path = tmp_path_factory.mktemp("k-quants") / "SmolLM2-135M-Instruct.Q4_K_M-like.gguf"
    requantize_gguf(source.path, path, q4_k_m)
    return ModelSource(path, "gguf", "smollm2-k")


@pytest.fixture(scope="module")
def reference_runs(k_file):
    from transformers import AutoModelForCausalLM, GgufConfig

    path = k_file.path
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True)).eval()
    return model


@pytest.fixture(scope="module")
def prompt_ids():
    from app.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_source(ModelSpec()))
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def runs(reference_runs, prompt_ids):
    return [reference_greedy(reference_runs, ids, STEPS) for ids in prompt_ids]


def test_k_quants_are_kept(k_file, caplog):
    with caplog.at_level("INFO", logger="app.model.loader"):
        ours = load_model(k_file, "float32", tokenizer=False)
    assert "kept quantized: IQ4_NL, IQ4_XS, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0" in caplog.text and "dequantized" not in caplog.text
    assert "converted" not in caplog.text  # every type as the file stores it
    assert "20 fused projection(s) of mixed types run as their parts" in caplog.text  # QKV where V is not Q5_0
    layers = ours.model.layers
    assert all(isinstance(lin.weight, Packed) for lay in layers
               for lin in (lay.attention.qkv, lay.attention.o, lay.mlp.gate_up, lay.mlp.down))
    # 576 columns: Q and K Q5_0, V Q8_0, Q5_1 or Q5_0 -> parts where they differ; 1536 columns: K-quants
    assert [lay.attention.qkv.weight.type_name for lay in layers[:3]] == ["Q5_0+Q8_0", "Q5_0+Q5_1", "Q5_0"]
    downs = ["Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q5_K", "IQ4_XS"]
    assert [lay.mlp.down.weight.type_name for lay in layers[:6]] == downs
    assert layers[4].mlp.gate_up.weight.type_name == "IQ4_NL"  # 576 columns: IQ4_XS falls back
    assert ours.model.embed.type_name == "Q8_0"
    assert ours.model.resident_bytes() < 0.6 * 134_515_008 * 2  # well under bfloat16's


def test_float_activations_give_transformers_greedy_tokens(k_file, prompt_ids, runs):
    ours = load_model(k_file, "float32", tokenizer=False, activations="float")
    logits = Session(ours.model, len(prompt_ids)).step(prompt_ids)
    for row, (expected, _) in zip(logits, runs, strict=True):
        assert (row - expected).abs().max().item() < 1e-3
    generated = Session(ours.model, len(prompt_ids)).greedy(prompt_ids, STEPS)
    for mine, (_, expected) in zip(generated, runs, strict=True):
        assert mine == expected


def test_int16_activations_stay_within_reach_of_transformers(k_file, prompt_ids, runs):
    ours = load_model(k_file, "float32", tokenizer=False)
    logits = Session(ours.model, len(prompt_ids)).step(prompt_ids)
    for row, (expected, _) in zip(logits, runs, strict=True):
        assert (row - expected).abs().max().item() < 2e-2
    generated = Session(ours.model, len(prompt_ids)).greedy(prompt_ids, 16)
    for mine, (_, expected) in zip(generated, runs, strict=True):
        assert mine == expected[:16]
