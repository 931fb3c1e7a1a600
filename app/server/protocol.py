"""The OpenAI-compatible request and response bodies (plus vLLM's extra sampling fields).

Requests are validated here, as early as possible; unknown fields are ignored (as OpenAI and vLLM do)
and features this server does not implement are refused with a 400 that names the field.
"""

from __future__ import annotations

import json
import math
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictInt, Tag,
                      field_validator, model_validator)

from app.server.errors import APIError, FieldError

# A list whose validation stops at its first bad item: pydantic would otherwise make an error of every one (a
# /detokenize body of 800,000 strings: 2.5 s of the event loop for a 400), all but the first never shown
FIRST_ERROR = Field(fail_fast=True)
Stop = str | Annotated[list[str], FIRST_ERROR] | None


class _Nullable(BaseModel):
    """A part of a request whose fields sent as null count as left out (below)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        """A field given as null is the field left out (OpenAI's optional fields are nullable; clients that send
        every field send null for those they do not set, and vLLM takes them so); a required one stays an error."""
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            return {key: value for key, value in data.items()
                    if value is not None or key not in fields or fields[key].is_required()}
        return data


class _Body(_Nullable):
    model_config = ConfigDict(extra="allow")


# A token id: a JSON integer (not true/false, 1.0 or "1", which pydantic's lax mode would take as one)
TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 31)]
TokenIds = Annotated[list[TokenId], FIRST_ERROR]


def at_most(count: int):
    """A BeforeValidator of an object (or list) of at most `count` entries, checked before any of them is: pydantic
    would check 200,000 values first (0.7 s of the event loop) and then say there are too many."""
    def check(value: Any) -> Any:
        if isinstance(value, dict | list) and len(value) > count:
            raise ValueError(f"at most {count} entries, not {len(value)}")
        return value
    return BeforeValidator(check)


def json_value(text: str | bytes) -> Any:
    """JSON text as Python values, as JSON defines it: bytes must be UTF-8 (no other encoding, no byte-order mark),
    and NaN and Infinity, which Python's json takes and no other JSON reader does, are not numbers (ValueError, or
    RecursionError where nested too deeply)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent, which must fit a double: Python makes 1e999 an infinity, which
    serializes back as null (a schema's {"const": 1e999} would force null)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} is past a double's range")
    return value


def texts_or_ids(value: Any, field: str) -> Any:
    """`value` where it has one of the shapes a prompt (an embedding's input) takes: a string, a list of strings, a
    list of token ids or a list of such lists; else what shapes are allowed (pydantic's union would say only "Input
    should be a valid string"). Ranges and emptiness are checked after."""
    def ids(v):
        return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)

    if isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, list) and (ids(value) or all(ids(v) for v in value)):
        for token in (t for v in value for t in (v if isinstance(v, list) else (v,))):
            if not 0 <= token < 1 << 31:  # (pydantic's union would say "Input should be a valid string")
                raise ValueError(f"{field} holds the token id {str(token)[:32]}: token ids are integers from 0 "
                                 "to the vocabulary's size less one")
        return value
    raise ValueError(f"{field} must be a string, a list of strings, a list of token ids (integers) or a list of "
                     "such lists")


def _texts_or_ids(field: str):
    """A prompt-shaped field (`texts_or_ids`'s shapes), named `field` in its error."""
    return Annotated[str | Annotated[list[str], FIRST_ERROR] | TokenIds | Annotated[list[TokenIds], FIRST_ERROR],
                     BeforeValidator(lambda value: texts_or_ids(value, field))]


class StreamOptions(_Nullable):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


# Structured outputs' grammars are compiled (frontend and engine) and walked every step: bounded, as OpenAI bounds
# its schemas, so that one request cannot hold up the others (a 200 KB grammar once slowed a stream 25-fold).
MAX_GRAMMAR_CHARS = 65_536
# vLLM's request_id (a body field, or the X-Request-Id header, which wins): the response's id is "<kind>-<request_id>"
RequestId = Annotated[str, Field(min_length=1, max_length=256)]


def _bounded_schema(schema):
    if schema is not None and len(json.dumps(schema) if not isinstance(schema, str) else schema) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"a JSON schema may be up to {MAX_GRAMMAR_CHARS} characters")
    return schema


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _bounded_schema(value)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format needs json_schema exactly when its type is 'json_schema'")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_value: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_object: bool | None = None

    @field_validator("json_value")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        return _bounded_schema(value)

    @field_validator("choice")
    @classmethod
    def _choices_bounded(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and sum(len(c) for c in value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the choices may hold up to {MAX_GRAMMAR_CHARS} characters in all")
        return value

    @model_validator(mode="after")
    def _exactly_one(self):
        given = self._given()
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
                             + (f"; got {', '.join(given)}" if given else ""))
        return self

    def value(self, name: str):
        return self.json_value if name == "json" else getattr(self, name)

    def _given(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar", "json_object")
                if self.value(name) not in (None, False)]

    def constraint(self) -> tuple[str, Any]:
        name = self._given()[0]
        return name, self.value(name)


# vLLM's request fields that would change an answer and that this server does not follow, each with the values that
# mean "off": set otherwise, a 400 says so (ignored, as unknown fields are, they would give a different answer than
# the client asked for without a word)
VLLM_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logits_processors": ([], None),
    "prompt_embeds": (None,), "spaces_between_special_tokens": (True, None),
    # OpenAI's deprecated names of tools and tool_choice (vLLM ignores them: the answer would call nothing)
    "functions": (None, []), "function_call": (None, "none", "auto"),
}
UNSUPPORTED_HINTS = {"functions": "use tools", "function_call": "use tool_choice"}


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds)")
    return value


class PromptTruncation(BaseModel):
    """vLLM's truncate_prompt_tokens (completions, chat, embeddings): only a prompt's last k tokens are read."""

    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=1 << 30), AfterValidator(_not_zero)] | None = None

    def truncated(self, ids: list[int], max_model_len: int, room: int = 1) -> list[int]:
        """The prompt's ids as kept: its last k, cut on the left (vLLM's side); -1: the last that leave the context
        `room` tokens (a completion's max_tokens; an embedding's input is computed as a one-token completion)."""
        keep = max(1, max_model_len - room) if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep:]


def refuse_unsupported(extra: dict[str, Any] | None, fields: dict[str, tuple[Any, ...]]) -> None:
    """ValueError naming the first of `fields` (name -> values that mean "off") set in `extra` to another value."""
    for name, off in fields.items():
        if name in (extra or {}):
            if extra[name] not in off:
                hint = f" ({UNSUPPORTED_HINTS[name]})" if name in UNSUPPORTED_HINTS else ""
                raise FieldError(name, f"{name} is not supported by this server{hint}")


class SamplingFields(_Body, PromptTruncation):
    """Fields shared by both generation endpoints."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    user: str | None = None
    # OpenAI's: token ids (as JSON object keys: strings of digits) to biases from -100 to 100; bounded (OpenAI takes
    # 300) as stop_token_ids are: the engine keeps them with each running sequence and adds them every step
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024),
                          at_most(1024)] | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=1 << 20)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=1 << 20)] = 0
    # bounded: the engine checks each sampled token against them, and masks them all until min_tokens
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    skip_special_tokens: bool = True
    # each prompt token's logprob given those before it, and this many most likely tokens' (vLLM's shape, not streamed)
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # structured outputs: OpenAI's response_format (both endpoints, as vLLM) or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    include_stop_str_in_output: bool = False  # the matched stop string ends the text (vLLM's)
    # vLLM's: only these tokens may be sampled (bounded by the vocabulary's size: 2^18 covers the largest in use)
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 18), FIRST_ERROR,
                                 at_most(1 << 18)] | None = None
    # vLLM's beam search (app/server/beam.py): n beams, scored by summed logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(ge=-10, le=10)] = 1.0
    # vLLM's: words the output never ends with (the last token of each is masked where the output would complete it)
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=128)] | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) added to the prompt; default: yes for a completion's prompt, no
    # for a chat's rendered template (which writes its own)
    add_special_tokens: bool | None = None
    # vLLM's: logprobs name tokens "token_id:<id>" (a client that maps them back needs no tokenizer)
    return_tokens_as_token_ids: bool = False
    # vLLM's: the response's id is "<cmpl or chatcmpl>-<request_id>" (the X-Request-Id header's, where sent); the
    # engine's own ids stay unique whatever clients send
    request_id: RequestId | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Stop) -> Stop:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be up to 16 non-empty strings")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs is not available with stream: true (as vLLM)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias keys must be token ids (decimal digits), not {key[:40]!r}")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        old = sorted(k for k, v in (self.model_extra or {}).items() if k.startswith("guided_") and v is not None)
        if old:  # vLLM's earlier names: ignoring them would answer unconstrained
            raise FieldError(old[0], f"{old[0]} is not supported; use structured_outputs (vLLM's current name) or "
                             "response_format")
        refuse_unsupported(self.model_extra, VLLM_UNSUPPORTED)
        if self.structured_outputs is not None and self.response_format is not None and \
                self.response_format.type != "text":
            raise FieldError("structured_outputs", "give response_format or structured_outputs, not both")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream: true")
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def constraint(self) -> tuple[str, Any, str] | None:
        """The structured output asked for, as (kind, value, the field that asked): see app/engine/structured.py."""
        if self.structured_outputs is not None:
            return (*self.structured_outputs.constraint(), "structured_outputs")
        form = self.response_format
        if form is None or form.type == "text":
            return None
        if form.type == "json_object":
            return "json_object", True, "response_format"
        return "json", form.json_schema.json_schema, "response_format"

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs."""
        return tuple((int(token), value) for token, value in (self.logit_bias or {}).items())


class CompletionRequest(SamplingFields):
    prompt: _texts_or_ids("prompt")
    max_tokens: Annotated[int, Field(ge=0, le=1 << 30)] | None = 16  # 0 with echo: the prompt alone, scored
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of must equal n (or be left out)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens 0 is only allowed with echo: true (the prompt returned, with "
                                           "its logprobs where logprobs is set, and nothing generated)")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


# Content parts of other kinds than text, as OpenAI's APIs name them: this server's models read text only
_MEDIA_PARTS = ("image_url", "input_image", "input_audio", "audio_url", "video_url", "input_video", "file",
                "input_file", "image", "audio", "video")


def text_parts(texts: tuple[str, ...]):
    """A BeforeValidator of a message's content: where it is a list, each part must be an object of one of the text
    `texts` types with a string `text`; else an error that says which part and why (an image or audio one: that the
    model reads text only), where pydantic's union would say only "Input should be a valid string"."""
    def check(value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise ValueError(f"part {i} is of type {kind!r}: this model reads text only (parts of type "
                                 f"{' or '.join(map(repr, texts))})")
            if not isinstance(part, dict) or kind not in texts:
                raise ValueError(f"part {i} must be an object of type {' or '.join(map(repr, texts))}, not "
                                 f"{str(kind if isinstance(part, dict) else type(part).__name__)[:40]!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} (of type {kind!r}) must have its text as a string in `text`")
        return value
    return BeforeValidator(check)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI gives it


class ToolCall(BaseModel):
    """A call an assistant made, in a request's history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, text_parts(("text",))] = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers
    reasoning_content: str | None = None  # an assistant's thinking (as this server returns it; `reasoning` the same)
    reasoning: str | None = None

    def text(self) -> str:
        """The content's text; parts joined by line breaks (as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


# what chat_template_kwargs may not set: apply_chat_template's own arguments and the names it gives the template
_TEMPLATE_OWN = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                 "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                 "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"}


MAX_NESTING = 64  # JSON levels in a tool's schema or chat_template_kwargs (walked by the server's own code)


def nesting(value) -> int:
    """How deep JSON containers nest in `value`, walked without recursion (so no depth exhausts the stack);
    counting stops past MAX_NESTING."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


class ChatTemplateFields(BaseModel):
    """How the conversation is rendered (vLLM's fields; chat completions and /tokenize)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open: the model continues it (a "prefill")
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (Qwen3's enable_thinking)
    # vLLM's: texts for a retrieval-augmented template (Command R's, Granite's), each a {"title", "text"}-like object
    documents: Annotated[list[dict[str, str]], Field(max_length=1024)] | None = None
    chat_template: str | None = None  # vLLM's per-request template: refused (below)

    @model_validator(mode="after")
    def _template_checks(self):
        if self.chat_template is not None:
            raise FieldError("chat_template", "a request's own chat template is not used: the server renders with the "
                                              "model's (or the spec's model.chat_template), as vLLM does without "
                                              "--trust-request-chat-template")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message continues the last message, "
                                                       "add_generation_prompt starts a new one: set "
                                                       "add_generation_prompt to false with it")
        own = sorted(set(self.chat_template_kwargs or {}) & _TEMPLATE_OWN)
        if own:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {own[0]!r}: the server sets it")
        if self.chat_template_kwargs and (nesting(self.chat_template_kwargs) > MAX_NESTING or
                                          len(json.dumps(self.chat_template_kwargs)) > MAX_GRAMMAR_CHARS):
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs may hold up to {MAX_GRAMMAR_CHARS} "
                                                     f"characters, nested up to {MAX_NESTING} levels")
        return self

    def template_options(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments besides the conversation and tools."""
        documents = {"documents": self.documents} if self.documents else {}
        return {**(self.chat_template_kwargs or {}), **documents, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class ToolFields(BaseModel):
    """Tool calling's fields (app/server/tools.py; chat completions and /tokenize)."""

    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _tools_bounded(cls, value: list[Tool] | None) -> list[Tool] | None:
        # the parameter schemas become one grammar ("auto", "required"), bounded as structured outputs' are
        for i, tool in enumerate(value or []):
            if nesting(tool.function.parameters) > MAX_NESTING:
                raise ValueError(f"tools.{i}.function.parameters nests deeper than {MAX_NESTING} levels")
        if value and sum(len(json.dumps(t.function.parameters or {})) for t in value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the tools' parameter schemas may hold up to {MAX_GRAMMAR_CHARS} characters in all")
        return value


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # vLLM's: a last message of the assistant's (a prefill) begins each answer's content

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def echoed(self) -> str:
        """The text `echo` puts first in each answer: the last message's, where it is the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body, ChatTemplateFields, ToolFields):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], FIRST_ERROR, Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # vLLM's: the tokens' pieces too, as `token_strs`

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("messages", "give exactly one of prompt or messages")
        return self


class ApplyTemplateRequest(_Body, ChatTemplateFields, ToolFields):
    """llama.cpp's /apply-template: a chat request's conversation (and its template fields, tools) to render."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], FIRST_ERROR, Field(min_length=1)]


class ApplyTemplateResponse(BaseModel):
    prompt: str


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


# --- responses (documented in /openapi.json; built as plain dicts on the hot path) ---------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the prefix cache already held (not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# vLLM's prompt_logprobs: None for the first prompt token, then {token id: {"logprob", "rank", "decoded_token"}}
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (not EOS)
    prompt_logprobs: PromptLogprobs | None = None  # only where the request set prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (not EOS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only where the request set prompt_logprobs


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the model file or directory's name
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]]  # OpenAI's earlier list, as vLLM fills it


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingRequest(_Body, PromptTruncation):
    """OpenAI's /v1/embeddings: each input's embedding (app/server/embeddings.py)."""

    input: _texts_or_ids("input")
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # only the model's own size (no Matryoshka model here)
    user: str | None = None
    request_id: RequestId | None = None  # the answer's id: "embd-<request_id>" (vLLM's)

    @field_validator("input")
    @classmethod
    def _some_but_not_too_many(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and not isinstance(value[0], int) and len(value) > 2048:  # (one token list: any)
            raise ValueError("input holds at most 2048 texts or token lists (OpenAI's limit)")
        return value


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str  # vLLM's (OpenAI's answer has none): "embd-<request_id>"
    object: Literal["list"] = "list"
    created: int
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class PropsResponse(BaseModel):
    """llama.cpp's /props: the context size and sampling defaults (`default_generation_settings`: `n_ctx`, `params`),
    the sequences run at once (`total_slots`), the served model, its chat template and BOS / EOS tokens."""

    default_generation_settings: dict[str, Any]
    total_slots: int
    model_alias: str
    model_path: str
    modalities: dict[str, bool]
    chat_template: str
    bos_token: str
    eos_token: str
    build_info: str
    endpoint_slots: bool  # false: llama.cpp's /slots is not served
    endpoint_props: bool
    endpoint_metrics: bool
    is_sleeping: bool


class TokenizerInfoResponse(BaseModel):
    """vLLM's /tokenizer_info (what lm-evaluation-harness' remote tokenizer reads): the served tokenizer's class,
    special tokens and chat template, so a client needs no copy of the tokenizer."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    additional_special_tokens: list[str] = []
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    model_max_length: int
    chat_template: str | None = None


# --- vLLM's /score and /rerank (app/server/scores.py): the cosine of two texts' embeddings -----------------------

MAX_SCORED_TEXTS = 2048  # texts in one request, both sides together (as /v1/embeddings' inputs)


def _some_texts(value: Any) -> Any:
    if isinstance(value, list) and not 0 < len(value) <= MAX_SCORED_TEXTS:
        raise ValueError(f"give 1 to {MAX_SCORED_TEXTS} texts, not {len(value)}")
    return value


ScoredTexts = Annotated[str | Annotated[list[str], FIRST_ERROR], BeforeValidator(_some_texts)]
# vLLM's names for a score request's two sides: the first pair of these that the request gives
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class ScoringFields(_Body, PromptTruncation):
    model: str | None = None
    # vLLM's: keep only a query's / a document's first tokens (0: all of them)
    max_tokens_per_query: Annotated[int, Field(ge=0, le=1 << 30)] = 0
    max_tokens_per_doc: Annotated[int, Field(ge=0, le=1 << 30)] = 0
    use_activation: bool | None = None  # vLLM's, for a classifier's scores: a cosine has no activation to apply
    request_id: RequestId | None = None  # the answer's id: "score-<request_id>", "rerank-<request_id>" (vLLM's)

    @model_validator(mode="after")
    def _no_template(self):
        """vLLM's `instruction` and `chat_template_kwargs` go to a cross-encoder's score template; a cosine of
        embeddings has none: a 400 rather than a score that ignored them."""
        refuse_unsupported(self.model_extra, {"instruction": (None, ""), "chat_template_kwargs": (None, {})})
        return self


class ScoreRequest(ScoringFields):
    """vLLM's /score: each pair's score; a single text on the first side is paired with every one on the second."""

    text_1: ScoredTexts | None = None
    text_2: ScoredTexts | None = None
    queries: ScoredTexts | None = None
    documents: ScoredTexts | None = None
    items: ScoredTexts | None = None
    data_1: ScoredTexts | None = None
    data_2: ScoredTexts | None = None

    @model_validator(mode="after")
    def _one_pair_of_sides(self):
        first, second = self.side_names()
        if len(self.side(first)) > 1 and len(self.side(first)) != len(self.side(second)):
            raise FieldError(second, f"{first} holds {len(self.side(first))} texts and {second} "
                                     f"{len(self.side(second))}: give one {first} for every {second}, or a single "
                                     f"one for all of them")
        return self

    def side_names(self) -> tuple[str, str]:
        given = [pair for pair in SCORE_SIDES if all(getattr(self, name) is not None for name in pair)]
        if len(given) > 1:  # (scoring one pair and dropping the other would answer half the request)
            raise FieldError(given[1][1], f"give one pair of sides to score, not both ({', '.join(given[0])}) and "
                                          f"({', '.join(given[1])})")
        if not given:
            raise FieldError("text_2", "give the two sides to score: text_1 and text_2 (or queries and documents)")
        return given[0]

    def side(self, name: str) -> list[str]:
        value = getattr(self, name)
        return [value] if isinstance(value, str) else value


class RerankRequest(ScoringFields):
    """vLLM's and llama.cpp's /rerank (Jina's and Cohere's shape): the documents by their score against the query."""

    query: str
    documents: ScoredTexts
    top_n: Annotated[int, Field(ge=0)] = 0  # the best n (0: all of them)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: ScoreUsage
    results: list[RerankResult]


# --- the Responses API (POST /v1/responses), answered by the chat machinery ------------------------------------


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text", "reasoning_text"]
    text: str


class InputMessage(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[InputText], text_parts(("input_text", "output_text", "text", "reasoning_text"))]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier (sent back with the conversation)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, value: str) -> str:
        try:
            json_value(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"arguments must be JSON text: {exc}") from None
        return value


class FunctionCallOutput(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[str | list[InputText], text_parts(("input_text", "output_text", "text", "reasoning_text"))]
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """An earlier answer's thinking, sent back: the next assistant message's reasoning_content (what a chat template
    does with it is the template's: most drop the thinking of earlier turns)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]
    content: list[InputText | dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None

    def text(self) -> str:
        parts = self.content or self.summary or []
        return "".join(p.text if isinstance(p, InputText) else str(p.get("text", "")) for p in parts)


def _item_kind(value) -> str:
    """An input item's type, as its union tag; a message may leave it out (`{"role": "user", "content": ...}`). The
    tags are bracketed: errors.from_validation_error leaves such parts out of an error's `param`."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"[{kind or 'message'}]"


InputItem = Annotated[Annotated[InputMessage, Tag("[message]")] | Annotated[FunctionCallItem, Tag("[function_call]")] |
                      Annotated[FunctionCallOutput, Tag("[function_call_output]")] |
                      Annotated[ReasoningItem, Tag("[reasoning]")], Discriminator(_item_kind)]


class ResponsesTool(BaseModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("text.format needs a schema exactly when its type is 'json_schema'")
        return self


class TextOptions(BaseModel):
    format: TextFormat | None = None


# What the Responses API's `include` may name (OpenAI's list): the text's logprobs are given; the others name what
# only OpenAI's own tools, image inputs or stored reasoning make, none of which this server has, so they add nothing
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")


# chat's sampling fields (OpenAI's older ones and vLLM's) that the Responses API lacks but vLLM's takes, or clients
# send out of habit: passed on to the chat request, which validates them (a bad one is a 400 naming it)
CHAT_SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
                        "stop", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias")


# chat's fields that the Responses API has under other names: where a 400 for the one sent points
RESPONSES_NAMES = {"max_tokens": "use max_output_tokens", "max_completion_tokens": "use max_output_tokens",
                   "response_format": "use text.format", "structured_outputs": "use text.format",
                   "guided_": "use text.format", "messages": "use input (and instructions)",
                   "logprobs": 'use include: ["message.output_text.logprobs"] and top_logprobs'}


@cache
def _chat_only_defaults() -> dict[str, Any]:
    """Chat's fields that /v1/responses neither has nor passes on, with chat's defaults (set otherwise: a 400);
    stream_options is none of them: it changes no answer (the usage comes in response.completed)."""
    return {name: info.default for name, info in ChatCompletionRequest.model_fields.items()
            if name not in ResponsesRequest.model_fields and name not in CHAT_SAMPLING_EXTRAS
            and name != "stream_options"}


class ResponsesRequest(_Body):
    """OpenAI's Responses API: the conversation comes whole with each request, or continues a stored response's
    (`previous_response_id`, where server.responses_store keeps them: responses.py)."""

    model: str | None = None
    input: Annotated[list[InputItem], Field(min_length=1, fail_fast=True)]  # a string is one user message
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    text: TextOptions | None = None
    truncation: Literal["disabled", "auto"] | None = None  # "auto" drops nothing here: a too long input is a 400
    store: bool = True
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool = False
    metadata: Annotated[dict[str, str], at_most(16)] | None = None  # (OpenAI's limit)
    user: str | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's: the response's id, as given (an X-Request-Id header wins, as on the other endpoints); default resp_<id>
    request_id: RequestId | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_input(cls, value):
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _vllm_fields(self):
        # the chat completions fields of vLLM's that change an answer: the Responses API follows none of them
        refuse_unsupported(self.model_extra, {**VLLM_UNSUPPORTED, "allowed_token_ids": (None,),
                                              "use_beam_search": (False, None), "length_penalty": (1, None),
                                              "bad_words": ([], None), "include_stop_str_in_output": (False, None),
                                              "truncate_prompt_tokens": (None,), "add_special_tokens": (None, False),
                                              "return_tokens_as_token_ids": (False, None),
                                              "n": (1, None), "best_of": (1, None)})  # (one output: no choices)
        chats = _chat_only_defaults()
        for name, value in (self.model_extra or {}).items():
            if name in chats and value not in (None, chats[name]) or name.startswith("guided_") and value is not None:
                instead = next((theirs for ours, theirs in RESPONSES_NAMES.items() if name.startswith(ours)),
                               "the Responses API has no such field")
                raise FieldError(name, f"{name} is a chat completions field, which /v1/responses does not follow "
                                       f"(ignoring it would answer another request): {instead}")
        return self

    @field_validator("conversation", "prompt")
    @classmethod
    def _stateless(cls, value):
        if value is not None:  # answering without what they name would be answering another question
            raise ValueError("not supported: this server keeps no conversations or prompts; send the conversation "
                             "in input (or continue a stored response with previous_response_id)")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if name not in INCLUDABLE:
                raise ValueError(f"{name!r} is not one of {', '.join(map(repr, INCLUDABLE))}")
        return value

    @property
    def logprobs(self) -> bool:
        """Whether the answer's text carries its tokens' logprobs: `include` asks for them (OpenAI's way); so does
        `top_logprobs` alone (it asks for them at each position)."""
        return "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs is not None

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported: this server answers in the request")
        return value

    def chat_fields(self) -> dict:
        """The same request as chat completion fields (ChatCompletionRequest validates them): the instructions as a
        system message, input items as messages (function calls as an assistant's tool_calls, their outputs as tool
        messages), tools and tool_choice in chat's nesting, text.format as response_format."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        reasoning = None  # a reasoning item's text, for the assistant message that follows it
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
                continue
            if (isinstance(item, InputMessage) and item.role != "assistant") or isinstance(item, FunctionCallOutput):
                reasoning = None  # thinking that no answer of the assistant followed
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
                if item.role == "assistant" and reasoning:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not reasoning:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    if reasoning:
                        messages[-1]["reasoning_content"], reasoning = reasoning, None
            elif isinstance(item, FunctionCallOutput):
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        if not messages:  # (only reasoning items: chat's "at least 1 item, not 0" would puzzle the client)
            raise APIError(400, "input: holds no message, function call or output (reasoning items alone leave "
                                "the model nothing to answer)", "input", "invalid_value")
        fields: dict = {"model": self.model, "messages": messages, "stream": self.stream,
                        "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                        "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        fields.update({k: v for k, v in (self.model_extra or {}).items() if k in CHAT_SAMPLING_EXTRAS})
        if self.logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if isinstance(self.tool_choice, ResponsesToolChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": form.name, "schema": form.json_schema if form.json_schema is not None else {},
                "strict": form.strict}}
        elif form is not None:
            fields["response_format"] = {"type": form.type}
        return fields


class ResponseDeleted(BaseModel):
    """DELETE /v1/responses/{id}: OpenAI's answer."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] | None = None
    output_tokens_details: dict[str, int] | None = None


class ResponseObject(BaseModel):
    """A Responses API answer: `output` holds items of type "reasoning" (a thinking block's text), "message" (the
    text, as one "output_text" part) and "function_call" (`call_id`, `name`, `arguments`), in the order written."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
