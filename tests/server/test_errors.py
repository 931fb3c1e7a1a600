"""Bad requests get OpenAI-shaped errors with the right status, and never disturb the server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import BASE_SPEC, Appliance

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
LONG = "word " * 9000  # far past the 8192-token context

# (id, method, path, body (dict, or bytes sent as is), status, error code or None, text the message must contain)
CASES = [
    ("not-json", "POST", C, b"{not json", 400, "invalid_json", "not valid JSON"),
    ("not-an-object", "POST", C, b"[1, 2]", 400, "invalid_json", "JSON object"),
    ("missing-prompt", "POST", C, {"max_tokens": 2}, 400, "invalid_value", "prompt"),
    ("missing-messages", "POST", CHAT, {"max_tokens": 2}, 400, "invalid_value", "messages"),
    ("empty-messages", "POST", CHAT, {"messages": []}, 400, "invalid_value", "messages"),
    ("temperature-negative", "POST", C, {"prompt": "x", "temperature": -1}, 400, "invalid_value", "temperature"),
    ("temperature-too-high", "POST", C, {"prompt": "x", "temperature": 3}, 400, "invalid_value", "temperature"),
    ("top-p-zero", "POST", C, {"prompt": "x", "top_p": 0}, 400, "invalid_value", "top_p"),
    ("n-zero", "POST", C, {"prompt": "x", "n": 0}, 400, "invalid_value", "n"),
    ("max-tokens-zero", "POST", C, {"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("max-tokens-past-context", "POST", C, {"prompt": "x", "max_tokens": 100000}, 400, "context_length_exceeded",
     "max_tokens=100000 cannot be greater than this model's maximum context length (8192 tokens)"),
    ("prompt-past-context", "POST", C, {"prompt": LONG, "max_tokens": 1}, 400, "context_length_exceeded",
     "leaves no room for the completion"),
    ("chat-past-context", "POST", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400,
     "context_length_exceeded", "8192"),
    ("unknown-model", "POST", C, {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found", "`gpt-9` does not exist"),
    ("unknown-route", "GET", "/v1/nothing", None, 404, "not_found", "no such route"),
    ("wrong-method", "GET", C, None, 405, "method_not_allowed", "Method Not Allowed"),
    ("body-too-large", "POST", C, b"{" + b" " * (5 << 20) + b"}", 413, "body_too_large", "larger than"),
    ("logprobs-too-many", "POST", C, {"prompt": "x", "logprobs": 30}, 400, "invalid_value", "logprobs"),
    ("top-logprobs-alone", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "invalid_value",
     "top_logprobs needs logprobs"),
    ("logit-bias-past-100", "POST", C, {"prompt": "x", "logit_bias": {"42": 150}}, 400, "invalid_value", "logit_bias"),
    ("logit-bias-not-an-id", "POST", C, {"prompt": "x", "logit_bias": {"hi": 1}}, 400, "invalid_value", "token ids"),
    ("logit-bias-outside-vocab", "POST", C, {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "invalid_value",
     "outside the vocabulary"),
    ("logit-bias-id-twice", "POST", CHAT, {"messages": MSG, "logit_bias": {"42": 1, "042": 2}}, 400, "invalid_value",
     "twice"),
    ("continue-and-new-prompt", "POST", CHAT, {"messages": MSG, "continue_final_message": True}, 400,
     "invalid_value", "set add_generation_prompt to false"),
    ("template-kwargs-own", "POST", CHAT, {"messages": MSG, "chat_template_kwargs": {"tools": []}}, 400,
     "invalid_value", "may not set 'tools'"),
    ("request-chat-template", "POST", CHAT, {"messages": MSG, "chat_template": "{{ messages }}"}, 400,
     "invalid_value", "--trust-request-chat-template"),
    ("documents-unread", "POST", CHAT, {"messages": MSG, "documents": [{"title": "t", "text": "x"}]}, 400,
     "invalid_value", "does not render documents"),
    ("tool-without-function", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "invalid_value",
     "tools.0.function"),
    ("tool-choice-without-tools", "POST", CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "invalid_value",
     "tool_choice needs tools"),
    ("tool-choice-unknown", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "invalid_value", "not among tools"),
    ("tool-schema-not-a-schema", "POST", CHAT, {"messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "g", "parameters": {"properties": {"a": {"type": "nonsense"}}}}}]},
     400, "invalid_value", "tools.1.function.parameters: this JSON schema cannot constrain the output"),
    ("tool-arguments-not-an-object", "POST", CHAT, {"messages": MSG, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400, "invalid_value",
     "a function's arguments are a JSON object"),
    ("tool-schema-nested-too-deep", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"type":"object","properties":{"a":' * 300 + '{}' + '}}' * 300)}}]},
     400, "invalid_value", "nests deeper than 64 levels"),
    ("tool-history-nested-too-deep", "POST", CHAT, {"messages": [{"role": "assistant", "tool_calls": [{
        "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]}, 400,
     "invalid_value", "nested too deep"),
    ("tool-name-bad", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     400, "invalid_value", "tools.0.function.name"),
    ("schema-not-a-schema", "POST", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "invalid_value",
     "this JSON schema cannot constrain the output"),
    ("json-schema-without-schema", "POST", C, {"prompt": "x", "response_format": {"type": "json_schema"}}, 400,
     "invalid_value", "needs json_schema"),
    ("regex-unclosed", "POST", C, {"prompt": "x", "structured_outputs": {"regex": "(a"}}, 400, "invalid_value",
     "this regex cannot constrain the output"),
    ("grammar-not-lark", "POST", C, {"prompt": "x", "structured_outputs": {"grammar": "start: ???"}}, 400,
     "invalid_value", "this grammar cannot constrain the output"),
    ("json-not-json", "POST", C, {"prompt": "x", "structured_outputs": {"json": "{not json"}}, 400, "invalid_value",
     "structured_outputs"),
    ("two-constraints", "POST", C, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "invalid_value", "exactly one of"),
    ("regex-too-long", "POST", C, {"prompt": "x", "structured_outputs": {"regex": "a" * 70_000}}, 400,
     "invalid_value", "at most 65536 characters"),
    ("choices-too-long", "POST", C, {"prompt": "x", "structured_outputs": {"choice": ["a" * 40_000, "b" * 40_000]}},
     400, "invalid_value", "65536 characters in all"),
    ("schema-too-long", "POST", CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["x" * 70_000]}}}}, 400, "invalid_value", "up to 65536 characters"),
    ("guided-json", "POST", C, {"prompt": "x", "guided_json": {"type": "object"}}, 400, "invalid_value",
     "use structured_outputs"),
    ("both-fields", "POST", CHAT, {"messages": MSG, "response_format": {"type": "json_object"},
                                   "structured_outputs": {"regex": "a"}}, 400, "invalid_value", "not both"),
    ("bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", "role"),
    ("image-content", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                                  "image_url": {"url": "x"}}]}]},
     400, "invalid_value", "messages.0.content: part 0 is of type 'image_url': this model reads text only"),
    ("unknown-content-part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                       {"type": "sparkle"}]}]},
     400, "invalid_value", "part 1 must be an object of type 'text', not 'sparkle'"),
    ("text-part-without-text", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "invalid_value", "part 0 (of type 'text') must have its text"),
    ("responses-audio-part", "POST", "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, 400, "invalid_value",
     "of type 'input_audio': this model reads text only"),
    ("responses-reasoning-only", "POST", "/v1/responses", {"input": [{"type": "reasoning", "summary": []}]}, 400,
     "invalid_value", "holds no message"),
    ("too-many-stops", "POST", C, {"prompt": "x", "stop": [str(i) for i in range(20)]}, 400, "invalid_value", "stop"),
    ("empty-stop", "POST", C, {"prompt": "x", "stop": [""]}, 400, "invalid_value", "stop"),
    ("token-outside-vocab", "POST", C, {"prompt": [1, 2, 999999]}, 400, "invalid_value", "outside the vocabulary"),
    ("empty-prompt-string", "POST", C, {"prompt": ""}, 400, "empty_prompt", "empty"),
    ("empty-prompt-list", "POST", C, {"prompt": []}, 400, "invalid_value", "prompt"),
    ("presence-penalty", "POST", C, {"prompt": "x", "presence_penalty": 5}, 400, "invalid_value", "presence_penalty"),
    ("best-of", "POST", C, {"prompt": "x", "best_of": 3}, 400, "invalid_value", "best_of"),
    ("prompt-logprobs-streamed", "POST", CHAT, {"messages": MSG, "stream": True, "prompt_logprobs": 1}, 400,
     "invalid_value", "prompt_logprobs"),
    ("prompt-logprobs-21", "POST", C, {"prompt": "x", "prompt_logprobs": 21}, 400, "invalid_value", "prompt_logprobs"),
    ("responses-empty-input", "POST", "/v1/responses", {"input": []}, 400, "invalid_value", "input"),
    ("responses-n", "POST", "/v1/responses", {"input": "x", "n": 2}, 400, "invalid_value", "n"),
    ("legacy-functions", "POST", CHAT, {"messages": MSG, "functions": [{"name": "f", "parameters": {}}]}, 400,
     "invalid_value", "functions"),
    ("tokenize-no-messages", "POST", "/tokenize", {"messages": []}, 400, "invalid_value", "messages"),
    ("responses-max-tokens", "POST", "/v1/responses", {"input": "x", "max_tokens": 5}, 400, "invalid_value",
     "max_tokens"),
    ("responses-guided-json", "POST", "/v1/responses", {"input": "x", "guided_json": {}}, 400, "invalid_value",
     "guided_json"),
    ("responses-bad-stop", "POST", "/v1/responses", {"input": "x", "stop": 7}, 400, "invalid_value", "stop"),
    ("responses-previous-id", "POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400,
     "invalid_value", "previous_response_id"),
    ("responses-background", "POST", "/v1/responses", {"input": "x", "background": True}, 400, "invalid_value",
     "background"),
    ("responses-conversation", "POST", "/v1/responses", {"input": "x", "conversation": "conv_1"}, 400,
     "invalid_value", "conversation"),
    ("responses-schema-missing", "POST", "/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema",
                                                                                             "name": "x"}}}, 400,
     "invalid_value", "schema"),
    ("responses-call-not-json", "POST", "/v1/responses", {"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400, "invalid_value", "JSON"),
    ("responses-unknown-function", "POST", "/v1/responses", {"input": "x", "tools": [
        {"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, 400, "invalid_value",
     "tool_choice"),
    ("regex-too-big-to-run", "POST", "/v1/completions", {"prompt": "x", "structured_outputs": {
        "regex": "a{1000000}"}}, 400, "invalid_value",  # llguidance's limit, or first (a slow CPU) the trial's budget
     ("too many expressions", "too complex a grammar to serve")),
    ("schema-without-end", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "response_format": {"type": "json_schema", "json_schema": {
                                                                "name": "t", "schema": {"type": "array",
                                                                                       "items": {"$ref": "#"},
                                                                                       "minItems": 1}}}},
     400, "invalid_value", "Too many items"),
    ("responses-include-unknown", "POST", "/v1/responses", {"input": "x", "include": ["everything"]}, 400,
     "invalid_value", "include"),
    ("responses-truncation", "POST", "/v1/responses", {"input": "x", "truncation": "bogus"}, 400, "invalid_value",
     "truncation"),
    ("negative-token-id", "POST", "/v1/completions", {"prompt": [5, -1]}, 400, "invalid_value", "token id -1"),
    ("token-id-past-int32", "POST", "/v1/completions", {"prompt": [[5], [2147483648]]}, 400, "invalid_value",
     "token id 2147483648"),
    ("embeddings-negative-id", "POST", "/v1/embeddings", {"input": [-3]}, 400, "invalid_value", "token id -3"),
    ("embeddings-empty-input", "POST", "/v1/embeddings", {"input": []}, 400, "invalid_value", "input"),
    ("embeddings-empty-text", "POST", "/v1/embeddings", {"input": ""}, 400, "empty_prompt", "empty"),
    ("embeddings-dimensions", "POST", "/v1/embeddings", {"input": "x", "dimensions": 64}, 400, "invalid_value",
     "dimensions"),
    ("embeddings-outside-vocab", "POST", "/v1/embeddings", {"input": [[1, 999999]]}, 400, "invalid_value",
     "outside the vocabulary"),
    ("embeddings-format", "POST", "/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "invalid_value",
     "encoding_format"),
    ("embeddings-wrong-model", "POST", "/v1/embeddings", {"input": "x", "model": "other"}, 404, "model_not_found",
     "other"),
    # found by an attack: booleans were taken as token ids, and every wrong shape was "a valid string"
    ("embeddings-booleans", "POST", "/v1/embeddings", {"input": [True, False]}, 400, "invalid_value",
     "a list of token ids (integers)"),
    ("embeddings-mixed", "POST", "/v1/embeddings", {"input": ["a", 1]}, 400, "invalid_value", "input must be a string"),
    ("completion-boolean-ids", "POST", C, {"prompt": [True, False]}, 400, "invalid_value",
     "prompt must be a string, a list of strings, a list of token ids"),
    ("completion-float-ids", "POST", C, {"prompt": [[1.0]]}, 400, "invalid_value", "a list of such lists"),
    ("echo-max-tokens-zero-min-tokens", "POST", C, {"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 2},
     400, "invalid_value", "min_tokens"),
    ("suffix", "POST", C, {"prompt": "x", "suffix": "y"}, 400, "invalid_value", "suffix"),
    ("seed-string", "POST", C, {"prompt": "x", "seed": "abc"}, 400, "invalid_value", "seed"),
    ("min-p", "POST", C, {"prompt": "x", "min_p": 2}, 400, "invalid_value", "min_p"),
    ("max-completion-tokens", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "invalid_value",
     "max_completion_tokens"),
    ("tokenize-both", "POST", "/tokenize", {"prompt": "x", "messages": MSG}, 400, "invalid_value", "exactly one"),
    ("detokenize-outside", "POST", "/detokenize", {"tokens": [999999]}, 400, "invalid_value", "outside the vocabulary"),
    ("tokenize-wrong-model", "POST", "/tokenize", {"model": "other", "prompt": "x"}, 404, "model_not_found", "other"),
    # found in review: each once crashed the engine, gave a 500 or lost its field name
    ("stop-token-outside-vocab", "POST", C, {"prompt": "x", "min_tokens": 1, "stop_token_ids": [50000]}, 400,
     "invalid_value", "outside the vocabulary"),
    ("huge-top-k", "POST", C, {"prompt": "x", "top_k": 10**30}, 400, "invalid_value", "top_k"),
    ("huge-min-tokens", "POST", C, {"prompt": "x", "min_tokens": 10**30}, 400, "invalid_value", "min_tokens"),
    ("stream-not-bool", "POST", C, {"prompt": "x", "stream": "maybe"}, 400, "invalid_value", "stream"),
    ("min-over-max-tokens", "POST", C, {"prompt": "x", "min_tokens": 10, "max_tokens": 5}, 400, "invalid_value",
     "min_tokens must be <= max_tokens"),
    ("too-many-sequences", "POST", C, {"prompt": ["a", "b", "c", "d", "e"], "n": 16}, 400, "invalid_value",
     "more than 64"),
    # found by the attack from outside: each was a 500
    ("nested-100000-deep", "POST", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json",
     "nested too deeply"),
    ("nested-500-deep", "POST", C, b'{"prompt": "x", "seed": ' + b"[" * 500 + b"]" * 500 + b"}", 400, "invalid_value", "seed"),
    ("int-of-10000-digits", "POST", C, b'{"prompt": "x", "seed": ' + b"9" * 10_000 + b"}", 400, "invalid_json",
     "an integer of over 4,300 digits"),
    ("lone-surrogate-escape", "POST", C, b'{"prompt": "\\ud800"}', 400, "invalid_json", "prompt: a string holds a lone"),
    ("lone-surrogate-in-chat", "POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400,
     "invalid_json", "messages.0.content"),
    ("lone-surrogate-raw-bytes", "POST", C, b'{"prompt": "\xed\xa0\x80"}', 400, "invalid_json", "not"),
    ("lone-surrogate-in-key", "POST", C, b'{"prompt": "x", "\\ud800": 1}', 400, "invalid_json", "surrogate"),
    ("lone-surrogate-tokenize", "POST", "/tokenize", b'{"prompt": "\\ud800"}', 400, "invalid_json", "surrogate"),
    ("text-far-past-context", "POST", C, {"prompt": "x" * 3_000_000}, 400, "context_length_exceeded",
     "3000000 characters"),
    ("tokenize-far-past-context", "POST", "/tokenize", {"prompt": "x" * 3_000_000}, 400, "context_length_exceeded",
     "characters"),
    # found by the second attack: 490,000 stop ids in one body slowed every other request 25-fold
    ("stop-token-ids-too-many", "POST", C, {"prompt": "x", "stop_token_ids": list(range(1025))}, 400, "invalid_value",
     "stop_token_ids"),
    ("logit-bias-too-many", "POST", C, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, 400,
     "invalid_value", "logit_bias"),
    ("stream-options-without-stream", "POST", C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "invalid_value", "stream_options is only allowed with stream: true"),
    # found by the third attack: NaN and Infinity (Python's json takes them) had forced a schema's output to "null";
    # a body in UTF-16; a trailing slash redirected to the Host header's site
    ("nan-in-body", "POST", C, b'{"prompt": "x", "temperature": NaN}', 400, "invalid_json", "NaN is not a JSON"),
    ("infinity-in-schema", "POST", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "response_format": '
     b'{"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": -Infinity}}}}', 400, "invalid_json",
     "-Infinity is not a JSON"),
    ("nan-in-tool-arguments", "POST", CHAT, {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": '{"a": NaN}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}]}, 400, "invalid_value", "NaN is not a JSON"),
    ("overflowing-number-in-schema", "POST", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], '
     b'"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": 1e999}}}}', 400,
     "invalid_json", "1e999 is past a double's range"),
    ("utf16-body", "POST", C, '{"prompt": "x"}'.encode("utf-16"), 400, "invalid_json", "not UTF-8"),
    ("trailing-slash", "POST", C + "/", {"prompt": "x"}, 404, "not_found", "no such route"),
    ("detokenize-many-bad-tokens", "POST", "/detokenize", {"tokens": ["a"] * 100_000}, 400, "invalid_value",
     "tokens.0"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "code", "text"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_gets_its_status_and_error_json(appliance, method, path, body, status, code, text):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        ({"json": body} if body is not None else {})
    response = httpx.request(method, appliance.url + path, timeout=60, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    texts = (text,) if isinstance(text, str) else text
    assert any(t in error["message"] for t in texts) and error["code"] == code, error
    assert isinstance(error["type"], str) and error["type"]


def test_a_request_with_both_transfer_encoding_and_content_length_is_refused(appliance):
    """The two framings at once (a request-smuggling shape) are a 400, not the chunked body read and answered."""
    host, port = appliance.url.removeprefix("http://").split(":")
    body = b'{"prompt": "x", "max_tokens": 1}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\nConnection: close\r\n\r\n" + chunked)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"both Transfer-Encoding and Content-Length" in answer, answer[:300]


def test_a_compressed_body_is_refused_with_what_to_do(appliance):
    import gzip

    response = httpx.post(appliance.url + C, content=gzip.compress(b'{"prompt": "x"}'),
                          headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and "send the body uncompressed" in error["message"]


def test_messages_do_not_echo_huge_paths_or_pythons_hints(appliance):
    """A 404 names its path, cut at 200 characters (not 60 KB echoed back); a huge integer's error does not pass on
    Python's own advice (sys.set_int_max_str_digits), which is the server's business, not the client's."""
    answer = httpx.get(appliance.url + "/" + "a" * 60_000, timeout=60)
    assert answer.status_code == 404 and len(answer.json()["error"]["message"]) < 300
    answer = httpx.post(appliance.url + "/v1/completions", content=b'{"prompt": "x", "seed": ' + b"9" * 5_000 + b"}",
                        headers={"content-type": "application/json"}, timeout=60)
    assert answer.status_code == 400 and "sys." not in answer.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param"), [({"prompt": "x", "stream": "maybe"}, "stream"),
                                            ({"prompt": "x", "stream_options": {"include_usage": "maybe"}},
                                             "stream_options.include_usage"),
                                            ({"prompt": "x", "temperature": "hot"}, "temperature"),
                                            ({"prompt": "x", "suffix": "y"}, "suffix"),
                                            ({"prompt": "x", "best_of": 3}, "best_of"),
                                            ({"prompt": "x", "stream_options": {"include_usage": True}},
                                             "stream_options"),
                                            ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens")])
def test_param_names_the_field_path(appliance, body, param):
    assert httpx.post(appliance.url + C, json=body).json()["error"]["param"] == param


@pytest.mark.parametrize(("path", "body", "param"), [
    (C, {"prompt": LONG, "max_tokens": 1}, "prompt"),  # the prompt alone fills the context
    (C, {"prompt": "x", "max_tokens": 100000}, "max_tokens"),  # the completion asks for more than is left
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),  # max_tokens not even sent
    (CHAT, {"messages": [{"role": "user", "content": LONG}], "max_completion_tokens": 5}, "messages"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 100000}, "max_completion_tokens"),
    ("/v1/embeddings", {"input": ["x", LONG]}, "input"),
])
def test_context_errors_name_the_field_that_overflowed(appliance, path, body, param):
    error = httpx.post(appliance.url + path, json=body, timeout=60).json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(appliance):
    before = appliance.logs()
    with socket.create_connection(("127.0.0.1", int(appliance.url.rsplit(":", 1)[1]))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "hi", "max_tokens": 2}')
    time.sleep(1.0)
    ok = httpx.post(appliance.url + C, json={"prompt": "x", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200
    added = appliance.logs()[len(before):]
    assert "Traceback" not in added and "ClientDisconnect" not in added, added[-3000:]


def test_the_server_is_unharmed_after_the_bad_requests(appliance):
    assert len(CASES) >= 30
    ok = httpx.post(appliance.url + C, json={"prompt": "The capital of France is", "max_tokens": 3,
                                             "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["text"]
    assert httpx.get(appliance.url + "/health").status_code == 200


def test_prompt_too_long_names_its_length(appliance):
    error = httpx.post(appliance.url + C, json={"prompt": [1930] * 8192, "max_tokens": 5}).json()["error"]
    assert "maximum context length is 8192 tokens. However, your prompt has 8192 tokens" in error["message"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    app = Appliance(tmp_path_factory.mktemp("keyed"), BASE_SPEC, ("server.api_key.env=TEST_KEY",),
                    env={"TEST_KEY": "sk-test-123456"}).wait_ready()
    yield app
    assert app.stop() == 0


def test_api_key_is_required_when_configured(keyed):
    body = {"prompt": "Hi", "max_tokens": 1}
    missing = httpx.post(keyed.url + C, json=body)
    wrong = httpx.post(keyed.url + C, json=body, headers={"Authorization": "Bearer nope"})
    right = httpx.post(keyed.url + C, json=body, headers={"Authorization": "Bearer sk-test-123456"}, timeout=60)
    assert missing.status_code == wrong.status_code == 401 and right.status_code == 200
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(keyed.url + "/ping").status_code == httpx.post(keyed.url + "/ping").status_code == 200


KEYED_ROUTES = [("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
                ("GET", "/openapi.json", None), ("GET", "/version", None), ("GET", "/v1/models", None),
                ("GET", "/v1/models/smollm2", None), ("GET", "/metrics", None), ("POST", CHAT, {"messages": MSG, "max_tokens": 1}),
                ("POST", "/v1/embeddings", {"input": "Hi"}), ("GET", "/load", None),
                ("POST", "/score", {"text_1": "Hi", "text_2": "Ho"}), ("POST", "/rerank", {"query": "Hi", "documents": "Ho"})]


@pytest.mark.parametrize(("method", "path", "body"), KEYED_ROUTES, ids=[r[1] for r in KEYED_ROUTES])
def test_every_route_but_health_needs_the_key(keyed, method, path, body):
    kwargs = {"json": body} if body is not None else {}
    missing = httpx.request(method, keyed.url + path, timeout=60, **kwargs)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    right = httpx.request(method, keyed.url + path, timeout=60, headers={"Authorization": "Bearer sk-test-123456"},
                          **kwargs)
    assert right.status_code == 200, right.text


def test_null_is_a_field_left_out(appliance):
    """Clients that send every field send null for those they leave unset: each is its default (vLLM takes them);
    a required field's null stays a 400."""
    nulls = {"stream": None, "n": None, "stream_options": None, "stop": None, "seed": None, "ignore_eos": None,
             "guided_json": None, "guided_decoding_backend": None, "include_stop_str_in_output": None}
    chat = httpx.post(appliance.url + CHAT, timeout=60, json={
        "messages": MSG, "max_tokens": 2, "logprobs": None, "parallel_tool_calls": None, "tools": None,
        "add_generation_prompt": None, **nulls})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 1, chat.text
    cmpl = httpx.post(appliance.url + C, timeout=60, json={"prompt": "x", "max_tokens": 2, "echo": None, **nulls})
    assert cmpl.status_code == 200 and cmpl.json()["choices"][0]["logprobs"] is None, cmpl.text
    streamed = httpx.post(appliance.url + C, timeout=60, json={  # nested too: stream_options' fields
        "prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": None,
                                                                            "continuous_usage_stats": None}})
    assert streamed.status_code == 200 and "[DONE]" in streamed.text, streamed.text
    missing = httpx.post(appliance.url + CHAT, timeout=60, json={"messages": None}).json()["error"]
    assert missing["param"] == "messages", missing


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A short context (96 tokens), so that requests reach its end quickly."""
    app = Appliance(tmp_path_factory.mktemp("short"), BASE_SPEC + "\n",
                    ("model.max_model_len=96", "kv_cache.memory=64MiB")).wait_ready()
    yield app
    assert app.stop() == 0


def test_a_completion_longer_than_the_context_leaves_is_cut_to_it(short):
    """As vLLM and llama.cpp: max_tokens past what the prompt leaves of the context is cut to it (finish_reason
    "length"), not refused; more than the whole context, or a prompt that fills it, is a 400."""
    prompt = list(range(1000, 1090))  # 90 tokens: 6 left
    for max_tokens in ({"max_tokens": 50}, {}, {"max_tokens": None}):  # (left out or null: 16, as vLLM)
        answer = httpx.post(short.url + C, json={"prompt": prompt, "ignore_eos": True, **max_tokens}, timeout=60).json()
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 6, answer
    chat = httpx.post(short.url + CHAT, json={"messages": MSG, "max_completion_tokens": 96, "ignore_eos": True},
                      timeout=60).json()
    assert chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] == 96
    assert chat["choices"][0]["finish_reason"] == "length"
    # left out or null, max_tokens is 16 (vLLM's default), where the context leaves more
    for max_tokens in ({}, {"max_tokens": None}):
        answer = httpx.post(short.url + C, json={"prompt": prompt[:10], "ignore_eos": True, **max_tokens}, timeout=60)
        assert answer.json()["usage"]["completion_tokens"] == 16, answer.text
    for body, param in (({"prompt": prompt, "max_tokens": 97}, "max_tokens"),
                        ({"prompt": list(range(1000, 1096)), "max_tokens": 1}, "prompt"),
                        ({"prompt": prompt, "max_tokens": 50, "min_tokens": 10}, "min_tokens")):
        error = httpx.post(short.url + C, json=body, timeout=60).json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param, error


def test_truncating_to_the_context_leaves_the_room_the_request_asks(short):
    """truncate_prompt_tokens -1 keeps as many of the prompt's last tokens as the context holds with the room the
    request asks for: a completion's max_tokens (its default where left out: the completion runs whole), an
    embedding's one token, never a 400 for the prompt's length."""
    prompt = list(range(1000, 1200))  # 200 tokens, for a 96-token context
    for body, kept in (({"max_tokens": 10}, 86), ({}, 80), ({"max_tokens": 30, "min_tokens": 20}, 66)):
        answer = httpx.post(short.url + C, timeout=60, json={"prompt": prompt, "truncate_prompt_tokens": -1,
                                                             "ignore_eos": True, **body})
        usage = answer.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (kept, 96 - kept), answer.text
    chat = httpx.post(short.url + CHAT, timeout=60, json={"messages": [{"role": "user", "content": "word " * 300}],
                                                          "max_completion_tokens": 5, "truncate_prompt_tokens": -1})
    assert chat.json()["usage"]["prompt_tokens"] == 91, chat.text
    embedded = httpx.post(short.url + "/v1/embeddings", timeout=60, json={"input": prompt, "truncate_prompt_tokens": -1})
    assert embedded.json()["usage"]["prompt_tokens"] == 95, embedded.text


def test_schemathesis_finds_no_server_error(short):
    # a short context keeps each generated request quick; every response must be below 500
    app = short
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", app.url + "/openapi.json", "--checks",
         "not_a_server_error", "--phases", "fuzzing", "--max-examples", "30", "--request-timeout", "60",
         "--no-color", "--suppress-health-check", "all", "--seed", "1",
         # what it warns about (generated bodies our checks refuse, e.g. stream_options without stream) is not a bug
         "--warnings", "off"],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout, run.stdout[-6000:]
