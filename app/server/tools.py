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
assistant's text in that shape. "auto" with a template that knows tools would need a parser of that model's own
tool-call format (Hermes' `<tool_call>` tags, Llama's JSON, ...), which this server does not have: a 400 naming
`tool_choice`, as vLLM's without `--tool-call-parser`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.engine.structured import JSON_OPTIONS
from app.server.errors import APIError
from app.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest, Tool


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the server."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[Tool]
    name: str | None = None  # the function a named choice forces
    constraint: tuple[str, Any, str] | None = None  # (kind, value, param), as SamplingFields.constraint()

    @property
    def forced(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def reader(self) -> ToolCallReader:
        return ToolCallReader(self.name if self.mode == "named" else None, auto=self.mode == "auto")

    def finish_reason(self, reason: str | None, reader: ToolCallReader) -> str | None:
        """An array of calls ("required", "auto") that ended whole is `"tool_calls"` (vLLM 0.11+); a named call, or
        an answer cut short (a stop string, `max_tokens`), keeps the engine's reason."""
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


def plan(body: ChatCompletionRequest | TokenizeRequest, knows_tools: bool,
         constrained: bool = False) -> ToolPlan | None:
    """The request's tool plan (None: no tools, no tool_choice); a 400 naming the field where they do not fit.
    `knows_tools`: whether the chat template renders tools (then "auto" would need the model's own format);
    `constrained`: whether the request asks for a structured output too."""
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
    if choice == "auto" and knows_tools:
        raise APIError(400, 'tool_choice "auto" (the default when tools are given) with a chat template that renders '
                            "tools needs a parser of that model's own tool-call format, which this server does not "
                            'have yet: ask for "required" (one or more calls), a named function ({"type": '
                            '"function", "function": {"name": ...}}) or "none"', "tool_choice", "invalid_value")
    if choice == "none":
        return ToolPlan("none", body.tools)
    if constrained:
        raise APIError(400, "give tools (with tool_choice other than \"none\") or structured outputs "
                            "(response_format, structured_outputs), not both", "tool_choice", "invalid_value")
    if choice == "required":
        schema = _calls_schema(body.tools, body.parallel_tool_calls)
        return ToolPlan("required", body.tools, constraint=("json", schema, "tools"))
    if choice == "auto":
        schema = {**_calls_schema(body.tools, body.parallel_tool_calls), "x-guidance": JSON_OPTIONS}
        lark = f"start: calls | TEXT\ncalls: %json {json.dumps(schema)}\nTEXT: /[^\\[\\s](.|\\n)*/\n"
        return ToolPlan("auto", body.tools, constraint=("grammar", lark, "tools"))
    name = choice.function.name
    tool = next((t for t in body.tools if t.function.name == name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools",
                       "tool_choice", "invalid_value")
    return ToolPlan("named", body.tools, name, ("json", parameters_schema(tool, body.tools.index(tool)), "tools"))


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
    """The JSON schema of a "required" answer: an array of calls, each one of the functions with its own schema.
    Each function's schema becomes a root definition of its own (`$defs.tool_<i>`), its local `$ref`s ("#",
    "#/$defs/...", "#/properties/...") rebased there, so that they mean what they meant in the function's schema."""
    defs = {f"tool_{i}": _rebase(parameters_schema(tool, i), f"#/$defs/tool_{i}") for i, tool in enumerate(tools)}
    variants = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                                  "parameters": {"$ref": f"#/$defs/tool_{i}"}},
                 "required": ["name", "parameters"], "additionalProperties": False} for i, tool in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


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


def conversation(messages: list[ChatMessage], plan: ToolPlan | None, knows_tools: bool) -> list[dict]:
    """The messages as the chat template takes them. Earlier tool calls: as Hugging Face's `tool_calls` (arguments
    as objects) where the template knows tools, else written into the assistant's text in the "required" shape."""
    out = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            calls = [(call.id, call.function.name, _arguments(call.function.arguments, i, j))
                     for j, call in enumerate(message.tool_calls)]
            if knows_tools:
                entry["tool_calls"] = [{"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
                                       for id_, name, args in calls]
            else:
                written = _dump([{"name": name, "parameters": args} for _, name, args in calls])
                entry["content"] = f"{entry['content']}\n{written}" if entry["content"] else written
        if message.tool_call_id is not None and knows_tools:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    prompt = plan.system_prompt() if plan is not None and not knows_tools else None
    if prompt is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(text: str, i: int, j: int) -> Any:
    param = f"messages.{i}.tool_calls.{j}.function.arguments"
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{param}: not JSON ({exc.msg} at character {exc.pos})", param, "invalid_value") from None
    except RecursionError:
        raise APIError(400, f"{param}: nested too deep", param, "invalid_value") from None


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# a call's head in a "required" answer, whose JSON has no whitespace and its keys in the schema's order
_HEAD = re.compile(r'(?:\[|\},)\{"name":"((?:[^"\\]|\\.)*)","parameters":')


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallReader:
    """Splits an answer's text into tool calls as it grows: `feed` takes the next piece of text and gives the
    content and the `tool_calls` deltas of a stream chunk (a call's first delta has its id, type and name; the rest
    add to its arguments); `calls()` gives the whole calls so far, as a non-streamed message holds them. `name`: the
    function of a named choice (the whole text is its arguments), else None: an array of calls ("required"), or
    with `auto`, either that (the text starts with "[") or text."""

    name: str | None
    auto: bool = False
    _calls: list[_Call] = field(default_factory=list)
    _is_text: bool | None = None  # "auto": whether the answer is text (known from its first character)
    closed: bool = False  # the calls ended whole: the array's "]" (a named call: its object's last brace) was read
    _text: str = ""
    _at: int = 0  # how far the text has been read
    _in_arguments: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        if self.auto and self._is_text is None and piece:
            self._is_text = not piece.startswith("[")
        if self._is_text:
            return piece, []
        return "", self._feed_calls(piece)

    def _feed_calls(self, piece: str) -> list[dict]:
        """The deltas of `piece`, one per call it touches (a call's head and its first arguments in one)."""
        deltas: list[dict] = []
        for delta in self._read(piece):
            if deltas and deltas[-1]["index"] == delta["index"]:
                deltas[-1]["function"]["arguments"] += delta["function"]["arguments"]
            else:
                deltas.append(delta)
        return deltas

    def _read(self, piece: str):
        if self.closed:  # what follows the calls (EOS text under min_tokens, say) is no call's
            return
        self._text += piece
        if self.name is not None and not self._calls:  # a named call: the whole text is its arguments' object
            self._calls.append(_Call(_call_id(), self.name))
            self._in_arguments = True
            yield self._start(0)
        while True:
            if not self._in_arguments:
                head = _HEAD.match(self._text, self._at)
                if head is None:
                    self.closed = self._text.startswith("}]", self._at)
                    return
                self._calls.append(_Call(_call_id(), json.loads(f'"{head.group(1)}"')))
                yield self._start(len(self._calls) - 1)
                self._at, self._in_arguments, self._depth = head.end(), True, 0
            start = self._at
            ended = self._scan()
            if self._at > start:
                self._calls[-1].arguments += self._text[start:self._at]
                yield {"index": len(self._calls) - 1, "function": {"arguments": self._text[start:self._at]}}
            if not ended:
                return
            self._in_arguments = False
            if self.name is not None:
                self.closed = True
                return

    def calls(self) -> list[dict]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self._calls]

    def _start(self, index: int) -> dict:
        call = self._calls[index]
        return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}

    def _scan(self) -> bool:
        """Reads a call's `parameters` value from `_at`; True where it ended (`_at` then at the call's closing
        brace, which the next head or the array's end reads)."""
        text = self._text
        for i in range(self._at, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                if self._depth == 0:  # a scalar value, ended by its call's brace
                    self._at = i
                    return True
                self._depth -= 1
                if self._depth == 0:
                    self._at = i + 1
                    return True
        self._at = len(text)
        return False


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
