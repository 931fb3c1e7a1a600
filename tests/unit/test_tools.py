"""Tool calling's pieces without a server: the plan a request's tools make, the conversation the chat template gets,
and the reader that splits a forced answer into OpenAI's tool calls as it grows (checked against json.loads)."""

from __future__ import annotations

import json
import random

import pytest

from app.server.errors import APIError
from app.server.protocol import ChatCompletionRequest
from app.server.tools import ToolCallReader, conversation
from app.server.tools import plan as tool_plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"$ref": "#/$defs/query"}}, "$defs": {"query": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def plan(body: ChatCompletionRequest, knows_tools: bool = False):
    return tool_plan(body, knows_tools)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def refused(param: str, words: str, knows_tools: bool = False, **fields) -> None:
    with pytest.raises(APIError) as caught:
        plan(request(**fields), knows_tools)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


def test_the_plan_of_each_tool_choice():
    assert plan(request()) is None
    assert plan(request(tool_choice="none")) is None
    none = plan(request(tools=[WEATHER], tool_choice="none"))
    assert none.mode == "none" and not none.forced and none.constraint is None
    named = plan(request(tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "search"}}))
    assert named.mode == "named" and named.name == "search"
    assert named.constraint == ("json", SEARCH["function"]["parameters"], "tools")  # its $defs stay at its root
    required = plan(request(tools=[WEATHER, SEARCH], tool_choice="required"))
    kind, schema, param = required.constraint
    assert (kind, param) == ("json", "tools") and schema["minItems"] == 1 and "maxItems" not in schema
    assert [v["properties"]["name"] for v in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                           {"const": "search"}]
    assert schema["$defs"] == {"query": {"type": "string"}}  # moved to the root, where "#/$defs/query" points
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert "$defs" in SEARCH["function"]["parameters"]  # the request's own schema is left as it was
    one = plan(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert one.constraint[1]["maxItems"] == 1
    auto = plan(request(tools=[WEATHER, SEARCH]))  # the default with tools
    kind, lark, param = auto.constraint
    assert (auto.mode, kind, param) == ("auto", "grammar", "tools") and lark.startswith("start: calls | TEXT\n")
    calls_schema = json.loads(lark.split("%json ", 1)[1].split("\n", 1)[0])
    assert calls_schema == {**required.constraint[1], "x-guidance": {"whitespace_flexible": False}}
    bare = plan(request(tools=[{"type": "function", "function": {"name": "ping"}}],
                        tool_choice={"type": "function", "function": {"name": "ping"}}))
    assert bare.constraint[1] == {"type": "object"}  # no parameters: any JSON object


def test_tool_choices_that_cannot_be_served_are_400s_naming_the_field():
    refused("tool_choice", "needs tools", tool_choice="required")
    refused("tool_choice", '"auto"', knows_tools=True, tools=[WEATHER])  # as vLLM without a parser
    refused("tool_choice", "not among tools", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}})
    refused("tools", "two tools are named 'get_weather'", tools=[WEATHER, WEATHER], tool_choice="required")
    refused("tool_choice", "not both", tools=[WEATHER], tool_choice="required",
            response_format={"type": "json_object"})
    other = json.loads(json.dumps(SEARCH))
    other["function"]["name"] = "lookup"
    other["function"]["parameters"]["$defs"]["query"] = {"type": "integer"}
    refused("tools", "define $defs.query differently", tools=[SEARCH, other], tool_choice="required")


def test_a_template_without_tools_gets_them_in_a_system_message_and_past_calls_in_the_text():
    body = request(tools=[WEATHER], tool_choice="required", messages=[
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])
    blind = conversation(body.messages, plan(body), knows_tools=False)
    assert blind[0]["role"] == "system" and blind[0]["content"].startswith("Be brief.\n\nAnswer by calling")
    assert '"name": "get_weather"' in blind[0]["content"]
    assert blind[2] == {"role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'}
    assert blind[3] == {"role": "tool", "content": "18 C"}
    knows = conversation(body.messages, plan(body), knows_tools=True)
    assert knows[0] == {"role": "system", "content": "Be brief."}
    assert knows[2]["tool_calls"] == [{"id": "c1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert knows[3]["tool_call_id"] == "c1"
    named = request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    first = conversation(named.messages, plan(named), knows_tools=False)[0]
    assert first["role"] == "system" and first["content"].startswith("Call the function get_weather")
    bad = request(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(APIError) as caught:
        conversation(bad.messages, None, knows_tools=True)
    assert caught.value.param == "messages.0.tool_calls.0.function.arguments"


CALLS = [{"name": "get_weather", "parameters": {"city": "Paris \"Île\" {de} [France]\\", "days": [1, {"x": []}]}},
         {"name": "search", "parameters": {}},
         {"name": "odd\"name", "parameters": {"q": "},{\"name\":\"trap\",\"parameters\":"}},
         {"name": "scalar", "parameters": 42}]


def test_the_reader_splits_a_required_answer_at_any_piece_boundary():
    text = json.dumps(CALLS, separators=(",", ":"), ensure_ascii=False)  # as the grammar writes it
    rng = random.Random(0)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 30))) if trial else list(range(1, len(text)))
        reader, streamed = ToolCallReader(None), {}
        for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
            content, deltas = reader.feed(piece)
            assert content == ""
            for delta in deltas:
                call = streamed.setdefault(delta["index"], {"arguments": ""})
                if "id" in delta:
                    assert "name" not in call and delta["type"] == "function"  # the head comes once, first
                    call.update(id=delta["id"], name=delta["function"]["name"])
                call["arguments"] += delta["function"]["arguments"]
        whole = reader.calls()
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == \
            [(c["name"], c["parameters"]) for c in CALLS]
        assert [streamed[i] for i in range(len(CALLS))] == [
            {"arguments": c["function"]["arguments"], "id": c["id"], "name": c["function"]["name"]} for c in whole]
        assert len({c["id"] for c in whole}) == len(CALLS) and all(c["id"].startswith("chatcmpl-tool-") for c in whole)


def test_the_reader_of_a_named_function_and_of_a_cut_answer():
    reader = ToolCallReader("get_weather")
    first = reader.feed("")[1]
    assert first == [{"index": 0, "id": reader.calls()[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}]
    assert reader.feed('{"city":') == ("", [{"index": 0, "function": {"arguments": '{"city":'}}])
    reader.feed('"Rome"}')
    assert [c["function"] for c in reader.calls()] == [{"name": "get_weather", "arguments": '{"city":"Rome"}'}]
    cut = ToolCallReader(None)
    cut.feed('[{"name":"search","parameters":{"q":"ab')  # max_tokens came first: the call so far
    assert [c["function"] for c in cut.calls()] == [{"name": "search", "arguments": '{"q":"ab'}]


def test_the_reader_of_auto_tells_text_from_calls_by_the_first_character():
    text = ToolCallReader(None, auto=True)
    assert text.feed("") == ("", []) and text.feed("Hello") == ("Hello", []) and text.feed(" [x]") == (" [x]", [])
    assert text.calls() == []
    calls = ToolCallReader(None, auto=True)
    assert calls.feed("[") == ("", [])
    content, deltas = calls.feed('{"name":"search","parameters":{"q":"x"}}]')
    assert content == "" and [d["function"] for d in deltas] == [{"name": "search", "arguments": ""},
                                                                  {"arguments": '{"q":"x"}'}]
