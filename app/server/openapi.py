"""/openapi.json, built from the same pydantic models that validate requests."""

from __future__ import annotations

import re
from functools import cache

from pydantic.json_schema import models_json_schema

from app.server import protocol as p

ENDPOINTS = [  # (method, path, summary, request model, response model)
    ("post", "/v1/completions", "Create a completion", p.CompletionRequest, p.CompletionResponse),
    ("post", "/v1/chat/completions", "Create a chat completion", p.ChatCompletionRequest, p.ChatCompletionResponse),
    ("post", "/v1/responses", "Create a response (OpenAI's Responses API)", p.ResponsesRequest, p.ResponseObject),
    ("get", "/v1/responses/{response_id}", "A stored response (server.responses_store)", None, p.ResponseObject),
    ("delete", "/v1/responses/{response_id}", "Drop a stored response", None, p.ResponseDeleted),
    ("post", "/v1/embeddings", "Create embeddings (the last token's final hidden state, L2-normalized)",
     p.EmbeddingRequest, p.EmbeddingResponse),
    *(("post", path, "Score text pairs: the cosine of their embeddings (vLLM's)", p.ScoreRequest, p.ScoreResponse)
      for path in ("/score", "/v1/score")),
    *(("post", path, "Rank documents by the cosine of their embeddings with a query (vLLM's, llama.cpp's)",
       p.RerankRequest, p.RerankResponse) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    ("get", "/v1/models", "List the served model", None, p.ModelList),
    ("get", "/v1/models/{model}", "The served model by its id (404 for any other)", None, p.ModelCard),
    ("post", "/tokenize", "Tokenize a prompt or a conversation", p.TokenizeRequest, p.TokenizeResponse),
    ("post", "/detokenize", "Turn token ids back into text", p.DetokenizeRequest, p.DetokenizeResponse),
    ("post", "/apply-template", "The conversation as the chat template renders it (llama.cpp's)",
     p.ApplyTemplateRequest, p.ApplyTemplateResponse),
    ("get", "/tokenizer_info", "The served tokenizer: class, special tokens, chat template (vLLM's)", None,
     p.TokenizerInfoResponse),
    ("get", "/props", "Context size, sampling defaults, slots and chat template (llama.cpp's)", None,
     p.PropsResponse),
]
INVOKED = [(p.ChatCompletionRequest, p.ChatCompletionResponse), (p.CompletionRequest, p.CompletionResponse),
           (p.EmbeddingRequest, p.EmbeddingResponse), (p.ScoreRequest, p.ScoreResponse),
           (p.RerankRequest, p.RerankResponse)]  # /invocations: any of these, told apart by their fields
PLAIN = [("/version", "The server's version"), ("/health", "200 when every engine is ready, else 503"),
         ("/ping", "/health under vLLM's other name (GET or POST)"),
         ("/load", "vLLM's: {\"server_load\": the requests this HTTP worker is answering}"),
         ("/metrics", "Prometheus metrics (vLLM's names)")]


@cache
def openapi_document(version: str) -> dict:
    models = [m for _, _, _, req, resp in ENDPOINTS for m in (req, resp) if m is not None] + [p.ErrorResponse]
    _, schemas = models_json_schema([(m, "validation") for m in models],
                                    ref_template="#/components/schemas/{model}")
    paths: dict = {}
    for method, path, summary, request, response in ENDPOINTS:
        operation = {"summary": summary, "responses": _responses(_ref(response), "response_id" in path)}
        if "{" in path:
            operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for name in re.findall(r"{(\w+)}", path)]
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
        paths.setdefault(path, {})[method] = operation
    paths["/invocations"] = {"post": {
        "summary": "vLLM's (SageMaker's) one route: a chat, completion, embedding, score or rerank request, told "
                   "apart by its fields (messages, prompt, input, text_1, data_1 or queries, documents)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "anyOf": [_ref(request) for request, _ in INVOKED]}}}},
        "responses": _responses({"anyOf": [_ref(response) for _, response in INVOKED]})}}
    for path, summary in PLAIN:
        operation = {"summary": summary, "responses": {"200": {"description": "OK"}, "503": _error("Not ready")}}
        paths[path] = {method: operation for method in (("get", "post") if path == "/ping" else ("get",))}
    return {"openapi": "3.1.0", "info": {"title": "CPU LLM appliance (OpenAI-compatible)", "version": version},
            "paths": paths, "components": {"schemas": schemas.get("$defs", {})}}


def _responses(answer: dict, by_id: bool = False) -> dict:
    return {"200": {"description": "OK", "content": {"application/json": {"schema": answer}}},
            "400": _error("Bad request"), "401": _error("Missing or wrong API key"),
            "404": _error("No response stored with this id" if by_id else "Unknown model"),
            "413": _error("Body too large"), "415": _error("Compressed body"), "429": _error("Waiting queue full"),
            "503": _error("Not ready")}


def _ref(model) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(p.ErrorResponse)}}}
