"""Tool calling's pieces without a server: the plan a request's tools make, the conversation the chat template gets,
and the reader that splits a forced answer into OpenAI's tool calls as it grows (checked against json.loads)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from app.server.errors import APIError
from app.spec.schema import ModelSpec
from app.server.protocol import ChatCompletionRequest
from app.server.tools import HermesReader, ToolCallReader, conversation
from app.server.tools import plan as tool_plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"$ref": "#/$defs/query"}}, "$defs": {"query": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def plan(body: ChatCompletionRequest, tool_format: str | None = "array"):
    return tool_plan(body, tool_format, body.constraint() is not None)  # as the chat endpoint calls it


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def refused(param: str, words: str, tool_format: str | None = "array", **fields) -> None:
    with pytest.raises(APIError) as caught:
        plan(request(**fields), tool_format)
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
    assert [v["properties"] for v in schema["items"]["anyOf"]] == [
        {"name": {"const": "get_weather"}, "parameters": {"$ref": "#/$defs/tool_0"}},
        {"name": {"const": "search"}, "parameters": {"$ref": "#/$defs/tool_1"}}]
    assert schema["$defs"]["tool_0"] == WEATHER["function"]["parameters"]
    assert schema["$defs"]["tool_1"]["properties"]["q"] == {"$ref": "#/$defs/tool_1/$defs/query"}  # rebased
    assert SEARCH["function"]["parameters"]["properties"]["q"] == {"$ref": "#/$defs/query"}  # the request's own
    one = plan(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert one.constraint[1]["maxItems"] == 1
    auto = plan(request(tools=[WEATHER, SEARCH]))  # the default with tools
    kind, lark, param = auto.constraint
    assert (auto.mode, kind, param) == ("auto", "grammar", "tools") and lark.startswith("start: calls | TEXT\n")
    calls_schema = json.loads(lark.split("%json ", 1)[1].split("\n", 1)[0])
    assert calls_schema == {**required.constraint[1], "x-guidance": {"whitespace_flexible": False}}
    for parameters in (None, {}):  # no arguments' schema: any JSON object, as OpenAI's arguments always are
        bare = plan(request(tools=[{"type": "function", "function": {"name": "ping", "parameters": parameters}}],
                            tool_choice={"type": "function", "function": {"name": "ping"}}))
        assert bare.constraint[1] == {"type": "object"}


def test_tool_choices_that_cannot_be_served_are_400s_naming_the_field():
    refused("tool_choice", "needs tools", tool_choice="required")
    refused("tool_choice", '"auto"', tool_format=None, tools=[WEATHER])  # as vLLM without a parser
    refused("tool_choice", "not both", tool_format="hermes", tools=[WEATHER], response_format={"type": "json_object"})
    refused("tool_choice", "not among tools", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}})
    refused("tools", "two tools are named 'get_weather'", tools=[WEATHER, WEATHER], tool_choice="required")
    refused("tool_choice", "not both", tools=[WEATHER], tool_choice="required",
            response_format={"type": "json_object"})
    refused("tool_choice", 'give tool_choice "none"', tools=[WEATHER], tool_choice="required",
            continue_final_message=True, add_generation_prompt=False)
    assert plan(request(tools=[WEATHER], continue_final_message=True, add_generation_prompt=False)).mode == "none"
    refused("tools.1.function.parameters", "type is 'string'", tool_choice="required",
            tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])


def test_developer_messages_are_system_ones_where_the_template_has_no_developer_role():
    """OpenAI's newer clients send "developer" where older ones sent "system"; a template without that role gets
    them as system messages, all system messages as one first (vLLM's rendering); one that has the role keeps them."""
    body = request(messages=[{"role": "system", "content": "A."}, {"role": "user", "content": "Hi"},
                             {"role": "developer", "content": [{"type": "text", "text": "B."},
                                                               {"type": "text", "text": "C."}]}])
    assert conversation(body.messages, None, knows_tools=True) == [
        {"role": "system", "content": "A.\n\nB.\nC."}, {"role": "user", "content": "Hi"}]
    assert conversation(body.messages, None, knows_tools=True, knows_developer=True)[2] == {
        "role": "developer", "content": "B.\nC."}
    alone = request(messages=[{"role": "developer", "content": "Be brief."}, *ASK])
    assert conversation(alone.messages, None, knows_tools=True)[0] == {"role": "system", "content": "Be brief."}
    kept = request(messages=[{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}])
    assert [m["role"] for m in conversation(kept.messages, None, knows_tools=True)] == ["user", "system"]


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
    deep = request(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}])
    with pytest.raises(APIError) as caught:
        conversation(deep.messages, None, knows_tools=True)
    assert caught.value.status == 400 and "nested too deep" in caught.value.message


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
            assert len({d["index"] for d in deltas}) == len(deltas)  # one delta a call a chunk, as OpenAI
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
        assert reader.closed


def test_the_reader_of_a_named_function_and_of_a_cut_answer():
    reader = ToolCallReader("get_weather")
    first = reader.feed('{"ci')[1]
    assert first == [{"index": 0, "id": reader.calls()[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert reader.feed('ty":') == ("", [{"index": 0, "function": {"arguments": 'ty":'}}])
    assert not reader.closed
    reader.feed('"Rome"}<|im_end|>')  # EOS as text after the object (min_tokens, skip_special_tokens false)
    assert reader.feed("<|im_end|>") == ("", []) and reader.closed
    assert [c["function"] for c in reader.calls()] == [{"name": "get_weather", "arguments": '{"city":"Rome"}'}]
    cut = ToolCallReader(None)
    cut.feed('[{"name":"search","parameters":{"q":"ab')  # max_tokens or a stop string came first: the call so far
    assert [c["function"] for c in cut.calls()] == [{"name": "search", "arguments": '{"q":"ab'}] and not cut.closed
    assert cut.end() == ""
    early = ToolCallReader(None)
    assert early.feed('[{"na') == ("", []) and early.end() == '[{"na'  # cut before a call's name: content


def test_the_reader_of_auto_tells_text_from_calls_by_the_first_character():
    text = ToolCallReader(None, auto=True)
    assert text.feed("") == ("", []) and text.feed("Hello") == ("Hello", []) and text.feed(" [x]") == (" [x]", [])
    assert text.calls() == []
    calls = ToolCallReader(None, auto=True)
    assert calls.feed("[") == ("", [])
    content, deltas = calls.feed('{"name":"search","parameters":{"q":"x"}}]')
    assert content == "" and [d["function"] for d in deltas] == [{"name": "search", "arguments": '{"q":"x"}'}]


def test_refs_keep_their_meaning_in_a_required_answer():
    """Each function's schema under its own root definition: a recursive "#", a "#/properties/..." pointer and two
    functions' $defs of one name mean what they mean in each function's own schema (checked with llguidance's
    matcher on texts: what each function's schema allows, and what only a wrong reading would allow)."""
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for

    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {
        "$ref": "#"}}}, "required": ["v"], "additionalProperties": False}
    pointer = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
               "additionalProperties": False}
    one = {"type": "object", "properties": {"x": {"$ref": "#/$defs/item"}}, "$defs": {"item": {"type": "integer"}},
           "additionalProperties": False}
    two = {"type": "object", "properties": {"x": {"$ref": "#/$defs/item"}}, "$defs": {"item": {"type": "string"}},
           "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("tree", tree), ("pointer", pointer), ("one", one), ("two", two))]
    grammar = grammar_for("json", plan(request(tools=tools, tool_choice="required")).constraint[1])
    byte_tokenizer = LLTokenizer("byte")

    def allows(text: str) -> bool:
        matcher = LLMatcher(byte_tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    assert allows('[{"name":"tree","parameters":{"v":1,"kids":[{"v":2,"kids":[]}]}}]')
    assert not allows('[{"name":"tree","parameters":{"v":1,"kids":[[{"name":"tree","parameters":{"v":2}}]]}}]')
    assert allows('[{"name":"pointer","parameters":{"a":1,"b":2}}]')
    assert not allows('[{"name":"pointer","parameters":{"a":1,"b":"2"}}]')
    assert allows('[{"name":"one","parameters":{"x":5}},{"name":"two","parameters":{"x":"5"}}]')
    data = {"type": "object", "properties": {"default": {"$ref": "#/$defs/d"}, "k": {"const": {"$ref": "#/x"}}},
            "$defs": {"d": {"type": "integer"}}, "additionalProperties": False}  # a property named like a keyword
    grammar = grammar_for("json", plan(request(tools=[{"type": "function", "function": {
        "name": "data", "parameters": data}}], tool_choice="required")).constraint[1])
    assert allows('[{"name":"data","parameters":{"default":3,"k":{"$ref":"#/x"}}}]')  # the const is data
    assert not allows('[{"name":"data","parameters":{"default":"3"}}]')
    assert not allows('[{"name":"one","parameters":{"x":"5"}}]') and not allows('[{"name":"two","parameters":{"x":5}}]')


def test_a_template_is_known_by_its_variables():
    from app.server.tokenizer import template_variables

    assert template_variables("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}") == {
        "tools", "messages"}
    assert template_variables({"default": "{{ messages }}", "tool_use": "{% for t in tools %}{{ t }}{% endfor %}"}) \
        == {"messages", "tools"}
    assert "tools" not in template_variables("{# no tools here #}{{ messages[0]['content'] + ' tools' }}")
    assert template_variables(None) == set()
    assert template_variables("{% generation %}{{ x }}{% endgeneration %}") is None  # transformers' own tag


def test_a_template_that_renders_tools_gets_them_and_the_history_calls_as_objects(tmp_path):
    """Through the frontend's tokenizer (SmolLM2's, with a tool-aware template given as `model.chat_template` would
    give it): the tools and the history's calls reach the template as Hugging Face defines them, no system message
    is added; SmolLM2's own template is known not to render tools."""
    import asyncio

    from app.model.source import resolve_source
    from app.model.tokenizer import export_tokenizer, load_exported, tokenizer_json
    from app.server.tokenizer import AsyncTokenizer

    (tmp_path / "tokenizer.json").write_text(tokenizer_json(resolve_source(ModelSpec())), encoding="utf-8")
    hf = load_exported(tmp_path)
    template = ("{% if greeting %}{{ greeting }}\n{% endif %}"
                "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
                "{{ m.content }}{% if m.tool_calls %}CALLS {{ m.tool_calls | tojson }}{% endif %}"
                "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}")
    body = request(tools=[WEATHER], tool_choice="required", messages=[*ASK, {
        "role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "c1",
                                                                          "content": "18 C"}])
    tools = plan(body, tool_format=None)
    text = AsyncTokenizer(hf, 8192, template)
    try:
        assert text.template_knows_tools
        rendered = asyncio.run(text.render_chat(conversation(body.messages, tools, True),
                                                {"add_generation_prompt": False}, "messages", tools.template_tools()))
        options = ChatCompletionRequest.model_validate({"messages": ASK, "chat_template_kwargs": {
            "greeting": "Hello"}}).template_options()  # as the server passes a request's chat_template_kwargs
        greeted = asyncio.run(text.render_chat([{"role": "user", "content": "x"}], options, "messages"))
    finally:
        text.close()
    assert rendered.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert f"CALLS {json.dumps([call])}" in rendered
    assert "tool: 18 C FOR c1" in rendered and "Answer by calling" not in rendered
    assert greeted.rstrip() == "Hello\nuser: x"
    export_tokenizer(resolve_source(ModelSpec()), tmp_path / "smollm2")  # with its chat template
    own = AsyncTokenizer(load_exported(tmp_path / "smollm2"), 8192, None)
    own.close()
    assert own.tokenizer.chat_template and not own.template_knows_tools


def test_documents_go_to_the_named_template_that_renders_and_are_refused_where_it_does_not_read_them(tmp_path):
    """A tokenizer's named templates (Command R's default / tool_use / rag): transformers renders "tool_use" where
    tools are given, else "default", never "rag" here; `documents` are a 400 where the one that renders does not
    read them, though another of the names does."""
    import asyncio

    from app.model.source import resolve_source
    from app.model.tokenizer import load_exported, tokenizer_json
    from app.server.tokenizer import AsyncTokenizer

    (tmp_path / "tokenizer.json").write_text(tokenizer_json(resolve_source(ModelSpec())), encoding="utf-8")
    hf = load_exported(tmp_path)
    said = "{% for m in messages %}{{ m.content }}{% endfor %}"
    hf.chat_template = {"default": said, "rag": "{% for d in documents %}<{{ d.text }}>{% endfor %}" + said,
                        "tool_use": "{% for d in documents %}[{{ d.text }}]{% endfor %}{{ tools | length }}" + said}
    text = AsyncTokenizer(hf, 8192, None)
    options = ChatCompletionRequest.model_validate({"messages": ASK, "documents": [{"text": "D"}]}).template_options()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    try:
        with pytest.raises(APIError) as refused:
            asyncio.run(text.render_chat([{"role": "user", "content": "x"}], options, "messages"))
        rendered = asyncio.run(text.render_chat([{"role": "user", "content": "x"}], options, "messages", tools))
    finally:
        text.close()
    assert refused.value.status == 400 and refused.value.param == "documents"
    assert rendered == "[D]1x"


def test_deep_schemas_and_template_kwargs_are_refused_before_any_walk_of_them():
    deep = {"type": "string"}
    for _ in range(400):  # deeper than any recursion over it would survive
        deep = {"type": "object", "properties": {"a": deep}}
    for fields in ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": deep}}]},
                   {"chat_template_kwargs": {"x": deep}}):
        with pytest.raises(ValueError, match="nest"):
            request(**fields)
    with pytest.raises(ValueError, match="up to 65536 characters"):
        request(chat_template_kwargs={"x": "y" * 70_000})


def test_the_template_gets_only_the_kwargs_it_reads(tmp_path, monkeypatch):
    from app.model.source import resolve_source
    from app.model.tokenizer import load_exported, tokenizer_json
    from app.server.tokenizer import AsyncTokenizer

    (tmp_path / "tokenizer.json").write_text(tokenizer_json(resolve_source(ModelSpec())), encoding="utf-8")
    hf = load_exported(tmp_path)
    seen = {}
    real = hf.apply_chat_template
    monkeypatch.setattr(hf, "apply_chat_template", lambda *a, **k: seen.update(k) or real(*a, **k))
    text = AsyncTokenizer(hf, 8192, "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        options = request(chat_template_kwargs={"greeting": "Hi ", "unread": [{}] * 1000}).template_options()
        assert text._render([{"role": "user", "content": "x"}], options, None) == "Hi x"
    finally:
        text.close()
    assert seen["greeting"] == "Hi " and "unread" not in seen and seen["add_generation_prompt"] is True


HERMES = (Path(__file__).parent.parent / "hermes_chat_template.jinja").read_text()


def test_the_tool_format_is_read_from_the_template():
    from app.server.tokenizer import template_variables, tool_format

    assert tool_format(HERMES, "tools" in template_variables(HERMES)) == "hermes"
    assert tool_format("{{ tools | tojson }}{{ messages }}", True) is None  # tools in a format without a parser here
    assert tool_format({"default": "{{ messages }}", "tool_use": "{{ tools }} <tool_call>"}, True) == "hermes"
    assert tool_format("{{ messages }}", False) == "array"
    xml = "{{ tools }}<tool_call>\n<function=example_function_name>\n<parameter=x>1</parameter></function></tool_call>"
    assert tool_format(xml, True) == "qwen3_xml"  # Qwen3-Coder's and Qwen3.5's XML in the tags
    assert tool_format(XML_TEMPLATE, "tools" in template_variables(XML_TEMPLATE)) == "qwen3_xml"
    assert tool_format("{{ tools }}<tool_call>{{ name }}<arg_key>k</arg_key></tool_call>", True) is None  # GLM's


def test_hermes_plans_hold_forced_calls_in_tags_and_leave_auto_free():
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for

    auto = plan(request(tools=[WEATHER, SEARCH]), "hermes")
    assert (auto.mode, auto.constraint, auto.format) == ("auto", None, "hermes")
    assert isinstance(auto.reader(), HermesReader)
    byte_tokenizer = LLTokenizer("byte")

    def allows(choice, text: str, parallel: bool = True) -> bool:
        kind, value, _ = plan(request(tools=[WEATHER, SEARCH], tool_choice=choice, parallel_tool_calls=parallel),
                              "hermes").constraint
        matcher = LLMatcher(byte_tokenizer, grammar_for(kind, value), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    paris = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    query = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'  # the models' own spacing
    assert not allows("required", query.replace(", ", ",").replace(": ", ":"))  # compact is not theirs
    assert allows("required", paris) and allows("required", f"{paris}\n{query}")
    assert not allows("required", f"{paris}\n{query}", parallel=False) and allows("required", query, parallel=False)
    assert not allows("required", "Sure. " + paris) and not allows("required", "")
    assert not allows("required", paris.replace('"Paris"', "5"))  # the function's own schema holds
    assert not allows("required", paris.replace("get_weather", "get_time"))
    assert not allows("required", query.replace('"x"', "5"))  # its refs ("#/$defs/query": a string), rebased
    named = {"type": "function", "function": {"name": "search"}}
    assert allows(named, query) and not allows(named, paris) and not allows(named, f"{query}\n{query}")


HERMES_ANSWER = ('Let me look <that> up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"<tool_'
                 'call>\\"", "days": [1, {"x": "}"}]}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "search"}'
                 '\n</tool_call>\n<tool_call>not a call</tool_call> <tool_call>\n{"name": "scalar", "arguments": 42}'
                 '\n</tool_call><tool_call>{"name": "get\\_weather", "arguments": {}}</tool_call>\n<tool_call>{"name":'
                 ' "s", "arguments": "{\\"q\\": 1}"}<tool_call>{"name": "t", "parameters": {"a": 1}}</tool_call>\n'
                 'Done <tool')


def _read_hermes(reader: HermesReader, text: str, cuts: list[int]) -> tuple[str, dict]:
    """The content and the calls put together from the deltas of `text` fed in pieces cut at `cuts`."""
    streamed, content = {}, ""
    for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
        more, deltas = reader.feed(piece)
        content += more
        assert len({d["index"] for d in deltas}) == len(deltas)
        for delta in deltas:
            call = streamed.setdefault(delta["index"], {"arguments": ""})
            if "id" in delta:
                assert "name" not in call
                call.update(id=delta["id"], name=delta["function"]["name"])
            call["arguments"] += delta["function"]["arguments"]
    return content + reader.end(), streamed


def test_the_hermes_reader_takes_calls_out_of_free_text_at_any_piece_boundary():
    """"auto": a block is a call once whole (keys in any order, arguments in a string too, a closing tag left out
    before the next call); one that is no call (not JSON, arguments not an object, a name that is no JSON string)
    stays text; a tag inside a JSON string is the string's."""
    rng = random.Random(0)
    for trial in range(300):
        text = HERMES_ANSWER
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 40))) if trial else list(range(1, len(text)))
        reader = HermesReader()
        content, streamed = _read_hermes(reader, text, cuts)
        # the text before the first call; blocks that are no call, as text; no whitespace after a call; "<tool" held
        # back until the end, then text
        assert content == ('Let me look <that> up.\n<tool_call>not a call</tool_call> <tool_call>\n{"name": "scalar", '
                           '"arguments": 42}\n</tool_call><tool_call>{"name": "get\\_weather", "arguments": {}}'
                           '</tool_call>\nDone <tool')
        whole = reader.calls()
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == [
            ("get_weather", {"city": 'Paris "<tool_call>"', "days": [1, {"x": "}"}]}), ("search", {}),
            ("s", {"q": 1}), ("t", {"a": 1})]
        assert [streamed[i] for i in range(4)] == [
            {"arguments": c["function"]["arguments"], "id": c["id"], "name": c["function"]["name"]} for c in whole]
        assert reader.closed


def test_the_hermes_reader_of_a_held_answer_streams_arguments_as_they_come():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"<tool_call>}\\""}}\n</tool_call>'
            '\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    for cuts in ([], list(range(1, len(text))), [40]):
        reader = HermesReader(held=True)
        content, streamed = _read_hermes(reader, text, cuts)
        assert content == "" and reader.closed
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            ("get_weather", '{"city": "Paris \\"<tool_call>}\\""}'), ("search", "{}")]
    cut = HermesReader(held=True)
    assert cut.feed('<tool_call>\n{"name": "search", "arguments": {"q": "a') == (
        "", [{"index": 0, "id": cut.calls()[0]["id"], "type": "function",
              "function": {"name": "search", "arguments": '{"q": "a'}}])
    assert cut.end() == "" and not cut.closed  # the call so far, as a cut "required" answer's


def test_free_blocks_that_no_response_could_carry_stay_text():
    for block in ('{"name": "f", "arguments": {"n": ' + "9" * 5000 + "}}",  # past Python's digit limit
                  '{"name": "f", "arguments": "{\\"n\\": ' + "9" * 5000 + '}"}',
                  '{"name": "f", "arguments": {"s": "\\ud83d"}}'):  # a lone surrogate
        reader = HermesReader()
        text = f"<tool_call>{block}</tool_call>"
        assert reader.feed(text) == (text, []) and reader.calls() == [] and not reader.closed
    body = request(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"n": ' + "9" * 5000 + "}"}}]}])
    with pytest.raises(APIError) as caught:  # a client's history, the same: a 400, not a 500
        conversation(body.messages, None, knows_tools=True)
    assert caught.value.param == "messages.0.tool_calls.0.function.arguments"


def test_the_hermes_reader_of_unclosed_blocks_and_tags_begun():
    unclosed = HermesReader()
    assert unclosed.feed('<tool_call>\n{"name": "f", "arguments": {}}') == ("", [])  # whole only at its tag
    assert unclosed.end() == '<tool_call>\n{"name": "f", "arguments": {}}' and unclosed.calls() == []
    after = HermesReader()
    after.feed('<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"na')
    assert after.end() == '<tool_call>{"na' and not after.closed  # a block cut short: not "tool_calls"
    text = HermesReader()
    assert text.feed("a < b <tool_c") == ("a < b ", []) and text.feed("ar") == ("<tool_car", [])


def test_llama3_plans_hold_one_call_object_and_auto_to_that_or_text():
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for
    from app.server.tokenizer import LLAMA3_JSON, tool_format

    assert tool_format("{{ tools }} Respond in the format {" + LLAMA3_JSON + "}.", True) == "llama3_json"
    byte_tokenizer = LLTokenizer("byte")

    def allows(choice, text: str) -> bool:
        tools = plan(request(tools=[WEATHER, SEARCH], tool_choice=choice), "llama3_json")
        assert tools.format == "llama3_json"
        matcher = LLMatcher(byte_tokenizer, grammar_for(*tools.constraint[:2]), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    paris = '{"name": "get_weather", "parameters": {"city": "Paris"}}'  # spaced, as Meta's template writes calls
    query = '{"name": "search", "parameters": {"q": "x"}}'
    for choice in ("required", "auto"):
        assert allows(choice, paris) and allows(choice, query)
        assert not allows(choice, paris.replace('"Paris"', "5")) and not allows(choice, query.replace('"x"', "5"))
        assert not allows(choice, f"{paris}; {query}")  # one call a turn, as the template renders them
    assert allows("auto", "Paris is sunny.") and not allows("auto", " {") and not allows("required", "Paris")
    assert allows("auto", " Paris is sunny.") and not allows("auto", "  Paris") and not allows("auto", "\nParis")
    assert not allows("required", f"[{paris}]")
    named = {"type": "function", "function": {"name": "search"}}
    assert allows(named, query) and not allows(named, paris)


def test_the_reader_of_one_call_object_at_any_piece_boundary():
    text = '{"name": "get_weather", "parameters": {"city": "Paris \\"}{\\"", "days": [1, {"x": []}]}}'
    for cuts in ([], list(range(1, len(text))), [5, 30]):
        reader = ToolCallReader(None, auto=True, single=True)
        deltas = [d for a, b in zip([0, *cuts], [*cuts, len(text)]) for d in reader.feed(text[a:b])[1]]
        assert deltas[0]["function"]["name"] == "get_weather" and reader.closed
        assert "".join(d["function"]["arguments"] for d in deltas) == reader.calls()[0]["function"]["arguments"]
        assert json.loads(reader.calls()[0]["function"]["arguments"]) == {"city": 'Paris "}{"', "days": [1, {"x": []}]}
    cut = ToolCallReader(None, single=True)
    cut.feed('{"name": "search", "parameters": {"q": "a')
    assert [c["function"] for c in cut.calls()] == [{"name": "search", "arguments": '{"q": "a'}] and not cut.closed
    text = ToolCallReader(None, auto=True, single=True)
    assert text.feed("Sunny {x}") == ("Sunny {x}", []) and text.calls() == [] and not text.closed


def test_tags_that_are_special_tokens_are_held_as_tokens_and_kept_in_the_text(tmp_path):
    """A tokenizer that marks `<tool_call>` and `<think>` special (Hermes 2 Pro's marks its tool tags so): a decode
    that skips special tokens would leave the tags out, and the readers would never see a call or a block. A
    request whose reader looks for them keeps them (and only them), and a held answer's grammar asks for the
    tokens themselves: llguidance's literals match text, never a special token."""
    import asyncio

    from llguidance import LLMatcher

    from app.engine.output import Detokenizer
    from app.engine.params import SamplingParams
    from app.engine.structured import grammar_for, tokenizer_from_json
    from app.model.source import resolve_source
    from app.model.tokenizer import load_exported, tokenizer_json
    from app.server.tokenizer import AsyncTokenizer

    (tmp_path / "tokenizer.json").write_text(tokenizer_json(resolve_source(ModelSpec())), encoding="utf-8")
    hf = load_exported(tmp_path)
    tags = ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]"]
    hf.add_special_tokens({"additional_special_tokens": tags})
    opening, closing, think, unthink, mistral, args = hf.convert_tokens_to_ids(tags)
    text = AsyncTokenizer(hf, 8192, HERMES)
    text.close()
    assert text.special_tags == {"<tool_call>": opening, "</tool_call>": closing, "<think>": think,
                                 "</think>": unthink, "[TOOL_CALLS]": mistral, "[ARGS]": args}
    assert text.kept_tags("mistral", False) == (mistral,) and text.kept_tags("mistral_args", True) == (
        mistral, args, think, unthink)
    assert text.kept_tags("hermes", False) == (opening, closing) and text.kept_tags(None, True) == (think, unthink)
    assert text.kept_tags("array", False) == () and text.kept_tags(None, False) == ()

    body = request(tools=[WEATHER], tool_choice="required")
    grammar = plan(body, tool_format="hermes").constraint[1]
    held = tool_plan(body, "hermes", special_tags=text.special_tags).constraint[1]
    assert f"<[{opening}]>" in held and f"<[{closing}]>" in held and "<tool_call>" not in held
    lltokenizer = tokenizer_from_json(hf.backend_tokenizer.to_str(), len(hf), hf.eos_token_id)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    def ids(*texts: str) -> list[int]:  # each text apart: "<" and "tool" are not the tag's special token
        return [i for t in texts for i in hf(t, add_special_tokens=False).input_ids]

    as_tokens = [opening, *ids("\n" + call + "\n"), closing]
    spelled = ids("<", "tool", "_call", ">\n" + call + "\n", "</", "tool", "_call", ">")
    assert hf.decode(spelled) == "<tool_call>\n" + call + "\n</tool_call>" and opening not in spelled

    def allows(grammar: str, tokens: list[int]) -> bool:
        matcher = LLMatcher(lltokenizer, grammar_for("grammar", grammar), log_level=0)
        return matcher.consume_tokens(tokens) and matcher.is_accepting()

    assert allows(held, as_tokens) and not allows(held, spelled)
    assert allows(grammar, spelled) and not allows(grammar, as_tokens)  # the literal's: the text, not the token
    held_mistral = tool_plan(body, "mistral", special_tags=text.special_tags).constraint[1]
    array = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert allows(held_mistral, [mistral, *ids(array)])
    assert not allows(held_mistral, ids("[", "TOOL", "_CALLS", "]", array))
    held_args = tool_plan(body, "mistral_args", special_tags=text.special_tags).constraint[1]
    later_call = [mistral, *ids("get_weather"), args, *ids('{"city": "Paris"}')]
    assert allows(held_args, later_call)
    assert not allows(held_args, [mistral, *ids("get_weather", "[", "ARGS", "]", '{"city": "Paris"}')])
    # "auto" in the later format, its tag a token: text, calls, or text followed by calls (text cannot hold the tag)
    auto = tool_plan(request(tools=[WEATHER]), "mistral_args", special_tags=text.special_tags)
    assert auto.text_then_calls and auto.reader().then_calls
    assert allows(auto.constraint[1], [*ids("Let me check."), *later_call]) and allows(auto.constraint[1], later_call)
    assert allows(auto.constraint[1], ids("Sunny.")) and not allows(auto.constraint[1], [*later_call, *ids("Done.")])
    assert not tool_plan(request(tools=[WEATHER]), "mistral_args").text_then_calls  # a tag text could hold

    # the answer's tokens to text, one at a time as they come, then read
    answer = [think, *hf("checking", add_special_tokens=False).input_ids, unthink, *as_tokens,
              hf.convert_tokens_to_ids("<|im_end|>")]
    keep = SamplingParams(keep_special_ids=text.kept_tags("hermes", True)).keep_special_ids

    def decoded(keep: tuple[int, ...]) -> str:
        detokenizer = Detokenizer(hf, [1], True, keep)
        return "".join(detokenizer.add(t) for t in answer)

    assert decoded(()) == "checking\n" + call + "\n"  # tags skipped: no call to read
    kept = decoded(keep)
    assert kept == "<think>checking</think><tool_call>\n" + call + "\n</tool_call>"  # <|im_end|> still skipped
    reader = HermesReader(held=True)
    content, calls = reader.feed(kept.split("</think>")[1])
    assert content + reader.end() == "" and [c["function"]["name"] for c in reader.calls()] == ["get_weather"]
    assert json.loads(reader.calls()[0]["function"]["arguments"]) == {"city": "Paris"}


def test_end_of_generation_tokens_come_from_the_model_and_the_chat_formats(tmp_path):
    """Besides EOS: a Hugging Face directory's generation_config.json list, and the end-of-turn markers that are
    special tokens of the tokenizer (Llama 3's <|eot_id|>, ...), not document separators; every request that does
    not ignore EOS stops at them."""
    from app.model.source import ModelSource, resolve_source
    from app.model.tokenizer import end_token_ids, export_tokenizer, load_exported
    from app.server.openai_api import _sampling_params
    from app.server.protocol import CompletionRequest

    export_tokenizer(resolve_source(ModelSpec()), tmp_path / "smollm2")  # as the frontend gets it
    hf = load_exported(tmp_path / "smollm2")
    assert hf.eos_token_id == 2 and end_token_ids(resolve_source(ModelSpec()), hf) == ()  # SmolLM2: <|im_end|>
    hf.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|endoftext|>x"]})
    hf.add_tokens(["<|end|>"])  # not special: text a model may write
    eot = hf.convert_tokens_to_ids("<|eot_id|>")
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text('{"eos_token_id": [2, 7, 99999999]}')
    assert end_token_ids(ModelSource(model, "hf", "m"), hf) == (7, eot)  # EOS and ids past the vocabulary left out
    (model / "generation_config.json").write_text('{"eos_token_id": 5}')
    assert end_token_ids(ModelSource(model, "hf", "m"), hf) == (5, eot)
    for damaged in ("{not json", "[]", '{"eos_token_id": [true, "7"]}'):
        (model / "generation_config.json").write_text(damaged)
        assert end_token_ids(ModelSource(model, "hf", "m"), hf) == (eot,)  # logged or left out, not raised
    body = CompletionRequest.model_validate({"prompt": "x", "stop_token_ids": [9]})
    assert _sampling_params(body, None, (), None, (), (5, eot)).stop_token_ids == (9, 5, eot)
    ignoring = CompletionRequest.model_validate({"prompt": "x", "stop_token_ids": [9], "ignore_eos": True})
    assert _sampling_params(ignoring, None, (), None, (), (5, eot)).stop_token_ids == (9,)


MISTRAL = (Path(__file__).parent.parent / "mistral_chat_template.jinja").read_text()


def test_mistral_plans_hold_the_tool_calls_token_and_an_array_and_auto_to_that_or_text():
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for
    from app.server.tokenizer import template_variables, tool_format

    assert tool_format(MISTRAL, "tools" in template_variables(MISTRAL)) == "mistral"
    assert tool_format("{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}", True) == "mistral_args"  # later
    byte_tokenizer = LLTokenizer("byte")

    def allows(choice, text: str, parallel: bool = True) -> bool:
        tools = plan(request(tools=[WEATHER, SEARCH], tool_choice=choice, parallel_tool_calls=parallel), "mistral")
        assert tools.format == "mistral"
        matcher = LLMatcher(byte_tokenizer, grammar_for(*tools.constraint[:2]), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    paris = '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # spaced, as the template's tojson writes
    query = '{"name": "search", "arguments": {"q": "x"}}'
    with_id = paris[:-1] + ', "id": "abcdefghi"}'  # as the template renders the history's calls
    bad_query = query.replace('"x"', "5")
    for choice in ("required", "auto"):
        assert allows(choice, f"[TOOL_CALLS] [{paris}]") and allows(choice, f"[TOOL_CALLS][{paris}, {query}]")
        assert not allows(choice, f"[TOOL_CALLS] [{paris}, {query}]", parallel=False)
        assert not allows(choice, f"[TOOL_CALLS] [{with_id}]") and not allows(choice, f"[TOOL_CALLS] [{bad_query}]")
        assert not allows(choice, f"[{paris}]")
    assert allows("auto", "Paris is sunny.") and not allows("auto", " [") and not allows("required", "Paris")
    named = {"type": "function", "function": {"name": "search"}}
    assert allows(named, f"[TOOL_CALLS] [{query}]") and not allows(named, f"[TOOL_CALLS] [{paris}]")
    assert not allows(named, f"[TOOL_CALLS] [{query}, {query}]")


def _check_mistral_calls(reader, text: str, cuts: list[int], expected: list[tuple[str, dict]]) -> None:
    """`text` fed to `reader` in the pieces `cuts` makes: the calls expected, closed, each one's streamed arguments
    adding up to it, each id 9 letters and digits (as Mistral's templates demand of the history)."""
    deltas = [d for a, b in zip([0, *cuts], [*cuts, len(text)]) for d in reader.feed(text[a:b])[1]]
    calls = reader.calls()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert reader.closed
    for i, call in enumerate(calls):
        streamed = "".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
        assert streamed == call["function"]["arguments"]
        assert len(call["id"]) == 9 and call["id"].isalnum()


def test_the_mistral_reader_at_any_piece_boundary_and_its_ids():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris \\"}, {\\"", "days": [1]}}, '
            '{"name": "search", "arguments": {"q": "x"}}]')
    for cuts in ([], list(range(1, len(text))), [1, 12, 13, 40]):
        reader = ToolCallReader(None, auto=True, mistral=True)
        _check_mistral_calls(reader, text, cuts, [("get_weather", {"city": 'Paris "}, {"', "days": [1]}),
                                                  ("search", {"q": "x"})])
    unspaced = ToolCallReader(None, mistral=True)
    unspaced.feed('[TOOL_CALLS][{"name": "search", "arguments": {"q": "y"}}]')
    assert [c["function"]["name"] for c in unspaced.calls()] == ["search"] and unspaced.closed
    words = ToolCallReader(None, auto=True, mistral=True)
    assert words.feed("Sunny [x]") == ("Sunny [x]", []) and words.calls() == [] and not words.closed


def test_mistral_history_ids_are_cut_to_nine_characters():
    body = request(tools=[WEATHER], messages=[*ASK, {"role": "assistant", "tool_calls": [
        {"id": "chatcmpl-tool-0123456789abcdef", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {
        "role": "tool", "tool_call_id": "chatcmpl-tool-0123456789abcdef", "content": "18 C"}])
    messages = conversation(body.messages, plan(body, "mistral"), True, "mistral")
    assert messages[1]["tool_calls"][0]["id"] == "789abcdef" and messages[2]["tool_call_id"] == "789abcdef"
    later = conversation(body.messages, plan(body, "mistral_args"), True, "mistral_args")  # v11 renders ids too
    assert later[1]["tool_calls"][0]["id"] == "789abcdef" and later[2]["tool_call_id"] == "789abcdef"
    kept = conversation(body.messages, plan(body, "hermes"), True, "hermes")
    assert kept[1]["tool_calls"][0]["id"] == "chatcmpl-tool-0123456789abcdef"


def test_mistral_args_plans_hold_each_call_to_its_function_and_the_reader_streams_them():
    """Mistral's later format (Devstral, Magistral, Ministral 3): `[TOOL_CALLS]name[ARGS]{...}` a call."""
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for
    from app.server.tools import ArgsReader
    from app.server.tokenizer import tool_format

    template = ("{{ tools | tojson }}{% for m in messages %}{% for c in m.tool_calls or [] %}{{ '[TOOL_CALLS]' + "
                "c.function.name + '[ARGS]' + (c.function.arguments | tojson) }}{% endfor %}{% endfor %}")
    assert tool_format(template, True) == "mistral_args"
    byte_tokenizer = LLTokenizer("byte")

    def allows(choice, text: str, parallel: bool = True) -> bool:
        tools = plan(request(tools=[WEATHER, SEARCH], tool_choice=choice, parallel_tool_calls=parallel),
                     "mistral_args")
        assert tools.format == "mistral_args" and isinstance(tools.reader(), ArgsReader)
        matcher = LLMatcher(byte_tokenizer, grammar_for(*tools.constraint[:2]), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    paris, query = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', '[TOOL_CALLS]search[ARGS]{"q": "x"}'
    for choice in ("required", "auto"):
        assert allows(choice, paris) and allows(choice, paris + query) and not allows(choice, paris + query, False)
        assert not allows(choice, paris.replace('"Paris"', "5")) and not allows(choice, query.replace('"x"', "5"))
        assert not allows(choice, '[TOOL_CALLS]get_weather[ARGS]{"q": "x"}')  # each name to its own schema
        assert not allows(choice, '[TOOL_CALLS]nothing[ARGS]{}')
    assert allows("auto", "Paris is sunny.") and not allows("auto", " [") and not allows("required", "Paris")
    assert allows("auto", " Paris is sunny.") and not allows("auto", "  Paris")  # one space: SentencePiece's "▁Paris"
    named = {"type": "function", "function": {"name": "search"}}
    assert allows(named, query) and not allows(named, paris) and not allows(named, query + query)
    with_id = '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}'  # tokenizer v11's templates
    assert allows("required", with_id) and not allows("required", with_id.replace("abcDEF123", "abcDEF12"))

    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris [ARGS]\\"}", "days": [1]}[TOOL_CALLS]search[ARGS]{"q": "x"}'
    for cuts in ([], list(range(1, len(text))), [3, 13, 25, 60]):
        _check_mistral_calls(ArgsReader(None, auto=True), text, cuts, [
            ("get_weather", {"city": 'Paris [ARGS]"}', "days": [1]}), ("search", {"q": "x"})])
    own = ArgsReader(None)
    own.feed('[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Rome"}[TOOL_CALLS]sea')
    assert [c["id"] for c in own.calls()] == ["abcDEF123"] and not own.closed  # the model's id; a next call begun
    own.feed('rch[ARGS]{"q": "x"}')
    assert [c["function"]["name"] for c in own.calls()] == ["get_weather", "search"] and own.closed
    cut = ArgsReader(None)
    cut.feed('[TOOL_CALLS]search[ARGS]{"q": "a')
    assert [c["function"] for c in cut.calls()] == [{"name": "search", "arguments": '{"q": "a'}] and not cut.closed
    early = ArgsReader(None)
    assert early.feed("[TOOL_CALLS]sea") == ("", []) and early.end() == "[TOOL_CALLS]sea"
    words = ArgsReader(None, auto=True)
    assert words.feed("Sunny [x]") == ("Sunny [x]", []) and not words.closed
    assert words.feed("[TOOL_CALLS]search[ARGS]{}") == ("[TOOL_CALLS]search[ARGS]{}", [])  # text, where it cannot
    then = 'Let me [look].[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]search[ARGS]{"q": "x"}'
    for cuts in ([], list(range(1, len(then))), [8, 14, 16, 30]):
        reader = ArgsReader(None, auto=True, then_calls=True)
        content, deltas = "", []
        for a, b in zip([0, *cuts], [*cuts, len(then)]):
            more, got = reader.feed(then[a:b])
            content, deltas = content + more, deltas + got
        assert content + reader.end() == "Let me [look]." and reader.closed
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reader.calls()] == [
            ("get_weather", {"city": "Rome"}), ("search", {"q": "x"})]
    begun = ArgsReader(None, auto=True, then_calls=True)
    assert begun.feed("Sunny [TOOL") == ("Sunny ", []) and begun.end() == "[TOOL" and begun.calls() == []


XML_TEMPLATE = (Path(__file__).parent.parent / "qwen_xml_chat_template.jinja").read_text()
XML_PROPERTIES = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "search": {"q": {"type": "string"}, "limit": {"type": ["integer", "null"]}, "exact": {"type": "boolean"},
                             "filters": {"type": "object"}, "tags": {"type": "array"}, "score": {"type": "number"}}}
XML_ANSWER = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n"
              "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n"
              "</tool_call>\n<tool_call>\n<function=search>\n<parameter=q>\nx < 5 and <b>bold</b>\n\n</parameter>\n"
              "<parameter=limit>\nnull\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=filters>\n"
              '{"a": [1, {"b": "<x>"}]}\n</parameter>\n<parameter=tags>\n["x", "y"]\n</parameter>\n'
              "<parameter=score>\n2.5e0\n</parameter>\n</function>\n</tool_call><tool_call>\n<function=search>\n"
              "<parameter=q>\nno closing tags\n<parameter=limit>\nmany\n</function>\n</tool_call>\n"
              "<tool_call>\n<function=search>\nstray text\n<parameter=q>\ny\n</parameter>\n</function>\n</tool_call>"
              "<tool_call>\n<function=search>\n<parameter=score>\n7\n</parameter>\n<tool_call>\n<function=get_weather>"
              "<parameter=city>Rome</parameter></function></tool_call>\nDone <tool_c")


def test_the_xml_reader_takes_qwen3_coder_calls_out_of_free_text_as_their_schemas_type_them():
    """Qwen3-Coder's and Qwen3.5's format (the "qwen3_xml" plan's reader): a block `<function=NAME>` of
    `<parameter=KEY>VALUE</parameter>` blocks is a call once whole, at any piece boundary; each value less the
    template's newline on each side, typed by its parameter's schema (strings as they are, whatever they hold, an
    integer, null, a boolean, JSON objects and arrays, a number; text that is not of the type stays text); a value's
    closing tag left out ends it at the next one, a call's closing tag left out at the next call; a block with text
    between its arguments stays text; a compact call (no newlines) reads the same."""
    from functools import partial

    from app.server.tools import xml_call

    rng = random.Random(1)
    for trial in range(200):
        text = XML_ANSWER
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 40))) if trial else list(range(1, len(text)))
        reader = HermesReader(parse=partial(xml_call, properties=XML_PROPERTIES))
        content, streamed = _read_hermes(reader, text, cuts)
        assert content == ("I will check.\n<tool_call>\n<function=search>\nstray text\n<parameter=q>\ny\n</parameter>"
                           "\n</function>\n</tool_call>Done <tool_c")
        whole = reader.calls()
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == [
            ("get_weather", {"city": "São Paulo", "days": 3, "unit": "celsius"}),
            ("search", {"q": "x < 5 and <b>bold</b>\n", "limit": None, "exact": True,
                        "filters": {"a": [1, {"b": "<x>"}]}, "tags": ["x", "y"], "score": 2.5}),
            ("search", {"q": "no closing tags", "limit": "many"}),
            ("search", {"score": 7}), ("get_weather", {"city": "Rome"})]
        assert [streamed[i] for i in range(5)] == [
            {"arguments": c["function"]["arguments"], "id": c["id"], "name": c["function"]["name"]} for c in whole]
        assert reader.closed


def test_xml_plans_read_auto_from_free_text_and_hold_forced_choices_to_the_xml():
    """The "qwen3_xml" format: "auto" is not held (the model writes its XML, or text) and its reader types the values
    by the request's own schemas; "required" and a named function are held to calls in the XML as the templates
    write them: each function's parameters in its schema's order, the required ones present, an enum one of its
    strings, a typed value JSON its schema allows, a string any text but the closing tag; read by the same reader.
    With a structured output, a 400 as for every format."""
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
            "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
    auto = plan(request(tools=[weather, SEARCH]), "qwen3_xml")
    assert (auto.mode, auto.constraint, auto.format) == ("auto", None, "qwen3_xml")
    reader = auto.reader()
    assert isinstance(reader, HermesReader) and reader.feed(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n7\n</parameter>\n<parameter=days>\n7\n</parameter>\n"
        "</function>\n</tool_call>") == ("", [{"index": 0, "id": reader.calls()[0]["id"], "type": "function",
                                              "function": {"name": "get_weather",
                                                           "arguments": '{"city": "7", "days": 7}'}}])
    byte_tokenizer = LLTokenizer("byte")

    def allows(choice, text: str, parallel: bool = True) -> bool:
        held = plan(request(tools=[weather, SEARCH], tool_choice=choice, parallel_tool_calls=parallel), "qwen3_xml")
        assert held.format == "qwen3_xml" and held.mode == ("named" if isinstance(choice, dict) else choice)
        kind, value, _ = held.constraint
        matcher = LLMatcher(byte_tokenizer, grammar_for(kind, value), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    paris = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <b>, \"x\"\n</parameter>\n<parameter=days>\n3"
             "\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    query = "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>"
    assert allows("required", paris) and allows("required", f"{paris}\n{query}") and allows("required", query)
    assert not allows("required", f"{paris}\n{query}", parallel=False) and allows("required", paris, parallel=False)
    assert not allows("required", "Sure. " + paris) and not allows("required", "")
    assert not allows("required", paris.replace("\n3\n", "\n0\n"))  # days: an integer of at least 1
    assert not allows("required", paris.replace("celsius", "kelvin"))  # unit: one of its enum
    assert not allows("required", paris.replace("<parameter=city>\nParis <b>, \"x\"\n</parameter>\n", ""))  # required
    assert not allows("required", paris.replace("<parameter=days>", "<parameter=weeks>"))  # no other parameter
    assert allows("required", paris.replace("<parameter=days>\n3\n</parameter>\n", ""))  # an optional one left out
    named = {"type": "function", "function": {"name": "search"}}
    assert allows(named, query) and not allows(named, paris) and not allows(named, f"{query}\n{query}")
    whole = plan(request(tools=[weather, SEARCH], tool_choice="required"), "qwen3_xml").reader()
    assert whole.feed(f"{paris}\n{query}")[0] == "" and [json.loads(c["function"]["arguments"]) for c in whole.calls()] == [
        {"city": 'Paris <b>, "x"', "days": 3, "unit": "celsius"}, {"q": "x"}] and whole.closed
    refused("tool_choice", "not both", "qwen3_xml", tools=[weather], response_format={"type": "json_object"})


def test_xml_values_take_their_schemas_type_or_stay_text():
    from app.server.tools import xml_call, xml_value

    assert xml_value("\n42\n", {"type": "integer"}) == 42 and xml_value("42", {"type": "string"}) == "42"
    assert xml_value("4.0", {"type": "integer"}) == "4.0" and xml_value("4", {"type": "number"}) == 4
    assert xml_value("1e999", {"type": "number"}) == "1e999"  # infinite: no JSON number
    assert xml_value("nan", {"type": "number"}) == "nan" and xml_value("FALSE", {"type": "boolean"}) is False
    assert xml_value("null", {"type": "string"}) == "null" and xml_value("null", {"type": ["string", "null"]}) is None
    assert xml_value("null", None) is None and xml_value(" spaced \n\n", None) == " spaced \n"
    assert xml_value('{"a": 1}', {"type": "array"}) == '{"a": 1}' and xml_value("[1]", {"type": ["object", "array"]}) == [1]
    assert xml_value("3", {"type": ["boolean", "integer"]}) == 3 and xml_value("x", {"anyOf": [{"type": "integer"}]}) == "x"
    assert xml_call("\n<function=f>\n</function>\n", {}) == ("f", "{}")  # no arguments
    assert xml_call("<function=f>\n<parameter=s>\n[\"\\ud83d\"]\n</parameter>\n</function>", {"f": {"s": {"type": "array"}}}) is None
    assert xml_call('{"name": "f", "arguments": {}}', {}) is None  # Hermes' JSON is not this format's


def test_a_free_block_the_answer_ended_in_is_a_call_where_it_is_one():
    """A model may stop (EOS) after a call without its closing tag: under "auto", such a last block is a call, in
    Hermes' JSON and in Qwen3-Coder's XML (as vLLM's parsers read it), and the answer's calls ended whole; a last
    block that is no call stays text."""
    from functools import partial

    from app.server.tools import xml_call

    for reader, block, arguments in (
            (HermesReader(), '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n', '{"city": "Rome"}'),
            (HermesReader(parse=partial(xml_call, properties=XML_PROPERTIES)),
             "<tool_call>\n<function=get_time>\n<parameter=city>\nRome\n</parameter>\n</function>", '{"city": "Rome"}')):
        content, deltas = reader.feed("Sure.\n" + block)
        assert (content, deltas) == ("Sure.\n", []) and not reader.closed
        rest, deltas = reader.finish()
        [call] = reader.calls()
        assert rest == "" and reader.closed and (call["function"]["name"], call["function"]["arguments"]) == (
            "get_time", arguments)
        assert deltas == [{"index": 0, "id": call["id"], "type": "function",
                           "function": {"name": "get_time", "arguments": arguments}}]
    text = HermesReader()
    assert text.feed("<tool_call>not a call") == ("", []) and text.finish() == ("<tool_call>not a call", [])
    held = HermesReader(held=True)
    held.feed('<tool_call>\n{"name": "search", "arguments": {"q": "a')
    assert held.finish() == ("", []) and not held.closed  # a held answer cut short: its call so far, not closed


def test_xml_values_that_no_answer_could_carry_stay_text_and_nothing_crashes():
    """From the review: an integer past Python's digit limit, NaN inside an object, a schema whose `properties` is
    not an object, a name the API would refuse: text or no call, never an exception (a 500); `None` (a template's
    Python spelling) is null only where the schema allows it."""
    from app.server.tools import UNFINISHED, xml_call, xml_value

    long = "7" * 5000
    assert xml_value(long, {"type": "integer"}) == long and xml_value(long, {"type": "number"}) == long
    assert xml_value('{"a": NaN}', {"type": "object"}) == '{"a": NaN}' and xml_value("[Infinity]", {"type": "array"}) == "[Infinity]"
    assert xml_value("1_000", {"type": "number"}) == "1_000"
    assert xml_value("None", {"type": ["integer", "null"]}) is None and xml_value("None", {"type": "integer"}) is None
    assert xml_value("None", {"type": "string"}) == "None" and xml_value("None", None) == "None"
    block = "<function=f>\n<parameter=n>\n" + long + "\n</parameter>\n</function>"
    assert xml_call(block, {"f": ["not", "an", "object"]}) == ("f", json.dumps({"n": long}))
    assert xml_call(block, {"f": {"n": {"type": "integer"}}}) == ("f", json.dumps({"n": long}))
    assert xml_call("<function=zz z>\n</function>", {}) is None  # not a function name the API allows
    assert xml_call("<function=f>\n<parameter=s>\nrm -rf /tmp/x", {}) is UNFINISHED  # no end yet: no call
    reader = HermesReader(parse=partial_xml())
    assert reader.feed("<tool_call>\n" + block + "\n</tool_call>")[0] == "" and len(reader.calls()) == 1


def partial_xml():
    from functools import partial

    from app.server.tools import xml_call

    return partial(xml_call, properties=XML_PROPERTIES)


def _cuttings(text: str, seed: int, trials: int):
    """Where to cut `text` into streamed pieces: after every character, then `trials` - 1 random sets of cuts."""
    rng = random.Random(seed)
    yield list(range(1, len(text)))
    for _ in range(trials - 1):
        yield sorted(rng.sample(range(1, len(text)), rng.randint(0, 30)))


def test_an_xml_value_may_hold_the_tags_and_a_cut_call_is_no_call():
    """A value holding `</tool_call>`, `<tool_call>` or `</parameter>` (code, docs: Qwen3-Coder's users write them)
    stays whole, streamed at any piece boundary or not (the block ends at the closing tag after `</function>`); an
    answer cut inside a value (max_tokens) gives no call, its text as content."""
    value = 'See <tool_call> and </tool_call>; a "</parameter>" too.\nline 2'
    text = (f"<tool_call>\n<function=search>\n<parameter=q>\n{value}\n</parameter>\n<parameter=score>\n1.5\n"
            "</parameter>\n</function>\n</tool_call>\nAfter.")
    for cuts in _cuttings(text, seed=2, trials=100):
        reader = HermesReader(parse=partial_xml())
        content, streamed = _read_hermes(reader, text, cuts)
        assert content == "After." and [json.loads(c["function"]["arguments"]) for c in reader.calls()] == [
            {"q": value, "score": 1.5}] and reader.closed
    cut = HermesReader(parse=partial_xml())
    answer = "<tool_call>\n<function=search>\n<parameter=q>\nrm -rf /tmp/x"
    assert cut.feed(answer) == ("", []) and cut.finish() == (answer, []) and not cut.calls() and not cut.closed



def test_a_held_xml_answer_is_read_as_its_grammar_writes_it():
    """Under "required" or a named function the grammar ends a string value only at "\\n</parameter>\\n" (its stop),
    so the reader does too: a value may hold any tags; a weak model's value that runs on past `</function>` and
    `</tool_call>` into prose until max_tokens is a call cut short (no call, no content: the free-text reader of
    "auto" took a call out of it, with the prose as content); so is any held call the answer's end cuts."""
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "score": {"type": "number"}}}}}]
    held = plan(request(tools=tools, tool_choice="required"), "qwen3_xml")
    value = 'See <tool_call> and </tool_call>; a "</parameter>" and </function> too.\nline 2'
    text = (f"<tool_call>\n<function=search>\n<parameter=q>\n{value}\n</parameter>\n<parameter=score>\n1.5\n"
            "</parameter>\n</function>\n</tool_call>")
    for cuts in _cuttings(text, seed=3, trials=60):
        reader = held.reader()
        content, _ = _read_hermes(reader, text, cuts)
        assert content == "" and [json.loads(c["function"]["arguments"]) for c in reader.calls()] == [
            {"q": value, "score": 1.5}] and reader.closed
    runaway = "<tool_call>\n<function=search>\n<parameter=q>\nx</parameter></function></tool_call>\nSure, here it is."
    free = HermesReader(parse=partial_xml())  # (what "auto" makes of the same text)
    assert free.feed(runaway)[0] == "Sure, here it is." and len(free.calls()) == 1
    one = text + "\n"
    for answer in (runaway, text[:40], text[:text.index("</function>") + 3], text[:-len("</tool_call>")], "<tool_",
                   one + "<tool_c"):
        reader = held.reader()
        content, _ = reader.feed(answer)
        assert content == "" and reader.finish() == ("", []), answer
        assert len(reader.calls()) == (1 if answer.startswith(one) else 0), answer
    named = plan(request(tools=tools, tool_choice={"type": "function", "function": {"name": "search"}}), "qwen3_xml")
    assert named.reader().feed(text)[0] == "" and named.reader().forced


@pytest.mark.parametrize("name", ["", "a<b", "a>b", "two\nlines", " padded", "padded ", "x" * 257])
def test_parameter_names_the_xml_cannot_carry_are_a_400_where_the_answer_is_held_to_it(name):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"ok": {"type": "string"}, name: {"type": "string"}}}}}]
    refused("tools", "cannot be written in this model's XML tool calls", "qwen3_xml", tools=tools,
            tool_choice="required")
    assert plan(request(tools=tools, tool_choice="required"), "hermes").mode == "required"  # JSON carries any name
    assert plan(request(tools=tools), "qwen3_xml").mode == "auto"  # the model's to miss, as with vLLM


def test_a_required_key_without_a_property_is_held_as_an_untyped_xml_parameter():
    """JSON Schema lets `required` name a key `properties` leaves out (any value); the XML grammar holds it too, after
    the declared ones (it was left out, so no answer could carry it), and the reader gives it back as text."""
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}}}}}]
    held = plan(request(tools=tools, tool_choice="required"), "qwen3_xml")
    kind, value, _ = held.constraint

    def allows(text: str) -> bool:
        matcher = LLMatcher(LLTokenizer("byte"), grammar_for(kind, value), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    both = ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nanything\n</parameter>\n"
            "</function>\n</tool_call>")
    assert allows(both) and not allows(both.replace("<parameter=b>\nanything\n</parameter>\n", ""))
    reader = held.reader()
    assert reader.feed(both)[0] == "" and json.loads(reader.calls()[0]["function"]["arguments"]) == {
        "a": 1, "b": "anything"}
    refused("tools", "cannot be written", "qwen3_xml", tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["a>b"]}}}])


def test_xml_values_are_typed_through_refs_any_of_const_and_enums():
    """A parameter typed only by a `$ref`, `anyOf`, `const` or an untyped enum: the held grammar holds it to JSON of
    that schema, and both readers give it back as its type (these came back as strings; an untyped enum of the
    string "null" as JSON null)."""
    from llguidance import LLMatcher, LLTokenizer

    from app.engine.structured import grammar_for

    properties = {"ref": {"$ref": "#/$defs/count"}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                  "flag": {"const": True}, "level": {"enum": [1, 2, 3]}, "word": {"enum": ["null", "x"]},
                  "free": {"anyOf": [{"type": "integer"}, {}]}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties, "$defs": {"count": {"type": "number"}}}}}]

    def call(values: dict) -> str:
        return "<tool_call>\n<function=f>\n" + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items()) + "</function>\n</tool_call>"

    answer = call({"ref": "2.5", "maybe": "null", "flag": "true", "level": "2", "word": "null", "free": "7"})
    want = {"ref": 2.5, "maybe": None, "flag": True, "level": 2, "word": "null", "free": "7"}
    for choice in ("auto", "required"):
        reader = plan(request(tools=tools, tool_choice=choice), "qwen3_xml").reader()
        assert reader.feed(answer)[0] == "" and json.loads(reader.calls()[0]["function"]["arguments"]) == want, choice
    kind, value, _ = plan(request(tools=tools, tool_choice="required"), "qwen3_xml").constraint

    def allows(text: str) -> bool:
        matcher = LLMatcher(LLTokenizer("byte"), grammar_for(kind, value), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    values = {"ref": "2.5", "maybe": "null", "flag": "true", "level": "2", "word": "null", "free": "7"}
    assert allows(call(values))
    for key, bad in (("ref", "two"), ("maybe", "x"), ("flag", "false"), ("level", "4"), ("word", "y")):
        assert not allows(call({**values, key: bad})), key
