"""The sampling defaults a model ships with (model.generation_config: auto), as its peers read them: vLLM takes a
Hugging Face directory's generation_config.json, llama.cpp a GGUF file's `general.sampling.*` keys. Requests that
leave a field out get these; the spec's model.sampling_defaults go over them."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from app.model.source import ModelSource

log = logging.getLogger("app.model")

# generation_config.json's names of what a request can set (max_new_tokens: chat's default max_tokens), as vLLM's
# ModelConfig.get_diff_sampling_param lists them
HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}
# llama.cpp's general.sampling keys (llama_model_meta_key_str) that have a request field here; its others (the
# sampler sequence, XTC, mirostat, the repeat penalty's window) name samplers this server does not run
GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
               "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
               "general.sampling.penalty_repeat": "repetition_penalty"}
# each field's range, the API's (app/server/protocol.py SamplingFields): a value outside it is left out, with a warning
RANGES = {"temperature": (0, 2), "top_p": (1e-9, 1), "top_k": (-1, 1 << 20), "min_p": (0, 1),
          "repetition_penalty": (1e-9, 10), "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2),
          "max_tokens": (1, 1 << 30)}
INTEGERS = ("top_k", "max_tokens")


def model_sampling_defaults(source: ModelSource) -> tuple[dict[str, float | int], str]:
    """The model's sampling defaults and where they came from (for the log); ({}, "") where it has none. Never
    fails a start: a file that cannot be read, or a value out of range, is a warning."""
    try:
        if source.format == "gguf":
            from app.model.gguf_header import read_gguf_header

            found, where = _pick(read_gguf_header(source.path).metadata, GGUF_FIELDS), "GGUF general.sampling keys"
        else:
            path = Path(source.path) / "generation_config.json"
            if not path.is_file():
                return {}, ""
            config = json.loads(path.read_text(encoding="utf-8"))
            found, where = _pick(config if isinstance(config, dict) else {}, HF_FIELDS), "generation_config.json"
    except (OSError, ValueError) as exc:
        log.warning("could not read the model's sampling defaults from %s: %s", source.path, exc)
        return {}, ""
    return found, where if found else ""


def _pick(metadata: dict, names: dict[str, str]) -> dict[str, float | int]:
    picked = {}
    for key, field in names.items():
        value = metadata.get(key)
        if value is None:
            continue
        low, high = RANGES[field]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or not low <= value <= high or (field in INTEGERS and value != int(value)):
            log.warning("the model's sampling default %s = %r is outside %s's range (%g to %g): not used", key,
                        value, field, low, high)
            continue
        picked[field] = int(value) if field in INTEGERS else float(value)
    return picked
