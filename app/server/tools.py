"""Tool (function) calling on /v1/chat/completions, in the shapes of OpenAI's API and vLLM's server.

`tool_choice`:
- "required": the answer is held (structured outputs, app/engine/structured.py) to a JSON array of one or more
  calls, `[{"name": ..., "parameters": {...}}]` with each function's own parameter schema (vLLM's shape; one call
  at most with `parallel_tool_calls: false`), and returned as `tool_calls`, `finish_reason: "tool_calls"`;
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is that function's arguments,
  one JSON object held to its schema, returned as one tool call (`finish_reason: "stop"`, as OpenAI and vLLM);
- "auto" (the default when tools are given): the model chooses; the answer is held to either text (not starting
  with "[" or whitespace) or the "required" answer's array of calls (llguidance's own example of function calling),
  and comes back as whichever it wrote;
- "none": the tools go to the chat template and the answer is text.

A chat template that knows tools (it reads the variable `tools`: Qwen's, Llama 3.1's) gets them, and the history's
assistant `tool_calls` and tool results, as Hugging Face's `apply_chat_template` defines them. A template that does not
(SmolLM2's) would leave the model blind to the functions: there, "required", "auto" and a named choice add a
system message that lists them and the answer's shape, and earlier calls in the history are written into the
assistant's text in that shape.

How the model writes calls (`tool_format`, from its chat template: AsyncTokenizer.tool_format):
- "array": the template renders no tools; the shapes above, this server's own.
- "hermes": the template asks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5 and 3,
  Hermes 2 and 3): "required" and a named choice are held to calls in those tags (the model's own format, so that
  it writes what it was trained to), and "auto" is not held at all: the model writes text, calls in tags, or
  both, and `HermesReader` takes the calls out of it as it grows (vLLM's `--tool-call-parser hermes`); a tagged
  block that is no call (no name, not JSON) stays text.
- "llama3_json": the template asks for one `{"name": ..., "parameters": {...}}` object (Llama 3.1 to 3.3; it renders
  one call a turn): every choice but "none" is held to one such object, "auto" to that or text (as for "array").
- "mistral": the template asks for `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3,
  Nemo, Small 3: the token, then a JSON array of calls): every choice but "none" is held to that (one call for a
  named function), "auto" to that or text; the calls' ids are 9 letters and digits, as Mistral's templates demand
  of the history's ids (the history's longer ids are cut to their last 9 characters, as vLLM does).
- "mistral_args": Mistral's later format, `[TOOL_CALLS]name[ARGS]{...}` a call (Devstral, Magistral, Mistral
  Small 3.1 and 3.2; `[CALL_ID]` and the model's own id before `[ARGS]` as tokenizer v11's templates write it):
  held as "mistral" is, the tags as their special tokens where the tokenizer has them; history ids cut as there;
  "auto" may also be text followed by calls where `[TOOL_CALLS]` is a special token (ArgsReader's `then_calls`).
- "qwen3_xml": the template asks for XML in Hermes' tags, `<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter>...</function></tool_call>` (Qwen3-Coder, Qwen3.5): "auto" is not held, as Hermes' is, and
  `HermesReader` reads the calls with `xml_call`, each value typed by its parameter's schema (vLLM's
  `--tool-call-parser qwen3_coder`); "required" and a named choice are held to calls in that XML
  (`_xml_grammar`), read the same way.
- None: a template that renders tools in another format (GLM's `<arg_key>`, ...): "auto" would need that format's
  parser, which this server does not have: a 400 naming `tool_choice`, as vLLM's without `--tool-call-parser`;
  "required" and named choices are held to the "array" shapes.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from app.engine.structured import JSON_OPTIONS

# JSON as Qwen's and Llama 3's templates write calls, `{"name": "f", "arguments": {"a": 1}}`: the models' own spacing
# (this server's own shapes, for templates that know no tools, stay compact)
SPACED = {**JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}
from app.server.errors import APIError
from app.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest, Tool, json_value
from app.server.reasoning import tag_start


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the server."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[Tool]
    name: str | None = None  # the function a named choice forces
    constraint: tuple[str, Any, str] | None = None  # (kind, value, param), as SamplingFields.constraint()
    format: str | None = "array"  # how the model writes calls ("array", "hermes", None: see the module's doc)
    text_then_calls: bool = False  # "auto" may be text followed by calls (Mistral's later format, its tag a token)

    @property
    def forced(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def reader(self) -> ToolCallReader | HermesReader | ArgsReader:
        if self.format == "hermes":
            return HermesReader(held=self.mode != "auto")
        if self.format == "qwen3_xml":  # held or not, each call read whole at its closing tag
            properties = {t.function.name: _typed_properties(t.function.parameters or {}) for t in self.tools}
            held = self.mode != "auto"  # a held answer read as its grammar writes it (values end at _XML_STOP)
            return HermesReader(parse=partial(held_xml_call if held else xml_call, properties=properties), forced=held)
        if self.format == "llama3_json":
            return ToolCallReader(None, auto=self.mode == "auto", single=True)
        if self.format == "mistral":
            return ToolCallReader(None, auto=self.mode == "auto", mistral=True)
        if self.format == "mistral_args":
            return ArgsReader(None, auto=self.mode == "auto", then_calls=self.text_then_calls)
        return ToolCallReader(self.name if self.mode == "named" else None, auto=self.mode == "auto")

    def finish_reason(self, reason: str | None, reader: ToolCallReader | HermesReader | ArgsReader) -> str | None:
        """Calls ("required", "auto") that ended whole are `"tool_calls"` (vLLM 0.11+); a named call, or an answer
        cut short (a stop string, `max_tokens`), keeps the engine's reason."""
        return "tool_calls" if self.mode in ("required", "auto") and reason == "stop" and reader.closed else reason

    def system_prompt(self) -> str | None:
        """The tools in words, for a template that knows no tools (None: nothing to add)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            described = _dump(tool.function.model_dump(exclude_none=True))
            return (f"Call the function {self.name}: answer with its arguments, one JSON object that its parameters' "
                    f"schema allows, and nothing else. The function:\n{described}")
        listing = _dump([t.function.model_dump(exclude_none=True) for t in self.tools])
        if self.mode == "required":
            return (f"Answer by calling one or more of these functions: {_CALLS_SHAPE}, and nothing else. The "
                    f"functions:\n{listing}")
        if self.mode == "auto":
            return (f"You can call these functions. To call one or more of them, answer with only {_CALLS_SHAPE}; "
                    f"otherwise answer in plain text. The functions:\n{listing}")
        return None


_CALLS_SHAPE = ('a JSON array of calls, each {"name": the function\'s name, "parameters": its arguments as a JSON '
                'object}')


def plan(body: ChatCompletionRequest | TokenizeRequest, tool_format: str | None,
         constrained: bool = False, special_tags: dict[str, int] | None = None) -> ToolPlan | None:
    """The request's tool plan (None: no tools, no tool_choice); a 400 naming the field where they do not fit.
    `tool_format`: how the model writes calls (the module's doc); `constrained`: whether the request asks for a
    structured output too; `special_tags`: the format's tags that are special tokens of the model's, with their
    ids (AsyncTokenizer.special_tags: a grammar holds the answer to those tokens, not to their spelling)."""
    choice = body.tool_choice
    if choice is None:  # a prefilled answer (continue_final_message) is text to continue, not a choice to make
        choice = "auto" if body.tools and not body.continue_final_message else "none"
    if choice != "none" and body.continue_final_message:
        raise APIError(400, 'continue_final_message continues a text answer: give tool_choice "none" (or leave it '
                            "out) with it", "tool_choice", "invalid_value")
    if not body.tools:
        if choice != "none":
            raise APIError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    names = [tool.function.name for tool in body.tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise APIError(400, f"tools: two tools are named {twice[0]!r}", "tools", "invalid_value")
    if choice == "auto" and tool_format is None:
        raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs a parser of the model\'s '
                            "own tool-call format; this chat template asks for one this server cannot read (it "
                            "reads Hermes' <tool_call> tags, as Qwen's templates ask, Qwen3-Coder's XML in them, "
                            "Llama 3's JSON and Mistral's [TOOL_CALLS]): ask for "
                            '"required" (one or more calls), a named function ({"type": "function", "function": '
                            '{"name": ...}}) or "none"', "tool_choice", "invalid_value")
    fmt = tool_format if tool_format in ("hermes", "llama3_json", "mistral", "mistral_args", "qwen3_xml") else "array"
    if choice == "none":
        return ToolPlan("none", body.tools, format=fmt)
    if constrained:  # Hermes' "auto" is not held, but a structured output would be: it would forbid the tags
        raise APIError(400, "give tools (with tool_choice other than \"none\") or structured outputs "
                            "(response_format, structured_outputs), not both", "tool_choice", "invalid_value")
    tool = None if choice in ("required", "auto") else _named(choice, body.tools)
    if fmt == "qwen3_xml":  # "auto" read out of the free text, as Hermes'; the forced choices held to the XML
        if choice == "auto":  # (a parameter the XML cannot carry is the model's to miss, as with vLLM's reader)
            return ToolPlan("auto", body.tools, format=fmt)
        chosen, first = ([tool], body.tools.index(tool)) if tool is not None else (body.tools, 0)
        _check_xml_names(chosen)
        lark = _xml_grammar(chosen, first, body.parallel_tool_calls and tool is None, special_tags or {})
        return _held_plan(choice, body.tools, tool, lark, fmt)
    if fmt == "hermes":
        return _hermes_plan(choice, body.tools, tool, body.parallel_tool_calls, special_tags or {})
    if fmt == "llama3_json":
        return _llama_plan(choice, body.tools, tool)
    if fmt == "mistral":
        return _mistral_plan(choice, body.tools, tool, body.parallel_tool_calls, special_tags or {})
    if fmt == "mistral_args":
        return _mistral_args_plan(choice, body.tools, tool, body.parallel_tool_calls, special_tags or {})
    if tool is not None:
        return ToolPlan("named", body.tools, tool.function.name,
                        ("json", parameters_schema(tool, body.tools.index(tool)), "tools"))
    schema = _calls_schema(body.tools, body.parallel_tool_calls)
    if choice == "required":
        return ToolPlan("required", body.tools, constraint=("json", schema, "tools"))
    return ToolPlan("auto", body.tools, constraint=("grammar", _or_text(schema, JSON_OPTIONS, "["), "tools"))


def _typed_properties(parameters: dict) -> dict | None:
    """A function's properties as the XML readers type their values: each property's schema with the JSON types
    `schema_kinds` finds for it (through `$ref`, `anyOf`, `const`, `enum`) as its `type`."""
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        return properties
    defs = {k: parameters[k] for k in ("$defs", "definitions") if isinstance(parameters.get(k), dict)}
    return {key: {**sub, "type": kinds} if isinstance(sub, dict) and (kinds := schema_kinds(sub, defs)) else sub
            for key, sub in properties.items()}


def _check_xml_names(tools: list[Tool]) -> None:
    """A 400 for a parameter name Qwen3-Coder's XML cannot carry: `<parameter=NAME>` ends at the first `>` and line,
    and its readers (ours, vLLM's) take names of 1 to 256 characters without `<`, `>` or a line break, their ends
    trimmed."""
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters or {}
        properties = parameters.get("properties")
        for key in [*(properties if isinstance(properties, dict) else ()), *_required(parameters)]:
            if not key or len(key) > 256 or key != key.strip() or any(c in key for c in "<>\r\n"):
                raise APIError(400, f"tools[{i}]: the parameter name {key[:60]!r} cannot be written in this model's "
                                    "XML tool calls (<parameter=NAME>): give names of 1 to 256 characters without "
                                    "'<', '>' or line breaks, and no spaces at their ends", "tools", "invalid_value")


def _required(schema: dict) -> list[str]:
    """An object schema's required keys (none where `required` is not a list of names)."""
    required = schema.get("required")
    return [key for key in required if isinstance(key, str)] if isinstance(required, list) else []


def _hermes_plan(choice, tools: list[Tool], tool: Tool | None, parallel: bool, special: dict[str, int]) -> ToolPlan:
    """Hermes' format: "required" and a named function held to calls in the tags; "auto" not held at all (the
    model's own format, read as it comes by HermesReader)."""
    if choice == "auto":
        return ToolPlan("auto", tools, format="hermes")
    if tool is None:
        return ToolPlan("required", tools, constraint=("grammar", _hermes_grammar(
            _call_variants(tools, "arguments"), parallel, special), "tools"), format="hermes")
    return ToolPlan("named", tools, tool.function.name, ("grammar", _hermes_grammar(
        _call_variants([tool], "arguments", tools.index(tool)), False, special), "tools"), format="hermes")


def _llama_plan(choice, tools: list[Tool], tool: Tool | None) -> ToolPlan:
    """Llama 3's format: the answer is one call, `{"name": ..., "parameters": {...}}`, spaced as Meta's template
    writes it (the template renders one call a turn); "auto" takes that or text that does not start with "{"."""
    call = _call_variants(tools, "parameters") if tool is None else _call_variants([tool], "parameters",
                                                                                   tools.index(tool))
    if choice == "auto":
        lark = _or_text(call, SPACED, "{")
    else:
        lark = f"start: call\ncall: %json {json.dumps({**call, 'x-guidance': SPACED})}\n"
    return _held_plan(choice, tools, tool, lark, "llama3_json")


def _mistral_plan(choice, tools: list[Tool], tool: Tool | None, parallel: bool, special: dict[str, int]) -> ToolPlan:
    """Mistral's format: `[TOOL_CALLS]`, a space or none (v0.3's template writes one, later ones none), then a JSON
    array of `{"name": ..., "arguments": {...}}` spaced as the template's `tojson` writes it; "auto" takes that or
    text that does not start with "[". The tag is its special token where the tokenizer has one (`<[id]>`)."""
    chosen = tools if tool is None else [tool]
    variants = _call_variants(chosen, "arguments", 0 if tool is None else tools.index(tool))
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants["anyOf"]},
                              "$defs": variants["$defs"]}
    if not parallel or tool is not None:
        schema["maxItems"] = 1
    tag = _token(MISTRAL_TAG, special)
    lark = _calls_or_text(f'calls: {tag} " "? array\narray: %json {json.dumps({**schema, "x-guidance": SPACED})}\n',
                          choice == "auto")
    return _held_plan(choice, tools, tool, lark, "mistral")


def _mistral_args_plan(choice, tools: list[Tool], tool: Tool | None, parallel: bool,
                       special: dict[str, int]) -> ToolPlan:
    """Mistral's later format: each call `[TOOL_CALLS]`, the function's name, `[ARGS]` and its arguments' JSON (spaced
    as `tojson` writes it, held to the function's schema); one call for a named function or without
    `parallel_tool_calls`; "auto" takes calls or text that does not start with "["."""
    chosen = [(i, t) for i, t in enumerate(tools) if tool is None or t is tool]
    schemas = [json.dumps({**parameters_schema(t, i), "x-guidance": SPACED}) for i, t in chosen]
    rules = "".join(f"args_{j}: %json {schema}\n" for j, schema in enumerate(schemas))
    # a v11 template's models write an id of their own between the name and the arguments
    call_id = f"({_token(CALL_ID_TAG, special)} /[A-Za-z0-9]{{9}}/)? "
    heads = " | ".join(f"{json.dumps(t.function.name)} {call_id}{_token(ARGS_TAG, special)} args_{j}"
                       for j, (_, t) in enumerate(chosen))
    many = "+" if parallel and tool is None else ""
    # where the tag is a special token, text cannot hold it: "auto" may then be text followed by calls, as these
    # models write ("Let me check that.[TOOL_CALLS]...")
    then_calls = choice == "auto" and MISTRAL_TAG in special
    calls = f"calls: call{many}\ncall: {_token(MISTRAL_TAG, special)} ({heads})\n{rules}"
    lark = _calls_or_text(calls, choice == "auto", then_calls)
    return _held_plan(choice, tools, tool, lark, "mistral_args", text_then_calls=then_calls)


def _held_plan(choice, tools: list[Tool], tool: Tool | None, lark: str, fmt: str, **more) -> ToolPlan:
    """The plan of a choice held to `lark` in the model's own format `fmt` (a named `tool`'s, or `choice`'s)."""
    return ToolPlan("named" if tool is not None else choice, tools, None if tool is None else tool.function.name,
                    ("grammar", lark, "tools"), format=fmt, **more)


def _token(tag: str, special: dict[str, int]) -> str:
    """A grammar's element for a format's tag: its special token (`<[id]>`) where the tokenizer has one (a literal
    matches text, never a special token), else the literal."""
    return f"<[{special[tag]}]>" if tag in special else json.dumps(tag)


def _calls_or_text(rules: str, auto: bool, then_calls: bool = False) -> str:
    """A Lark grammar whose `rules` define `calls`: the answer is those calls, or with `auto` either them or text
    that does not start with "[" (the calls' first character) or whitespace, but for one space (SentencePiece
    tokenizers, Mistral 7B's, start a word with one); `then_calls`: or that text followed by calls."""
    if not auto:
        return "start: calls\n" + rules
    return f"start: calls | TEXT{' | TEXT calls' if then_calls else ''}\nTEXT: / ?[^\\[\\s](.|\\n)*/\n" + rules


MISTRAL_TAG = "[TOOL_CALLS]"  # Mistral's token before a turn's calls (before each call in the later format)
ARGS_TAG = "[ARGS]"  # ... and between a call's name and its arguments, in the later format
CALL_ID_TAG = "[CALL_ID]"  # ... and before the call's id, between the two (tokenizer v11's templates)


def _or_text(schema: dict, options: dict, opens: str) -> str:
    """A Lark grammar (llguidance's) of either JSON that `schema` allows or text that does not start with `opens`
    (that JSON's first character) or whitespace, but for one space (as `_calls_or_text`): "auto" where this server
    holds the answer."""
    calls = json.dumps({**schema, "x-guidance": options})
    return f"start: calls | TEXT\ncalls: %json {calls}\nTEXT: / ?[^\\{opens}\\s](.|\\n)*/\n"


def _named(choice, tools: list[Tool]) -> Tool:
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools",
                       "tool_choice", "invalid_value")
    return tool


def parameters_schema(tool: Tool, i: int) -> dict:
    """A function's parameter schema, of an object as OpenAI's arguments always are: none or `{}` takes any JSON
    object, a schema without a type gets "object", one of another type is a 400."""
    parameters = tool.function.parameters or {}
    kind = parameters.get("type", "object")
    if kind != "object":
        param = f"tools.{i}.function.parameters"
        raise APIError(400, f"{param}: a function's arguments are a JSON object; this schema's type is {kind!r}",
                       param, "invalid_value")
    return {**parameters, "type": "object"}


def _calls_schema(tools: list[Tool], parallel: bool) -> dict:
    """The JSON schema of a "required" answer: an array of calls, each one of the functions with its own schema."""
    variants = _call_variants(tools, "parameters")
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants["anyOf"]},
                              "$defs": variants["$defs"]}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call_variants(tools: list[Tool], arguments: str, first: int = 0) -> dict:
    """The JSON schema of one call, `{"name": ..., <arguments>: {...}}`, of any of `tools` (the first numbered
    `first` among the request's). Each function's schema becomes a root definition of its own (`$defs.tool_<i>`),
    its local `$ref`s ("#", "#/$defs/...", "#/properties/...") rebased there, so that they mean what they meant in
    the function's schema."""
    numbered = list(enumerate(tools, first))
    defs = {f"tool_{i}": _rebase(parameters_schema(tool, i), f"#/$defs/tool_{i}") for i, tool in numbered}
    variants = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                                  arguments: {"$ref": f"#/$defs/tool_{i}"}},
                 "required": ["name", arguments], "additionalProperties": False} for i, tool in numbered]
    return {"anyOf": variants, "$defs": defs}


_OPEN, _CLOSE = HERMES_TAGS = "<tool_call>", "</tool_call>"  # Hermes' tags around a call


def _hermes_grammar(call: dict, parallel: bool, special: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's) of one or more calls in Hermes' tags, each `call`'s JSON on a line of its own
    between them, as Qwen's templates show it; one call where `parallel` is false. A tag in `special` (a special
    token of the model's, and its id) is that token (`<[id]>`): a literal matches text, never a special token."""
    schema = json.dumps({**call, "x-guidance": SPACED})
    more = ' ("\\n" call)*' if parallel else ""
    special = special or {}
    opening = f'<[{special[_OPEN]}]> "\\n"' if _OPEN in special else f'"{_OPEN}\\n"'
    closing = f'"\\n" <[{special[_CLOSE]}]>' if _CLOSE in special else f'"\\n{_CLOSE}"'
    return f'start: call{more}\ncall: {opening} body {closing}\nbody: %json {schema}\n'


_XML_STOP = "\n</parameter>\n"  # what ends a value in Qwen3-Coder's XML, as its templates write calls
_JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}


def _xml_grammar(tools: list[Tool], first: int, parallel: bool, special: dict[str, int]) -> str:
    """A Lark grammar (llguidance's) of one or more calls in Qwen3-Coder's XML, as its templates write them (one
    call where `parallel` is false): each function's parameters in its schema's order, the required ones present
    (a required one without a property too, untyped, last), no others; each value as `_xml_value_rule` holds it.
    The tags as their special tokens where they are."""
    rules, functions = [], []
    for i, tool in enumerate(tools, first):
        schema = parameters_schema(tool, i)
        required = set(schema.get("required") or ())
        defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
        parts = []
        properties = dict(schema.get("properties") or {})
        # a required key the schema declares no property for: any value, after the declared ones
        properties.update({key: {} for key in _required(schema) if key not in properties})
        for j, (key, sub) in enumerate(properties.items()):
            rules.append(f"p{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} v{i}_{j}\n")
            rules.append(_xml_value_rule(f"v{i}_{j}", sub, defs))
            parts.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
        rules.append(f"f{i}: {json.dumps(f'<function={tool.function.name}>' + chr(10))} {' '.join(parts)}\n")
        functions.append(f"f{i}")
    more = ' ("\\n" call)*' if parallel else ""
    return (f'start: call{more}\ncall: {_token(_OPEN, special)} "\\n" ({" | ".join(functions)}) '
            f'"</function>\\n" {_token(_CLOSE, special)}\n' + "".join(rules))


_KIND_OF = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", dict: "object",
            list: "array"}


def schema_kinds(schema: Any, defs: dict | None = None, depth: int = 0) -> list[str]:
    """The JSON types a schema's values can take: its `type`; else, followed through a local `$ref` (into `defs`, the
    function's `$defs`/`definitions`) and `anyOf`/`oneOf` members, the types of its `const` or `enum` values; []
    where nothing says (any value)."""
    if not isinstance(schema, dict) or depth > 16:
        return []
    kind = schema.get("type")
    if kind is not None:
        return [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) \
            else []
    ref = schema.get("$ref")
    if isinstance(ref, str):
        for section in ("$defs", "definitions"):
            prefix = f"#/{section}/"
            table = (defs or {}).get(section)
            if ref.startswith(prefix) and isinstance(table, dict):
                return schema_kinds(table.get(ref[len(prefix):]), defs, depth + 1)
        return []
    members = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(members, list) and members:
        each = [schema_kinds(member, defs, depth + 1) for member in members]
        return [] if not all(each) else list(dict.fromkeys(k for kinds in each for k in kinds))
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values:
        kinds = [_KIND_OF.get(type(value)) for value in values]
        return [] if None in kinds else list(dict.fromkeys(kinds))
    return []


def _xml_value_rule(name: str, schema: Any, defs: dict) -> str:
    """The rule of one value in Qwen3-Coder's XML, up to its closing tag: a parameter whose schema's type is a JSON
    one (integer, number, boolean, object, array, null, or a list of them) JSON that its schema allows (its `$defs`
    the function's), spaced as the templates' `tojson`; so too one whose `anyOf`/`oneOf` members, `$ref`, `const` or
    `enum` values say it takes only such types (`schema_kinds`); an enum (or const) of strings one of them; anything
    else (a string, a parameter of no type) any text up to the closing tag (a string's length and pattern are not
    held)."""
    schema = schema if isinstance(schema, dict) else {}
    kind, enum = schema.get("type"), schema.get("enum", [schema["const"]] if "const" in schema else None)
    kinds = set(schema_kinds(schema, defs))
    refs = re.findall(r'"\$ref": "([^"]*)"', json.dumps(schema))
    local = all(ref.startswith(("#/$defs/", "#/definitions/")) for ref in refs)  # ("#/properties/..." is the root's)
    if kind in (None, "string") and isinstance(enum, list) and enum and all(
            isinstance(v, str) and "</parameter>" not in v for v in enum):
        return f"{name}: " + " | ".join(json.dumps(v + _XML_STOP) for v in enum) + "\n"
    if kinds and kinds <= _JSON_TYPES and local:
        return f"{name}: %json {json.dumps({**schema, **defs, 'x-guidance': SPACED})} {json.dumps(_XML_STOP)}\n"
    return f"{name}[stop={json.dumps(_XML_STOP)}]: /(?s:.*)/\n"


_DATA = {"const", "enum", "default", "examples"}  # keywords whose values are data, not schemas
_NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # names -> schemas


def _rebase(node, prefix: str, names: bool = False):
    """`node` with every local reference ("#...") made relative to `prefix` instead of the document's root; data
    (`const`, `enum`, ...) left as it is. `names`: `node` maps names to schemas (a `properties`). The request's
    schemas nest at most MAX_NESTING levels (protocol.ToolFields), so the recursion is bounded."""
    if isinstance(node, list):
        return [_rebase(value, prefix) for value in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if names:
            out[key] = _rebase(value, prefix)
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = prefix + value[1:]
        else:
            out[key] = value if key in _DATA else _rebase(value, prefix, key in _NAMED)
    return out


def conversation(messages: list[ChatMessage], plan: ToolPlan | None, knows_tools: bool,
                 tool_format: str | None = None, knows_developer: bool = False) -> list[dict]:
    """The messages as the chat template takes them. Earlier tool calls: as Hugging Face's `tool_calls` (arguments
    as objects) where the template knows tools, else written into the assistant's text in the "required" shape.
    Mistral's templates (those that render ids) refuse any call id but one of 9 characters: there, ids are cut to
    their last 9 (vLLM's way; this server's own Mistral ids are 9 long). Where the template has no developer role,
    developer messages are system ones, and several system messages become one, first (as vLLM renders them)."""
    def cut(id_: str | None) -> str | None:
        return id_[-9:] if tool_format in ("mistral", "mistral_args") and id_ is not None else id_

    out = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            calls = [(cut(call.id), call.function.name, _arguments(call.function.arguments, i, j))
                     for j, call in enumerate(message.tool_calls)]
            if knows_tools:
                entry["tool_calls"] = [{"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
                                       for id_, name, args in calls]
            else:
                written = _dump([{"name": name, "parameters": args} for _, name, args in calls])
                entry["content"] = f"{entry['content']}\n{written}" if entry["content"] else written
        if message.tool_call_id is not None and knows_tools:
            entry["tool_call_id"] = cut(message.tool_call_id)
        thought = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if thought is not None:  # Qwen3's template reads it (and shows it only after the last question)
            entry["reasoning_content"] = thought
        out.append(entry)
    if not knows_developer and any(entry["role"] == "developer" for entry in out):
        out = _system_first([{**entry, "role": "system"} if entry["role"] == "developer" else entry for entry in out])
    prompt = plan.system_prompt() if plan is not None and not knows_tools else None
    if prompt is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _system_first(out: list[dict]) -> list[dict]:
    """The system messages as one, first (their texts a blank line apart), where there are several or one later
    than first: templates render one system message, at the start."""
    system = [i for i, entry in enumerate(out) if entry["role"] == "system"]
    if system in ([], [0]):
        return out
    text = "\n\n".join(out[i]["content"] for i in system if out[i]["content"])
    return [{"role": "system", "content": text}, *(entry for entry in out if entry["role"] != "system")]


def _arguments(text: str, i: int, j: int) -> Any:
    param = f"messages.{i}.tool_calls.{j}.function.arguments"
    try:
        return json_value(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{param}: not JSON ({exc.msg} at character {exc.pos})", param, "invalid_value") from None
    except RecursionError:
        raise APIError(400, f"{param}: nested too deep", param, "invalid_value") from None
    except ValueError as exc:  # an integer past Python's digit limit
        raise APIError(400, f"{param}: {exc}", param, "invalid_value") from None


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# a call's head in a "required" answer, whose JSON has no whitespace and its keys in the schema's order
_HEAD = re.compile(r'(?:\[|\},)\{"name":"((?:[^"\\]|\\.)*)","parameters":')
# ... and of Llama 3's one call object (spaced, SPACED; a name as protocol.FunctionDefinition allows it)
_ONE_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "parameters": ')
# ... and of a call in Mistral's array, after its tag (spaced, SPACED)
_MISTRAL_HEAD = re.compile(r'(?:\[TOOL_CALLS\] ?\[|\}, )\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class _ValueScanner:
    """Finds where a call's arguments (a JSON value inside the call's object) end, one piece of text at a time."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str, at: int) -> tuple[int, bool]:
        """Reads `text` from `at`: (where reading stopped, whether the value ended there). An ended value stops
        after its closing bracket, or a scalar at the enclosing object's closing brace."""
        for i in range(at, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:  # a scalar value, ended by its call's brace
                    return i, True
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False


@dataclass
class ToolCallReader:
    """Splits an answer's text into tool calls as it grows: `feed` takes the next piece of text and gives the
    content and the `tool_calls` deltas of a stream chunk (a call's first delta has its id, type and name; the rest
    add to its arguments); `end` gives what is left when the answer ends; `calls()` gives the whole calls so far,
    as a non-streamed message holds them. `name`: the function of a named choice (the whole text is its arguments),
    else None: an array of calls ("required"), or with `auto`, either that (the text starts with "[") or text.
    `single`: one call object `{"name": ..., "parameters": ...}` instead of an array of them (Llama 3's format; with
    `auto`, the text starts with "{"). `mistral`: `[TOOL_CALLS]` and an array of `{"name": ..., "arguments": ...}`
    (with `auto`, the text starts with "["), each call's id 9 letters and digits."""

    name: str | None
    auto: bool = False
    single: bool = False
    mistral: bool = False
    _calls: list[_Call] = field(default_factory=list)
    _is_text: bool | None = None  # "auto": whether the answer is text (known from its first character)
    closed: bool = False  # the calls ended whole: the array's "]" (a named call: its object's last brace) was read
    _text: str = ""
    _at: int = 0  # how far the text has been read
    _in_arguments: bool = False
    _value: _ValueScanner = field(default_factory=_ValueScanner)

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        if self.auto and self._is_text is None and piece:
            self._is_text = not piece.startswith("{" if self.single else "[")
        if self._is_text:
            return piece, []
        return "", _merged(self._read(piece))

    def end(self) -> str:
        """An answer cut before its first call's name (max_tokens, a stop string): its text, as content."""
        return self._text if not self._calls else ""

    def finish(self) -> tuple[str, list[dict]]:
        """The answer ended: what is left of it, as content and call deltas (here, `end`'s content)."""
        return self.end(), []

    def _read(self, piece: str):
        if self._finished():  # what follows the calls (EOS text under min_tokens, say) is no call's
            return
        self._text += piece
        if self.name is not None and not self._calls:  # a named call: the whole text is its arguments' object
            self._calls.append(_Call(self._new_id(), self.name))
            self._in_arguments = True
            yield _start(self._calls, 0)
        while True:
            if not self._in_arguments:
                head = self._head()
                if head is None:
                    return
                self._calls.append(_Call(self._new_id(), json.loads(f'"{head.group(1)}"')))
                yield _start(self._calls, len(self._calls) - 1)
                self._at, self._in_arguments, self._value = head.end(), True, _ValueScanner()
            start = self._at
            self._at, ended = self._value.scan(self._text, self._at)
            if self._at > start:
                yield _more(self._calls, self._text[start:self._at])
            if not ended:
                return
            self._in_arguments = False
            if self._arguments_ended():
                return

    def _finished(self) -> bool:
        return self.closed

    def _new_id(self) -> str:
        return _mistral_id() if self.mistral else _call_id()

    def _head(self) -> re.Match | None:
        """The next call's head where the text has it whole; else None, and `closed` where the calls ended."""
        one_read = self.single and self._calls  # Llama 3's answer holds one call
        heads = _ONE_HEAD if self.single else _MISTRAL_HEAD if self.mistral else _HEAD
        head = None if one_read else heads.match(self._text, self._at)
        if head is None:
            self.closed = self._text.startswith("}" if self.single else "}]", self._at) and bool(self._calls)
        return head

    def _arguments_ended(self) -> bool:
        """A call's arguments ended: whether the answer's calls did (a named call's one object)."""
        self.closed = self.name is not None
        return self.closed

    def calls(self) -> list[dict]:
        return _listed(self._calls)


# a call's head in a held answer's tag (the grammar's spaced JSON, a name as protocol.FunctionDefinition allows it)
_HELD_HEAD = re.compile(r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


@dataclass
class ArgsReader(ToolCallReader):
    """ToolCallReader's counterpart for Mistral's later format, held by its grammar: calls, each `[TOOL_CALLS]`, a
    name, `[ARGS]` and the arguments' JSON object (streamed as they come); with `auto`, text that does not start
    with "[" is content. `closed`: the last call's arguments ended (more may follow: then it is False again)."""

    then_calls: bool = False  # with `auto`: text may be followed by calls (content, then the calls read from the tag)
    _id: str | None = None  # the id the model wrote in the head just read (after [CALL_ID]), if it wrote one
    _held: str = ""  # text that may begin the tag (then_calls)

    def _finished(self) -> bool:
        return False

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        if not (self.auto and self.then_calls) or self._is_text is False or (self._is_text is None and
                                                                             piece.startswith("[")):
            return super().feed(piece)
        if not piece:
            return "", []
        self._is_text, text = True, self._held + piece
        at = text.find(MISTRAL_TAG)
        if at < 0:
            keep = tag_start(text, MISTRAL_TAG)
            self._held = text[len(text) - keep:] if keep else ""
            return text[:len(text) - keep], []
        self._is_text, self._held = False, ""
        return text[:at], _merged(self._read(text[at:]))

    def end(self) -> str:
        held, self._held = self._held, ""
        return held if self._is_text else super().end()

    def _new_id(self) -> str:
        return self._id or _mistral_id()

    def _head(self) -> re.Match | None:
        head = _ARGS_HEAD.match(self._text, self._at)
        self._id = head.group(2) if head is not None else None
        # closed while nothing follows the last call's arguments (a next head begun is not whole yet)
        self.closed = self.closed and head is None and self._at == len(self._text)
        return head

    def _arguments_ended(self) -> bool:
        self.closed = True
        return False


# a call's head in Mistral's later format (a name as protocol.FunctionDefinition allows it)
_ARGS_HEAD = re.compile(r"\[TOOL_CALLS\]([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\]([A-Za-z0-9]{9}))?\[ARGS\]")


@dataclass
class HermesReader:
    """ToolCallReader's counterpart for Hermes' format: text, and calls each in `<tool_call>` tags,
    `{"name": ..., "arguments": {...}}`. `held`: the answer is held to calls by a grammar ("required", a named
    function), so each call's arguments stream as they come; else ("auto") the model writes what it likes, and a
    block becomes a call once it is whole (at its closing tag; a call whose closing tag was left out before the next
    call's opening one, too) and is one: a JSON object with a name and an object of arguments (or `parameters`, or
    the arguments' JSON in a string), in any order and spacing. A block that is no call stays text. Text that may
    begin a tag is held back until it is known not to; whitespace after a call is no content. `forced`: a grammar
    holds the answer to calls, each read whole by `parse` (Qwen3-Coder's XML under "required" or a named function):
    a call the answer's end cut short is no text either (`held` implies it)."""

    held: bool = False
    forced: bool = False
    parse: Callable[[str], Any] = field(default=None)  # a free block's call (default: JSON's; xml_call's UNFINISHED)
    _calls: list[_Call] = field(default_factory=list)
    _whole: int = 0  # calls that ended whole
    _text: str = ""
    _at: int = 0
    _search: int = 0  # where the search for a free block's end goes on (what came before holds no tag)
    _state: str = "text"  # "text", "head" (after an opening tag), "arguments", "tail" (after them, to the closing tag)
    _after_call: bool = False
    _value: _ValueScanner = field(default_factory=_ValueScanner)

    @property
    def closed(self) -> bool:
        """A call ended whole and none is open."""
        return self._whole > 0 and self._state == "text"

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self._text += piece
        content: list[str] = []
        deltas = _merged(self._read(content))
        return "".join(content), deltas

    def end(self) -> str:
        """What is left when the answer ends: held-back text, or an opened block that made no call (of an answer a
        grammar holds to calls, nothing: what is left is a tag or a call cut short)."""
        rest = self._text[self._at:]
        self._at = len(self._text)
        if self.held or self.forced:
            return ""
        if self._state == "text":
            return self._content(rest)
        if self._state == "head":
            return self._content(_OPEN + rest)
        return ""  # the rest of a call cut short

    def finish(self) -> tuple[str, list[dict]]:
        """The answer ended: `end`'s content, or, where it ended inside a free block that is a call (its closing tag
        left out, as models do at the end of an answer; vLLM's hermes and qwen3_coder parsers read such a call too),
        that call."""
        if self._state == "head" and not (self.held or self.forced):  # (a held call cut short is none)
            call = (self.parse or _whole_call)(self._text[self._at:])
            if call is not None and call is not UNFINISHED:
                self._at, self._state = len(self._text), "text"
                self._calls.append(_Call(_call_id(), call[0]))
                self._whole += 1
                return "", _merged([_start(self._calls, len(self._calls) - 1), _more(self._calls, call[1])])
        return self.end(), []

    def calls(self) -> list[dict]:
        return _listed(self._calls)

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def _read(self, content: list[str]):
        text = self._text
        while True:
            if self._state == "text":
                i = text.find(_OPEN, self._at)
                end = i if i >= 0 else len(text) - tag_start(text, _OPEN, self._at)
                content.append(self._content(text[self._at:end]))
                self._at = end
                if i < 0:
                    return
                self._at = self._search = i + len(_OPEN)
                self._state = "head"
            elif self._state == "head" and self.held:
                head = _HELD_HEAD.match(text, self._at)
                if head is None:
                    return  # more to come (the grammar writes nothing else)
                self._calls.append(_Call(_call_id(), head.group(1)))
                yield _start(self._calls, len(self._calls) - 1)
                self._at, self._state, self._value = head.end(), "arguments", _ValueScanner()
            elif self._state == "head":
                close = text.find(_CLOSE, self._search)
                if close < 0:
                    self._search = max(self._at, len(text) - len(_CLOSE) + 1)
                    return  # more to come (or, at the end, text)
                after = close + len(_CLOSE)
                parse = self.parse or _whole_call
                call = parse(text[self._at:close])
                if call is UNFINISHED:  # (the closing tag was a value's text: the block ends at a later one)
                    self._search = close + len(_CLOSE)
                    continue
                inner = text.find(_OPEN, self._at, close)
                if call is None and inner >= 0:  # a call whose closing tag was left out before the next one's?
                    call = parse(text[self._at:inner], ended=True)
                    after = inner if call is not None else after
                if call is None:
                    content.append(self._content(text[self._at - len(_OPEN):after]))
                else:
                    self._calls.append(_Call(_call_id(), call[0]))
                    yield _start(self._calls, len(self._calls) - 1)
                    yield _more(self._calls, call[1])
                    self._whole, self._after_call = self._whole + 1, True
                self._at, self._state = after, "text"
            elif self._state == "arguments":
                start = self._at
                self._at, ended = self._value.scan(text, self._at)
                if self._at > start:
                    yield _more(self._calls, text[start:self._at])
                if not ended:
                    return
                self._state = "tail"
            else:  # "tail": the call's closing brace, then its closing tag
                close = text.find(_CLOSE, self._at)
                if close < 0:
                    return
                self._at, self._state = close + len(_CLOSE), "text"
                self._whole, self._after_call = self._whole + 1, True


def _whole_call(block: str, ended: bool = False) -> tuple[str, str] | None:
    """A free block's call, (name, arguments' JSON text), where it is one (`ended`: as xml_call's; JSON ends
    itself)."""
    try:
        call = json.loads(block)
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # the arguments' JSON in a string, as OpenAI's API carries them
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        call = call["name"], _dump(arguments)
        "".join(call).encode()  # a lone surrogate ("\\ud83d") is no text a response can carry
        return call
    except (ValueError, RecursionError):  # not JSON, an integer past Python's digit limit, a lone surrogate
        return None


# Qwen3-Coder's and Qwen3.5's calls (format "qwen3_xml"), each in Hermes' tags: the function, then its arguments,
# one block each, the value as text (`<parameter=city>\nParis\n</parameter>`). A value ends at a closing tag that
# the next argument, the function's end or another call follows (so a value may hold the tag itself: code, docs),
# or, its closing tag left out, where the next one begins.
_XML_FUNCTION = re.compile(r"\s*<function=\s*([A-Za-z0-9_-]{1,64})\s*>")  # a name as the API allows it
_XML_PARAMETER = re.compile(r"<parameter=([^<>\n]{1,256})>(.*?)(?:</parameter>\s*(?=<parameter=|<tool_call>|<function="
                            r"|\Z)|(?=<parameter=)|\Z)", re.S)
_XML_END = "</function>"
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")


class _Unfinished:
    """`xml_call`'s answer for a block whose function has not ended yet: the `</tool_call>` that ended the block may
    be a value's text, and the block goes on to the next one."""


UNFINISHED = _Unfinished()


def xml_call(block: str, properties: dict[str, dict], ended: bool = False) -> tuple[str, str] | _Unfinished | None:
    """A free block's call in Qwen3-Coder's XML, (name, arguments' JSON text), where it is one: `<function=NAME>`,
    then `<parameter=KEY>VALUE</parameter>` for each argument, then `</function>`, with nothing but whitespace
    around them; UNFINISHED before its `</function>`, unless the block `ended` (the next call's opening tag came:
    both closing tags were left out). `properties`: each function's parameters' schemas, by function name; a value
    becomes what its schema says (`xml_value`)."""
    head = _XML_FUNCTION.match(block)
    if head is None:
        return None
    name, body = head.group(1), block[head.end():]
    end = body.rfind(_XML_END)
    if end < 0 and not ended:
        return UNFINISHED
    if end >= 0:
        if body[end + len(_XML_END):].strip():
            return None
        body = body[:end]
    schemas = properties.get(name) if isinstance(properties.get(name), dict) else {}
    arguments, at = {}, 0
    for parameter in _XML_PARAMETER.finditer(body):
        if body[at:parameter.start()].strip():
            return None  # text between the arguments: no call
        key = parameter.group(1).strip()
        arguments[key] = xml_value(parameter.group(2), schemas.get(key))
        at = parameter.end()
    if body[at:].strip():
        return None
    return _xml_result(name, arguments)


def _xml_result(name: str, arguments: dict) -> tuple[str, str] | None:
    """A read XML call as (name, arguments' JSON text), or None where it is no text a response can carry (a lone
    surrogate from an argument's JSON, "\\ud83d")."""
    call = name, _dump(arguments)
    try:
        "".join(call).encode()
    except UnicodeEncodeError:
        return None
    return call


def held_xml_call(block: str, properties: dict[str, dict], ended: bool = False) -> tuple[str, str] | _Unfinished | None:
    """A block of an answer `_xml_grammar` held, read as the grammar writes it: `<function=NAME>` and a newline,
    then for each argument `<parameter=KEY>`, a newline, the value and `_XML_STOP` (the first one after the value's
    start ends it: the grammar's stop), then `</function>`. Unlike `xml_call`'s reading of free text, tags and text
    inside a value stay the value's; UNFINISHED until the function's end (`ended` changes nothing: a held block
    ends only so)."""
    head = _XML_FUNCTION.match(block)
    if head is None:
        return None
    name, at, arguments = head.group(1), head.end(), {}
    schemas = properties.get(name) if isinstance(properties.get(name), dict) else {}
    at += block.startswith("\n", at)
    while block.startswith("<parameter=", at):
        key_end = block.find(">\n", at)
        value_end = block.find(_XML_STOP, key_end + 2) if key_end >= 0 else -1
        if value_end < 0:
            return UNFINISHED
        key = block[at + len("<parameter="):key_end]
        arguments[key] = xml_value("\n" + block[key_end + 2:value_end] + "\n", schemas.get(key))
        at = value_end + len(_XML_STOP)
    if not block.startswith(_XML_END, at):
        return UNFINISHED if len(block) - at < len(_XML_END) and _XML_END.startswith(block[at:]) else None
    if block[at + len(_XML_END):].strip():
        return None
    return _xml_result(name, arguments)


def xml_value(text: str, schema: Any) -> Any:
    """An XML argument's value: its text less the newline the template writes on each side, as its schema's type
    says (vLLM's qwen3_coder parser's reading): "integer" and "number" numbers, "boolean" true or false, "object" and
    "array" JSON (strict: no NaN), None for the text `null` (unless the schema allows strings alone) and for `None`
    (Python's spelling, as a template's `| string` writes it) where the schema allows null or no string; text that
    is none of the types the schema allows, and a value of a parameter the schema does not type (a string, most
    often), stays the text."""
    text = text[1:] if text.startswith("\n") else text
    text = text[:-1] if text.endswith("\n") else text
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds if isinstance(k, str)] if isinstance(
        kinds, list) else []
    bare = text.strip()
    if (bare.lower() == "null" and kinds != ["string"]) or (
            bare == "None" and kinds and ("null" in kinds or "string" not in kinds)):
        return None
    for kind in kinds:
        try:
            if kind in ("integer", "number") and _INTEGER.fullmatch(bare):
                return int(bare)
            if kind == "number" and math.isfinite(value := float(bare)) and "_" not in bare:
                return value
            if kind == "boolean" and bare.lower() in ("true", "false"):
                return bare.lower() == "true"
            if kind in ("object", "array"):
                value = json_value(bare)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except (ValueError, RecursionError):  # not of this kind (or past Python's digit limit): the next one
            continue
    return text


def _start(calls: list[_Call], index: int) -> dict:
    call = calls[index]
    return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}


def _more(calls: list[_Call], arguments: str) -> dict:
    """The last call's next piece of arguments."""
    calls[-1].arguments += arguments
    return {"index": len(calls) - 1, "function": {"arguments": arguments}}


def _merged(deltas) -> list[dict]:
    """Deltas of one piece, one per call it touches (a call's head and its first arguments in one)."""
    out: list[dict] = []
    for delta in deltas:
        if out and out[-1]["index"] == delta["index"]:
            out[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            out.append(delta)
    return out


def _listed(calls: list[_Call]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_ID_CHARACTERS = string.ascii_letters + string.digits


def _mistral_id() -> str:
    """A call id as Mistral's templates demand: 9 letters and digits."""
    return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))
