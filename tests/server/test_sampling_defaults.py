"""Served: a model file's sampling defaults (llama.cpp's general.sampling keys) and the spec's over them answer the
requests that leave those fields out, and only those."""

from __future__ import annotations

import httpx

from app.model.source import resolve_source
from app.spec.schema import ModelSpec
from tests.gguf_files import copy_gguf
from tests.server.conftest import BASE_SPEC, Appliance


def test_requests_that_leave_sampling_out_get_the_models_and_the_specs_defaults(tmp_path):
    path = tmp_path / "greedy.gguf"  # the file says: greedy
    copy_gguf(resolve_source(ModelSpec()).path, path, {"general.sampling.temp": 0.0, "general.sampling.top_k": 40})
    app = Appliance(tmp_path, BASE_SPEC, (f"model.path={path}", "model.sampling_defaults.max_tokens=6")).wait_ready()
    try:
        chat = app.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Name three colours."}], "ignore_eos": True}
        left_out = httpx.post(chat, json={**body, "n": 3}, timeout=60).json()
        greedy = httpx.post(chat, json={**body, "temperature": 0}, timeout=60).json()
        texts = {c["message"]["content"] for c in left_out["choices"]}
        assert texts == {greedy["choices"][0]["message"]["content"]}  # the file's temperature 0: greedy
        assert left_out["usage"]["completion_tokens"] == 3 * 6 and left_out["choices"][0]["finish_reason"] == "length"
        sampled = httpx.post(chat, json={**body, "n": 4, "temperature": 1.5, "seed": 7, "max_tokens": 12},
                             timeout=60).json()
        assert len({c["message"]["content"] for c in sampled["choices"]}) > 1  # the request's own win
        assert sampled["usage"]["completion_tokens"] == 4 * 12
        response = httpx.post(app.url + "/v1/responses", json={"input": "Name three colours."}, timeout=60).json()
        assert (response["temperature"], response["top_p"], response["max_output_tokens"]) == (0.0, 1.0, 6)
        assert response["usage"]["output_tokens"] <= 6  # (what the response reports is what ran)
        own = httpx.post(app.url + "/v1/responses", json={"input": "Hi", "temperature": 0.7, "max_output_tokens": 2},
                         timeout=60).json()
        assert (own["temperature"], own["max_output_tokens"]) == (0.7, 2)
        completion = httpx.post(app.url + "/v1/completions", json={"prompt": "Once upon", "ignore_eos": True},
                                timeout=60).json()
        assert completion["usage"]["completion_tokens"] == 16  # a completion's own default (OpenAI's, vLLM's)
        assert "sampling: requests that leave them out get temperature 0, top_k 40, max_tokens 6 " \
               "(model.sampling_defaults over the model's GGUF general.sampling keys" in app.logs()
    finally:
        app.stop()
