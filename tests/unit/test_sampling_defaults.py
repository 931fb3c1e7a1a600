"""The model's own sampling defaults (model.generation_config) as vLLM and llama.cpp read them, and the spec's
model.sampling_defaults over them."""

from __future__ import annotations

import json
import logging

import pytest

from app.bootstrap.startup import prepare
from app.model.generation_config import model_sampling_defaults
from app.model.source import ModelSource
from app.spec.schema import ModelSpec
from app.model.source import resolve_source

SMOLLM2 = resolve_source(ModelSpec()).path

# what llama.cpp's convert_hf_to_gguf.py writes from a generation_config.json, and keys of samplers not run here
GGUF_SAMPLING = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.95,
                 "general.sampling.min_p": 0.05, "general.sampling.penalty_repeat": 1.1,
                 "general.sampling.xtc_probability": 0.5, "general.sampling.mirostat": 2}


@pytest.fixture(scope="module")
def sampled_gguf(tmp_path_factory):
    from tests.gguf_files import copy_gguf

    path = tmp_path_factory.mktemp("sampling") / "sampled.gguf"
    copy_gguf(SMOLLM2, path, GGUF_SAMPLING)
    return path


def test_a_gguf_files_general_sampling_keys(sampled_gguf):
    found, where = model_sampling_defaults(ModelSource(sampled_gguf, "gguf", "m"))
    assert found == pytest.approx({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                                   "repetition_penalty": 1.1})
    assert isinstance(found["top_k"], int) and where == "GGUF general.sampling keys"
    assert model_sampling_defaults(ModelSource(SMOLLM2, "gguf", "m")) == ({}, "")  # the default model has none


def test_a_generation_config_json_as_vllm_reads_it(tmp_path, caplog):
    """vLLM's fields (max_new_tokens as max_tokens); do_sample, token ids and a value out of the API's range are
    not sampling defaults (the last with a warning); no file, or one that is not JSON, is no defaults."""
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
              "max_new_tokens": 512, "eos_token_id": [1, 2], "presence_penalty": 3.0, "transformers_version": "4.51"}
    source = ModelSource(tmp_path, "hf", "m")
    assert model_sampling_defaults(source) == ({}, "")
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        found, where = model_sampling_defaults(source)
    assert found == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 512}
    assert where == "generation_config.json" and "presence_penalty = 3.0 is outside" in caplog.text
    (tmp_path / "generation_config.json").write_text("{not json")
    assert model_sampling_defaults(source) == ({}, "")


def test_the_specs_defaults_go_over_the_models_and_none_turns_the_models_off(sampled_gguf):
    sets = [f"model.path={sampled_gguf}", "model.sampling_defaults.temperature=0.3",
            "model.sampling_defaults.max_tokens=64"]
    defaults, where = prepare(None, sets).sampling_defaults
    assert defaults == pytest.approx({"temperature": 0.3, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                                      "repetition_penalty": 1.1, "max_tokens": 64})
    assert where == "model.sampling_defaults over the model's GGUF general.sampling keys"
    assert prepare(None, [*sets, "model.generation_config=none"]).sampling_defaults == \
        ({"temperature": 0.3, "max_tokens": 64}, "model.sampling_defaults")
    assert prepare(None, [f"model.path={sampled_gguf}", "model.generation_config=none"]).sampling_defaults == \
        ({}, "")
