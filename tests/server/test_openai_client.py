"""The running appliance driven with the official `openai` client, sync and async, streaming and not."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import openai
import pytest

MODEL = "smollm2"


@pytest.fixture(scope="module")
def client(appliance):
    return openai.OpenAI(base_url=appliance.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(appliance):
    return openai.AsyncOpenAI(base_url=appliance.url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_paris(client):
    out = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=32,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_and_its_stream_agree(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0.8, seed=11)
    whole = client.completions.create(**kwargs)
    pieces = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].text for c in pieces if c.choices)
    assert streamed == whole.choices[0].text and len(streamed) > 10
    assert pieces[-1].usage.completion_tokens == whole.usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in pieces if c.choices][-1] == "length"


def test_chat_and_its_stream_agree(client):
    kwargs = dict(model=MODEL, max_tokens=40, temperature=0.7, seed=5,
                  messages=[{"role": "user", "content": "Describe a cat in two sentences."}])
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: a prompt asked again finds every whole block of it cached
    but the one holding its last token (whose logits are computed); streamed, the last chunk says the same; a
    completion's n choices count their prompt once."""
    messages = [{"role": "user", "content": "Count the prefix blocks of this question, asked twice: " + "abc " * 40}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    first = client.chat.completions.create(**kwargs).usage
    again = client.chat.completions.create(**kwargs).usage
    block = 16  # the test spec's kv_cache.block_size (the default)
    assert first.prompt_tokens == again.prompt_tokens > 5 * block
    assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // block * block
    assert first.prompt_tokens_details.cached_tokens < again.prompt_tokens_details.cached_tokens
    assert again.completion_tokens_details is None  # (SmolLM2's template has no thinking block)
    streamed = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
    prompt = "Two choices share this prompt, which is counted once: " + "xyz " * 40
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    two = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2, temperature=0.8, seed=1).usage
    assert two.prompt_tokens_details.cached_tokens == (two.prompt_tokens - 1) // block * block > 0


def test_continuous_usage_stats_count_every_chunk(client):
    """vLLM's continuous_usage_stats: each chunk's usage counts the tokens so far, the last one all of them."""
    for stream in (client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                             stream=True, stream_options={"include_usage": True,
                                                                          "continuous_usage_stats": True}),
                   client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=12, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True},
                                                  stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True})):
        chunks = list(stream)
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
        assert len({c.usage.prompt_tokens for c in chunks}) == 1 and counts[-1] == 12 and len(set(counts)) > 3
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_async_client_streams_both_endpoints(aclient):
    async def run():
        chat = await aclient.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, stream=True,
                                                     messages=[{"role": "user", "content": "Count to five."}])
        chat_text = "".join([c.choices[0].delta.content or "" async for c in chat])
        comp = await aclient.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0,
                                                stream=True)
        comp_text = "".join([c.choices[0].text async for c in comp])
        whole = await aclient.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0)
        return chat_text, comp_text, whole.choices[0].text

    chat_text, comp_text, whole = asyncio.run(run())
    assert chat_text and comp_text == whole


def test_n_choices_and_prompt_lists(client):
    out = client.completions.create(model=MODEL, prompt=["The sky is", "Grass is"], n=2, max_tokens=6,
                                    temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert 4 <= out.usage.completion_tokens <= 4 * 6
    assert out.choices[0].text != out.choices[1].text or out.choices[2].text != out.choices[3].text
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_logprobs_in_both_shapes(appliance, client):
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text
    # as OpenAI's and vLLM's: the sampled token is among its top logprobs, even with logprobs=0 or sampled far down
    for logprobs, temperature in [(0, 0), (2, 1.8)]:
        lp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, seed=3,
                                       temperature=temperature, logprobs=logprobs).choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == pytest.approx(logprob) and len(top) <= logprobs + 1
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3,
                                          messages=[{"role": "user", "content": "Hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and len(content[0].top_logprobs) == 3
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)
    # a token that is part of a character: its own byte (a client joins the bytes into the text), not U+FFFD's
    ids = httpx.post(appliance.url + "/tokenize", json={"prompt": "馬"}).json()["tokens"]
    assert len(ids) == 3  # one byte each in SmolLM2's byte-level BPE
    forced = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, logprobs=True, top_logprobs=1,
                                            logit_bias={str(ids[0]): 100}, messages=[{"role": "user", "content": "Hi"}])
    assert [e.bytes for e in forced.choices[0].logprobs.content] == [["馬".encode()[0]]] * 2


def _token_id(appliance, text: str) -> int:
    ids = httpx.post(appliance.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert len(ids) == 1, (text, ids)  # one token, whose text is `text` again
    assert httpx.post(appliance.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == text
    return ids[0]


def test_logit_bias_bans_and_forces_tokens_and_leaves_the_logprobs_the_models(appliance, client):
    """OpenAI's logit_bias: -100 on the greedy token gives the model's runner-up (from the unbiased answer's own top
    logprobs) with the model's log-probability; +100 on a token makes every output token that one, on both
    endpoints."""
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=2)
    top = client.completions.create(**kwargs).choices[0].logprobs.top_logprobs[0]
    first, second = sorted(top, key=top.get, reverse=True)[:2]
    banned = client.completions.create(logit_bias={str(_token_id(appliance, first)): -100}, **kwargs).choices[0]
    assert banned.text == second
    assert banned.logprobs.token_logprobs[0] == pytest.approx(top[second], abs=1e-4)
    assert banned.logprobs.top_logprobs[0][first] == pytest.approx(top[first], abs=1e-4)  # still the model's best
    forced_id = _token_id(appliance, " banana")
    forced = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0.7,
                                       seed=1, logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == " banana" * 4 and forced.usage.completion_tokens == 4
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, logit_bias={str(forced_id): 100},
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content == " banana" * 3


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "founded"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"enum": ["France", "Italy", "Spain"]},
                       "founded": {"type": "integer", "minimum": -1000, "maximum": 2025}}}


def test_structured_outputs_follow_the_schema_regex_choice_and_grammar(client, appliance):
    """response_format (json_schema, json_object) and vLLM's structured_outputs (choice, regex, Lark grammar): the
    output follows the constraint, checked by independent parsers (jsonschema, re), on both endpoints, greedy and
    sampled, streamed and not; SmolLM2 left alone answers none of these prompts in these shapes. The engine built
    llguidance's tokenizer once, as it started (from the bootstrap's export), not for each grammar."""
    import re

    import jsonschema

    ask = [{"role": "user", "content": "Name a famous city, its country and the year it was founded."}]
    for temperature, seed in ((0, None), (1.0, 7), (1.0, 8)):
        out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, temperature=temperature,
                                             seed=seed, response_format={"type": "json_schema", "json_schema": {
                                                 "name": "city", "schema": CITY, "strict": True}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice  # the grammar completed, then only EOS was allowed
        jsonschema.validate(json.loads(choice.message.content), CITY)
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                         temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    choices = ["yes", "no", "it depends (see notes)"]
    for seed in range(4):
        answer = client.completions.create(model=MODEL, prompt="Is the sky green? Answer:", max_tokens=10,
                                           temperature=1.5, seed=seed, extra_body={"structured_outputs": {
                                               "choice": choices}}).choices[0]
        assert answer.text in choices and answer.finish_reason == "stop", answer
    held = client.completions.create(model=MODEL, prompt="Is the sky green? Answer:", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 6})
    assert held.choices[0].text in ("yes", "no") and held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 6  # EOS after the choice (not in the text) until min_tokens
    # logprobs under a grammar are the allowed tokens' (vLLM's): the choice's first token's alternatives begin one
    scored = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    first = scored.logprobs.content[0]
    assert scored.message.content in ("yes", "no") and first.token == scored.message.content[:len(first.token)]
    likely = [t for t in first.top_logprobs if t.logprob > -30]
    assert all("yes".startswith(t.token) or "no".startswith(t.token) for t in likely), likely
    assert abs(sum(math.exp(t.logprob) for t in likely) - 1) < 1e-3
    regex = r" [12][0-9]{3}\."
    kwargs = dict(model=MODEL, prompt="The Eiffel Tower was built in the year", max_tokens=10, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
    whole = client.completions.create(**kwargs).choices[0]
    assert re.fullmatch(regex, whole.text) and whole.finish_reason == "stop", whole
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == whole.text
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    said = client.completions.create(model=MODEL, prompt="What is 6 times 7?", max_tokens=12, temperature=0,
                                     extra_body={"structured_outputs": {"grammar": lark}}).choices[0].text
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", said), said
    logs = appliance.logs()
    assert logs.count("llguidance's tokenizer built as the engine started") == 1 and "for the first grammar" not in logs


WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city"],
             "properties": {"city": {"type": "string", "maxLength": 20}}}}}]


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """Tool calls put together from stream deltas, as OpenAI's client code does it, and the last finish_reason."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in chunks:
        choice = chunk.choices[0]
        assert not choice.delta.content  # a forced choice's text goes out as tool calls only
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or delta.function.name
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


def test_tool_calls_required_and_named_follow_the_functions_schemas(client):
    """tool_choice "required" and a named function: the answer comes back as tool_calls whose arguments validate
    against that function's schema (jsonschema), greedy and sampled, streamed deltas adding up to the same calls."""
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for temperature, seed in ((0, None), (1.0, 3), (1.0, 4)):
        out = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required",
                                             max_tokens=120, temperature=temperature, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    greedy = dict(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**greedy).choices[0].message.tool_calls
    calls, reason = _streamed_calls(client.chat.completions.create(stream=True, **greedy))
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    one = client.chat.completions.create(parallel_tool_calls=False, **greedy).choices[0].message.tool_calls
    assert len(one) == 1
    assert '"city":"Paris"' in whole[0].function.arguments
    cut = client.chat.completions.create(stop=["Par"], **greedy).choices[0]  # not a whole call: no "tool_calls"
    assert cut.finish_reason == "stop" and cut.message.tool_calls[0].function.arguments.endswith('"city":"')
    named = dict(model=MODEL, messages=ask, tools=TOOLS, max_tokens=60, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    out = client.chat.completions.create(**named).choices[0]
    assert out.finish_reason == "stop" and [c.function.name for c in out.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(out.message.tool_calls[0].function.arguments), schemas["get_time"])
    calls, reason = _streamed_calls(client.chat.completions.create(stream=True, **named))
    assert reason == "stop" and [(c["name"], c["arguments"]) for c in calls] == \
        [("get_time", out.message.tool_calls[0].function.arguments)]
    # the call and its result as history: accepted, and the model answers in text with tool_choice "none"
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": whole[0].id, "type": "function",
         "function": {"name": whole[0].function.name, "arguments": whole[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": whole[0].id, "content": "18 degrees and sunny"}]
    text = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                          max_tokens=30, temperature=0).choices[0]
    assert text.message.content and text.message.tool_calls is None
    for choice in ("auto", "required", "none"):  # /tokenize counts the prompt the chat request ran
        counted = client.post("/../tokenize", cast_to=object, body={"messages": history, "tools": TOOLS,
                                                                    "tool_choice": choice})["count"]
        ran = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=choice,
                                             max_tokens=1, temperature=0).usage.prompt_tokens
        assert counted == ran, choice


def test_tool_choice_auto_answers_in_text_or_in_calls(client):
    """"auto" (the default with tools): SmolLM2, greedy, answers this in text (content, no tool_calls, streamed as
    content); with logit_bias making "[" its first token it must go on as calls that follow the schemas."""
    import jsonschema

    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
               tools=TOOLS, max_tokens=40, temperature=0)
    text = client.chat.completions.create(**ask).choices[0]
    assert text.message.content and not text.message.tool_calls and text.finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(stream=True, **ask))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    bracket = client.post("/../tokenize", body={"prompt": "[", "add_special_tokens": False}, cast_to=object)["tokens"]
    forced = client.chat.completions.create(**{**ask, "max_tokens": 100},
                                            logit_bias={str(bracket[0]): 100}).choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.content is None, forced
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in forced.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """The appliance with a chat template in the style of Qwen's (tests/hermes_chat_template.jinja as
    `model.chat_template`): tools in Hermes' tags, <think> blocks."""
    from tests.conftest import REPO
    from tests.server.conftest import Appliance

    template = REPO / "tests" / "hermes_chat_template.jinja"
    app = Appliance(tmp_path_factory.mktemp("qwen_like"), sets=(f"model.chat_template={template}",)).wait_ready()
    yield openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    assert app.stop() == 0, app.logs()[-3000:]


def test_a_hermes_template_gets_calls_in_its_own_tags_and_auto_is_read_from_free_text(qwen_like):
    """With a chat template that asks for Hermes' `<tool_call>` tags (Qwen's way): "required" and a named choice
    are held to calls in the tags, and "auto" is not held: SmolLM2, shown two earlier calls, writes the third in the
    tags by itself, and the server reads it out of the text as a tool call (as vLLM's hermes parser); a question
    without a call stays text."""
    import jsonschema

    hermes = qwen_like
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def asked(city: str, i: int) -> list[dict]:
        return [{"role": "user", "content": f"What is the weather in {city}?"}, {"role": "assistant", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
                {"city": city, "unit": "celsius"})}}]}]

    shown = [*asked("Paris", 1), *asked("Berlin", 2), {"role": "user", "content": "What is the weather in Rome?"}]
    auto = dict(model=MODEL, messages=shown, tools=TOOLS, max_tokens=60, temperature=0)
    out = hermes.chat.completions.create(**auto).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None, out
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Rome"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)  # not held: the model's own JSON
    calls, reason = _streamed_calls(hermes.chat.completions.create(stream=True, **auto))
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in out.message.tool_calls]
    prompt = hermes.post("/../tokenize", cast_to=object, body={"messages": shown, "tools": TOOLS})["tokens"]
    rendered = hermes.post("/../detokenize", cast_to=object, body={"tokens": prompt})["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}' in rendered
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered
    text = hermes.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=30, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"}]).choices[0]
    assert "Paris" in text.message.content and not text.message.tool_calls
    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    required = dict(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    whole = hermes.chat.completions.create(**required).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None and whole.message.tool_calls
    for call in whole.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert '"city": "Paris"' in whole.message.tool_calls[0].function.arguments  # spaced, as Qwen writes calls
    calls, reason = _streamed_calls(hermes.chat.completions.create(stream=True, **required))
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    named = hermes.chat.completions.create(**{**required, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}).choices[0]
    assert named.finish_reason == "stop" and [c.function.name for c in named.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(named.message.tool_calls[0].function.arguments), schemas["get_time"])


def _rome_after_two_calls(client: openai.OpenAI, call_id) -> tuple[list[dict], list]:
    """SmolLM2, shown two earlier calls of get_weather (their ids `call_id(i)`), asked for Rome's weather under "auto",
    "required" and the named function: each answer is one call of it for Rome, valid under its schema, streamed
    deltas adding up to the same call. Returns the conversation and the three answers (choices)."""
    import jsonschema

    def asked(city: str, i: int) -> list[dict]:
        return [{"role": "user", "content": f"Weather in {city}?"}, {"role": "assistant", "tool_calls": [
            {"id": call_id(i), "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
                {"city": city, "unit": "celsius"})}}]}]

    shown, outs = [*asked("Paris", 1), *asked("Berlin", 2), {"role": "user", "content": "Weather in Rome?"}], []
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        ask = dict(model=MODEL, messages=shown, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
        out = client.chat.completions.create(**ask).choices[0]
        assert out.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls"), out
        [call] = out.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Rome"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
        calls, reason = _streamed_calls(client.chat.completions.create(stream=True, **ask))
        assert reason == out.finish_reason and [(c["name"], c["arguments"]) for c in calls] == [
            (call.function.name, call.function.arguments)]
        outs.append(out)
    return shown, outs


def _a_question_stays_text(client: openai.OpenAI) -> None:
    text = client.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=30, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"}]).choices[0]
    assert "Paris" in text.message.content and not text.message.tool_calls and text.finish_reason == "stop"


def test_a_llama3_template_gets_one_call_object(tmp_path):
    """With a chat template that asks for calls as Llama 3.1's does (one `{"name", "parameters"}` object;
    tests/llama3_chat_template.jinja): "auto" is held to that object or text, and SmolLM2, shown two earlier calls,
    writes the third as one; "required" and a named function give the same object; a question without a call stays
    text; streamed deltas add up to the same call."""
    from tests.conftest import REPO
    from tests.server.conftest import Appliance

    app = Appliance(tmp_path, sets=(f"model.chat_template={REPO / 'tests' / 'llama3_chat_template.jinja'}",))
    llama = openai.OpenAI(base_url=app.wait_ready().url + "/v1", api_key="unused", max_retries=0)
    _rome_after_two_calls(llama, lambda i: f"c{i}")
    _a_question_stays_text(llama)
    assert app.stop() == 0, app.logs()[-3000:]


RAG_TEMPLATE = """{%- if documents %}<|im_start|>system
Documents:
{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_documents_reach_a_template_that_renders_them(tmp_path):
    """vLLM's `documents` (Command R's and Granite's retrieval templates): given to the chat template, so the rendered
    prompt holds them; chat reads that same prompt (its usage counts /tokenize's tokens)."""
    from tests.server.conftest import Appliance

    template = tmp_path / "rag.jinja"
    template.write_text(RAG_TEMPLATE)
    app = Appliance(tmp_path, sets=(f"model.chat_template={template}",)).wait_ready()
    messages = [{"role": "user", "content": "What is the code?"}]
    documents = [{"title": "Vault", "text": "The code is 4417."}, {"title": "Door", "text": "It is blue."}]
    rendered = httpx.post(app.url + "/apply-template", json={"messages": messages, "documents": documents}).json()
    assert rendered["prompt"].startswith("<|im_start|>system\nDocuments:\n[Vault] The code is 4417.\n[Door] It is")
    plain = httpx.post(app.url + "/apply-template", json={"messages": messages}).json()
    assert "Documents" not in plain["prompt"] and plain["prompt"].endswith("<|im_start|>assistant\n")
    counted = httpx.post(app.url + "/tokenize", json={"messages": messages, "documents": documents}).json()["count"]
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"documents": documents})
    assert answer.usage.prompt_tokens == counted > len(httpx.post(app.url + "/tokenize", json={
        "messages": messages}).json()["tokens"])
    assert app.stop() == 0, app.logs()[-3000:]


def test_a_qwen3_coder_template_gets_auto_calls_read_out_of_its_xml(tmp_path):
    """With a chat template that asks for calls as Qwen3-Coder's and Qwen3.5's do (XML in <tool_call> tags,
    tests/qwen_xml_chat_template.jinja), the history's calls are rendered in it, and "auto" is not held: SmolLM2,
    shown two earlier calls, writes the third in the XML by itself (and stops before the closing tag: still a call,
    as vLLM's qwen3_coder parser reads it), which comes back as a tool call typed by the function's schema;
    "required" and a named function give the same call, held to the XML; a question without a call stays text."""
    from tests.conftest import REPO
    from tests.server.conftest import Appliance

    app = Appliance(tmp_path, sets=(f"model.chat_template={REPO / 'tests' / 'qwen_xml_chat_template.jinja'}",))
    qwen = openai.OpenAI(base_url=app.wait_ready().url + "/v1", api_key="unused", max_retries=0)
    shown, outs = _rome_after_two_calls(qwen, lambda i: f"c{i}")
    assert json.loads(outs[0].message.tool_calls[0].function.arguments) == {"city": "Rome", "unit": "celsius"}
    prompt = qwen.post("/../tokenize", cast_to=object, body={"messages": shown, "tools": TOOLS})["tokens"]
    rendered = qwen.post("/../detokenize", cast_to=object, body={"tokens": prompt})["prompt"]
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n<parameter=unit>\n"
            "celsius\n</parameter>\n</function>\n</tool_call>") in rendered
    _a_question_stays_text(qwen)
    assert app.stop() == 0, app.logs()[-3000:]


def test_a_mistral_template_gets_its_tool_calls_token_and_array(tmp_path):
    """With a chat template that asks for calls as Mistral's do (`[TOOL_CALLS]` and a JSON array of
    `{"name", "arguments"}`, 9-character ids; tests/mistral_chat_template.jinja): the history's longer ids are cut
    to 9 characters (the template refuses others); "auto" is held to calls or text, and SmolLM2, shown two earlier
    calls, writes the third; "required" and a named function give the same call; every call's id is 9 letters and
    digits, and goes back in the next turn's history as it is."""
    from tests.conftest import REPO
    from tests.server.conftest import Appliance

    app = Appliance(tmp_path, sets=(f"model.chat_template={REPO / 'tests' / 'mistral_chat_template.jinja'}",))
    mistral = openai.OpenAI(base_url=app.wait_ready().url + "/v1", api_key="unused", max_retries=0)
    shown, outs = _rome_after_two_calls(mistral, lambda i: f"chatcmpl-tool-{i:016d}")
    for out in outs:
        [call] = out.message.tool_calls
        assert len(call.id) == 9 and call.id.isalnum() and out.message.content is None
    follow = [*shown, {"role": "assistant", "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "21 C"}, {"role": "user", "content": "Thanks!"}]
    assert mistral.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=5).choices
    _a_question_stays_text(mistral)
    assert app.stop() == 0, app.logs()[-3000:]


def _thought(message) -> tuple[str | None, str | None]:
    """A message's (or delta's) reasoning, checked to be the same under both names."""
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content"), message.content


def test_a_thinking_block_comes_back_apart_from_the_answer(qwen_like):
    """A template that knows <think> blocks: the answer's block comes back as `reasoning_content` and `reasoning`,
    the rest as content, streamed and not (SmolLM2 thinks in the tags after two examples of it in the history);
    where the prompt leaves a block open (as DeepSeek-R1's template does), the answer starts inside it; a closed
    empty block in the prompt (Qwen3's enable_thinking false) leaves the answer all content; a forced tool choice's
    answer is not split."""
    shown = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "reasoning_content": "2 plus 2 is 4.", "content": "4"},
             {"role": "user", "content": "What is the capital of Italy?"},
             {"role": "assistant", "reasoning": "Italy's capital is Rome.", "content": "Rome"},  # vLLM's name
             {"role": "user", "content": "What is the capital of France?"}]
    ask = dict(model=MODEL, messages=shown, temperature=0, max_tokens=60)
    out = qwen_like.chat.completions.create(**ask).choices[0]
    reasoning, content = _thought(out.message)
    assert "Paris" in reasoning and not reasoning.startswith("<think>") and "</think>" not in reasoning
    assert content == "Paris" and out.finish_reason == "stop"
    chunks = list(qwen_like.chat.completions.create(stream=True, **ask))
    assert "".join(_thought(c.choices[0].delta)[0] or "" for c in chunks) == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    rendered = qwen_like.post("/../detokenize", cast_to=object, body={"tokens": qwen_like.post(
        "/../tokenize", cast_to=object, body={"messages": shown})["tokens"]})["prompt"]
    assert "<think>\nItaly's capital is Rome.\n</think>\n\nRome" in rendered  # history's reasoning, either name
    ask = dict(model=MODEL, messages=shown[-1:], temperature=0, max_tokens=40)
    opened = qwen_like.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"open_thinking": True}})
    reasoning, content = _thought(opened.choices[0].message)
    assert "Paris" in reasoning and content is None  # SmolLM2 never closes the block: all of it is reasoning
    assert opened.usage.completion_tokens_details.reasoning_tokens == opened.usage.completion_tokens > 0
    prefilled = qwen_like.chat.completions.create(**{**ask, "messages": [*shown[-1:], {
        "role": "assistant", "content": "<think>\nThe user asks"}]}, extra_body={
        "continue_final_message": True, "add_generation_prompt": False}).choices[0].message
    assert _thought(prefilled)[0] and prefilled.content is None  # the prefill opened the block: reasoning
    asked = qwen_like.chat.completions.create(**{**ask, "messages": [
        {"role": "user", "content": "In one sentence: why do some models write <think> first?"}]}).choices[0]
    assert _thought(asked.message)[0] is None and asked.message.content  # a tag in the question opens nothing
    closed = qwen_like.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    reasoning, content = _thought(closed.choices[0].message)
    assert reasoning is None and "Paris" in content
    assert closed.usage.completion_tokens_details.reasoning_tokens == 0
    forced = qwen_like.chat.completions.create(**{**ask, "max_tokens": 120}, tools=TOOLS, tool_choice="required",
                                               extra_body={"chat_template_kwargs": {"open_thinking": True}}).choices[0]
    assert forced.finish_reason == "tool_calls" and _thought(forced.message) == (None, None)
    # the Responses API: the history's thinking as reasoning items, the answer's as a reasoning item before the text
    items = []
    for message in shown:
        if message["role"] == "assistant":
            thought = message.get("reasoning_content") or message.get("reasoning")
            items.append({"type": "reasoning", "id": "rs_1", "summary": [],
                          "content": [{"type": "reasoning_text", "text": thought}]})
        items.append({"role": message["role"], "content": message["content"]})
    answer = qwen_like.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=60)
    reasoning, content = _thought(out.message)
    assert [o.type for o in answer.output] == ["reasoning", "message"] and answer.output_text == content
    assert answer.output[0].content[0].text == reasoning
    events = list(qwen_like.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=60,
                                             stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
    # OpenAI's reasoning_tokens: those that wrote the block, whole or streamed, fewer than the whole answer's
    thought_tokens = answer.usage.output_tokens_details.reasoning_tokens
    assert 0 < thought_tokens < answer.usage.output_tokens
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == thought_tokens


def test_continue_final_message_prefills_the_answer(appliance, client):
    """vLLM's continue_final_message: the last (assistant) message is left open in the prompt and the model goes on
    with it; checked against the prompt /tokenize renders and the answer without the prefill."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    fields = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    prompt = httpx.post(appliance.url + "/tokenize", json=fields, timeout=60).json()["tokens"]
    plain = httpx.post(appliance.url + "/tokenize", json={"messages": messages[:1]}, timeout=60).json()["tokens"]
    said = httpx.post(appliance.url + "/detokenize", json={"tokens": prompt}, timeout=60).json()["prompt"]
    assert said.endswith("<|im_start|>assistant\nThe capital of France is") and prompt[:len(plain)] == plain
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.choices[0].message.content.startswith(" Paris") and out.usage.prompt_tokens == len(prompt)
    with_tools = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                tools=TOOLS, extra_body={"continue_final_message": True,
                                                                         "add_generation_prompt": False})
    assert with_tools.choices[0].message.content.startswith(" Paris")  # tool_choice "none" then: text goes on


def test_stop_sequences_and_echo(client):
    free = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=12, temperature=0).choices[0].text
    stop = free.split(",")[1].strip()
    cut = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=12, temperature=0, stop=[stop])
    assert stop not in cut.choices[0].text and free.startswith(cut.choices[0].text)
    assert cut.choices[0].finish_reason == "stop"
    # as vLLM: stop strings are not looked for before min_tokens tokens
    held = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=12, temperature=0, stop=[" "],
                                     extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens > 5 and free.startswith(held.choices[0].text), held
    assert held.choices[0].text.count(" ") >= 2, (free, held)  # the spaces of the first tokens stay
    echoed = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Monday, Tuesday,")


def test_vllm_stop_and_truncation_fields(appliance, client):
    """include_stop_str_in_output keeps the stop string; truncate_prompt_tokens reads the prompt's last k tokens only
    (the same answer as those k token ids sent as the prompt); vLLM's fields this server does not follow are 400s,
    not ignored."""
    free = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=12, temperature=0).choices[0].text
    stop = free.split(",")[1].strip()
    kept = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == free[:free.index(stop) + len(stop)], (free, kept.text)
    streamed = client.completions.create(model=MODEL, prompt="Monday, Tuesday,", max_tokens=12, temperature=0,
                                         stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == kept.text
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = httpx.post(appliance.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 5})
    tail = client.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=6, temperature=0)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == tail.choices[0].text
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    # a text longer than any context is refused before it is tokenized, unless only its last tokens are kept
    long = "word " * 140_000  # (700,000 characters: SmolLM2's longest token is 81, x 8,192)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=long, max_tokens=1)
    kept = client.completions.create(model=MODEL, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 8})
    assert kept.usage.prompt_tokens == 8
    # add_special_tokens reaches the tokenizer as /tokenize's does
    for special in (True, False):
        counted = httpx.post(appliance.url + "/tokenize", json={"prompt": prompt, "add_special_tokens": special})
        used = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                         extra_body={"add_special_tokens": special})
        assert used.usage.prompt_tokens == counted.json()["count"]
    for field, value, said in [("prompt_embeds", "abc", None), ("bad_words", [""], None),
                               ("logits_processors", ["x"], None), ("truncate_prompt_tokens", 0, None),
                               ("allowed_token_ids", [], None),
                               ("allowed_token_ids", [1 << 20], "token id 1048576 is outside the vocabulary")]:
        with pytest.raises(openai.BadRequestError, match=said or field) as refused:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={field: value})
        assert field in json.dumps(refused.value.body), refused.value.body
    # chat's echo (vLLM's): an assistant's last message, the prefill continue_final_message goes on from, comes first
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    kwargs = dict(model=MODEL, messages=prefill, max_tokens=4, temperature=0,
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    alone = client.chat.completions.create(**kwargs).choices[0].message.content
    echoed = client.chat.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == "The capital of France is" + alone and "Paris" in alone
    streamed = client.chat.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "echo": True}},
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        echoed.choices[0].message.content
    asked = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"echo": True}).choices[0].message.content
    assert asked == client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                   temperature=0).choices[0].message.content  # a user's: nothing
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"use_beam_search": False, "bad_words": [], "echo": False})
    assert plain.choices[0].text  # their defaults are fine
    # return_tokens_as_token_ids: logprobs name each token "token_id:<id>", the ids of the tokens named otherwise
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    named, as_ids = (client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": flag}).choices[0]
                     for flag in (False, True))
    sampled = [int(t.removeprefix("token_id:")) for t in as_ids.logprobs.tokens]
    assert [httpx.post(appliance.url + "/detokenize", json={"tokens": [i]}).json()["prompt"] for i in sampled] \
        == named.logprobs.tokens and as_ids.logprobs.text_offset == named.logprobs.text_offset
    assert all(key.startswith("token_id:") for top in as_ids.logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") and t.bytes for t in chat.choices[0].logprobs.content)
    # allowed_token_ids: only " yes" and " no" (no EOS either), sampled or greedy, chat too
    words = [httpx.post(appliance.url + "/tokenize", json={"prompt": w}).json()["tokens"] for w in (" yes", " no")]
    assert all(len(w) == 1 for w in words)
    allowed = [w[0] for w in words]
    for temperature in (0, 1):
        said = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=temperature,
                                         extra_body={"allowed_token_ids": allowed}).choices[0]
        assert re.fullmatch(r"( yes| no){6}", said.text) and said.finish_reason == "length", said
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                          extra_body={"allowed_token_ids": allowed})
    assert re.fullmatch(r"( yes| no){3}", chat.choices[0].message.content), chat
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids cannot be combined with response_format"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                  extra_body={"allowed_token_ids": allowed, "response_format": {"type": "json_object"}})
    # the Responses API follows none of these: refused there too, not ignored
    for field, value in [("use_beam_search", True), ("allowed_token_ids", allowed), ("truncate_prompt_tokens", 3),
                         ("add_special_tokens", True)]:
        refused = httpx.post(appliance.url + "/v1/responses", json={"model": MODEL, "input": "Hi", field: value})
        assert refused.status_code == 400 and field in refused.json()["error"]["message"], refused.text
    # embeddings: truncate_prompt_tokens embeds the input's last k tokens, as those ids sent alone
    cut = client.embeddings.create(model=MODEL, input=prompt, extra_body={"truncate_prompt_tokens": 5})
    alone = client.embeddings.create(model=MODEL, input=[ids[-5:]])
    assert cut.usage.prompt_tokens == 5 and cut.data[0].embedding == alone.data[0].embedding


def test_echo_with_logprobs_scores_the_prompt(appliance, client):
    """OpenAI's legacy way to score a text, as lm-evaluation-harness asks it (echo, logprobs, max_tokens 1 or 0):
    the prompt's tokens come first, the first with no logprob, each later one with its log-probability given those
    before it: the same number the model gives that token when it generates it there."""
    prompt = "The capital of France is Paris"
    ids = httpx.post(appliance.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert logprob < 0 and top[token] == logprob and 2 <= len(top) <= 3
    generated = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                          logprobs=2).choices[0]
    assert generated.text == " Paris" == lp.tokens[-1]
    assert generated.logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[-1], abs=1e-3)
    # token-id prompts, two at once, n=2, one generated token each (lm-evaluation-harness' request); the stream the same
    kwargs = dict(model=MODEL, prompt=[ids, ids[:4]], max_tokens=1, echo=True, logprobs=1, temperature=0, n=2)
    both = client.completions.create(**kwargs)
    assert [len(c.logprobs.tokens) for c in both.choices] == [len(ids) + 1] * 2 + [5] * 2
    assert both.choices[0].logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-3)
    assert both.choices[1].logprobs.token_logprobs == pytest.approx(both.choices[0].logprobs.token_logprobs)
    assert both.choices[2].logprobs.token_logprobs[:4] == pytest.approx(lp.token_logprobs[:4], abs=1e-3)
    streamed: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        streamed.setdefault(chunk.choices[0].index, []).extend(chunk.choices[0].logprobs.token_logprobs
                                                              if chunk.choices[0].logprobs else [])
    assert [streamed[c.index] for c in both.choices] == [c.logprobs.token_logprobs for c in both.choices]
    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}}, the token's and the k most likely
    vllm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for token, logprob, entry in zip(ids[1:], lp.token_logprobs[1:], vllm[1:], strict=True):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(logprob, abs=1e-3) and mine["rank"] >= 1
        assert 1 <= len(entry) <= 2 and min(e["rank"] for e in entry.values()) == 1
    choices = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, n=3,
                                        extra_body={"prompt_logprobs": 1}).choices  # scored once, every choice's
    for choice in choices:
        scored = choice.model_extra["prompt_logprobs"]
        assert scored[0] is None and len(scored) == len(ids)
        assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], scored[1:], strict=True)] == \
            pytest.approx([e[str(t)]["logprob"] for t, e in zip(ids[1:], vllm[1:], strict=True)], abs=1e-3)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    scored_chat = chat.model_extra["prompt_logprobs"]
    assert len(scored_chat) == chat.usage.prompt_tokens and scored_chat[0] is None
    assert all(len(e) == 1 and list(e.values())[0]["logprob"] <= 0 for e in scored_chat[1:])


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def test_responses_api_answers_as_chat_does(client):
    """OpenAI's Responses API on the chat machinery: the same conversation gives the chat endpoint's greedy text, its
    usage, and a max_output_tokens cut leaves the response incomplete; streamed, the deltas add up to the whole."""
    question = "What is the capital of France?"
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=80, messages=[
        {"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}])
    answer = client.responses.create(model=MODEL, instructions="You are a helpful assistant.", input=question,
                                     temperature=0, max_output_tokens=80)
    assert answer.status == "completed" and answer.output_text == chat.choices[0].message.content
    assert [o.type for o in answer.output] == ["message"] and answer.output[0].role == "assistant"
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                       chat.usage.completion_tokens)
    assert answer.store is False and answer.id.startswith("resp_")
    cut = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text",
                                                                                      "text": question}]}],
                                  temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and answer.output_text.startswith(cut.output_text)
    assert cut.output[-1].status == "incomplete"  # the item the cut ended
    streamed_cut = list(client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=3,
                                                stream=True))
    assert streamed_cut[-1].type == "response.incomplete" and streamed_cut[-1].response.output_text == cut.output_text
    assert [e.item.status for e in streamed_cut if e.type == "response.output_item.done"] == ["incomplete"]
    events = list(client.responses.create(model=MODEL, instructions="You are a helpful assistant.", input=question,
                                          temperature=0, max_output_tokens=80, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == answer.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text


def test_responses_api_gives_the_texts_logprobs_as_chat_does(client):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the message's output_text carries each
    generated token's logprob and its most likely alternatives, those chat gives for the same greedy answer (the
    same engine rows: equal to rounding); streamed, the deltas' logprobs add up to the whole answer's; without
    asking, none."""
    question = [{"role": "user", "content": "Name a primary color."}]
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=question,
                                          logprobs=True, top_logprobs=3)
    kwargs = dict(model=MODEL, input=question, temperature=0, max_output_tokens=12, top_logprobs=3,
                  include=["message.output_text.logprobs"])
    answer = client.responses.create(**kwargs)
    got = answer.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert answer.output_text == chat.choices[0].message.content and answer.top_logprobs == 3
    assert [e.token for e in got] == [e.token for e in want] and len(got) == chat.usage.completion_tokens
    for ours, theirs in zip(got, want, strict=True):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4) and ours.bytes == theirs.bytes
        assert [t.token for t in ours.top_logprobs] == [t.token for t in theirs.top_logprobs]
        assert len(ours.top_logprobs) == 3 and ours.top_logprobs[0].logprob >= ours.logprob - 1e-6
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [e.token for e in done.logprobs] == [e.token for e in got]
    assert [e.token for e in streamed] == [e.token for e in got][:len(streamed)]  # the end token's at the close
    final = events[-1].response.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in final] == [(e.token, e.logprob) for e in done.logprobs]
    plain = client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=12)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs is None
    with pytest.raises(openai.BadRequestError, match="include"):
        client.responses.create(model=MODEL, input=question, include=["message.output_text.everything"])


def test_responses_api_takes_chats_sampling_fields(client):
    """Chat's sampling fields the Responses API lacks (stop, seed, top_k, penalties, ...) act as they do in chat,
    rather than being dropped without a word: a stop string cuts the answer where chat's does."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=40)
    word = whole.output_text.split()[2]  # a word inside the answer
    extra = {"stop": [word], "top_k": 5, "seed": 3, "frequency_penalty": 0.5}
    chat = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=40,
                                          extra_body=extra)
    answer = client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=40,
                                     extra_body=extra)
    assert answer.output_text == chat.choices[0].message.content and word not in answer.output_text
    assert len(answer.output_text) < len(whole.output_text) and answer.status == "completed"


def test_responses_api_calls_functions_and_reads_their_outputs(client):
    """Function tools in the Responses API's flat shape: a forced call comes back as a function_call item (streamed
    through the SDK's own accumulator too), and its output sent back as a function_call_output item is read."""
    kwargs = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
                  max_output_tokens=60, parallel_tool_calls=False)
    required = client.responses.create(tool_choice="required", **kwargs)
    call = required.output[0]
    assert [o.type for o in required.output] == ["function_call"] and required.status == "completed"
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"} and call.call_id
    named = client.responses.create(tool_choice={"type": "function", "name": "get_weather"}, **kwargs)
    assert [(o.type, o.name) for o in named.output] == [("function_call", "get_weather")]
    with client.responses.stream(tool_choice="required", **kwargs) as stream:
        streamed = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in streamed.output] == [("function_call", call.name, call.arguments)]
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}]
    told = client.responses.create(model=MODEL, input=history, tools=[WEATHER], tool_choice="none", temperature=0,
                                   max_output_tokens=40)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, tool_choice="none", messages=[
        history[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 C and sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert told.status == "completed" and told.output_text == chat.choices[0].message.content
    assert "sunny" in told.output_text  # the tool's result, read
    shaped = client.responses.create(model=MODEL, input="Name a city as JSON.", temperature=0, max_output_tokens=40,
                                     text={"format": {"type": "json_schema", "name": "city", "schema": {
                                         "type": "object", "properties": {"name": {"type": "string"}},
                                         "required": ["name"], "additionalProperties": False}}})
    assert shaped.status == "completed" and set(json.loads(shaped.output_text)) == {"name"}


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_answer(appliance, client):
    """vLLM's stop_reason: the stop string matched, the stop token id, or null (EOS, or the length ran out)."""
    period = httpx.post(appliance.url + "/tokenize", json={"prompt": ".", "add_special_tokens": False}).json()["tokens"]
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    cases = [({"stop": ["xyz", " Par"]}, " Par"), ({"extra_body": {"stop_token_ids": period}}, period[0]),
             ({"max_tokens": 1}, None)]
    for extra, reason in cases:
        answer = client.completions.create(**{**kwargs, **extra}).choices[0]
        assert answer.stop_reason == reason and answer.finish_reason == ("length" if reason is None else "stop")
        last = [c.choices[0] for c in client.completions.create(**{**kwargs, **extra}, stream=True) if c.choices][-1]
        assert last.stop_reason == reason and last.finish_reason == answer.finish_reason
    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0).choices[0]
    assert chat.finish_reason == "stop" and chat.stop_reason is None  # the model's EOS
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          stop=["!", "."]).choices[0]
    assert chat.stop_reason in ("!", ".") and chat.stop_reason not in chat.message.content


def test_the_clients_request_id_is_the_responses_id(appliance):
    """vLLM's request_id (the body's, or the X-Request-Id header's, which wins) names the response, and the header
    comes back on the answer (refusals and streams too); two requests that share one still run apart (the engine's ids
    are the server's own)."""
    url = appliance.url + "/v1/completions"
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    traced = httpx.post(url, json=body, headers={"X-Request-Id": "trace-42"})
    assert traced.json()["id"] == "cmpl-trace-42" and traced.headers["x-request-id"] == "trace-42"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers={"X-Request-Id": "s-1"}) as streamed:
        assert streamed.headers["x-request-id"] == "s-1" and "cmpl-s-1" in streamed.read().decode()
    refused = httpx.post(url, json={**body, "max_tokens": -1}, headers={"X-Request-Id": "bad-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    assert "x-request-id" not in httpx.post(url, json=body).headers
    responses = appliance.url + "/v1/responses"
    assert httpx.post(responses, json={"input": "Hi", "max_output_tokens": 2, "request_id": "r-7"}).json()["id"] == "r-7"
    assert httpx.post(responses, json={"input": "Hi", "max_output_tokens": 2},
                      headers={"X-Request-Id": "r-8"}).json()["id"] == "r-8"
    chat = httpx.post(appliance.url + "/v1/chat/completions", headers={"X-Request-Id": "from-header"},
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "abc"})
    assert chat.json()["id"] == "chatcmpl-from-header"
    # the pooling endpoints name theirs as vLLM's do: embd-, score-, rerank-
    pooled = {"/v1/embeddings": ({"input": "Hi"}, "embd"), "/score": ({"text_1": "a", "text_2": "b"}, "score"),
              "/rerank": ({"query": "a", "documents": ["b", "c"]}, "rerank")}
    for path, (fields, kind) in pooled.items():
        assert httpx.post(appliance.url + path, json=fields, headers={"X-Request-Id": "p-1"}).json()["id"] == \
            f"{kind}-p-1"
        assert httpx.post(appliance.url + path, json={**fields, "request_id": "p-2"}).json()["id"] == f"{kind}-p-2"
        assert httpx.post(appliance.url + path, json=fields).json()["id"].startswith(f"{kind}-")

    async def both():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(url, json={**body, "request_id": "same", "max_tokens": 6})
                                          for _ in range(2)))

    answers = [r.json() for r in asyncio.run(both())]
    assert [a["id"] for a in answers] == ["cmpl-same"] * 2 and answers[0]["choices"] == answers[1]["choices"]
    long = httpx.post(url, json=body, headers={"X-Request-Id": "x" * 300})
    assert long.status_code == 400 and long.json()["error"]["param"] == "request_id"


def test_developer_messages_and_text_parts_render_as_vllm_renders_them(appliance):
    """SmolLM2's template has no developer role: a developer message is its system message (not the template's
    default system prompt and a turn of a role the model never saw); text parts are joined by line breaks."""
    def ids(messages):
        return httpx.post(appliance.url + "/tokenize", json={"messages": messages}).json()["tokens"]

    system = ids([{"role": "system", "content": "Be brief.\nReally."}, {"role": "user", "content": "Hi\nthere"}])
    assert ids([{"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                                  {"type": "text", "text": "Really."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]) \
        == system


def test_models_tokenize_detokenize_version_openapi(appliance, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).model_dump() == models.data[0].model_dump()
    for other in ("gpt-4o", "org/smollm2", MODEL + "x"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(other)
        assert missing.value.code == "model_not_found" and f"`{other}` does not exist" in missing.value.message
    assert httpx.get(appliance.url + "/v1/models/").json() == httpx.get(appliance.url + "/v1/models").json()  # the list
    card = httpx.get(appliance.url + "/v1/models").json()["data"][0]  # vLLM's fields too
    assert card["root"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and card["parent"] is None
    assert card["permission"][0]["allow_sampling"] is True
    assert httpx.get(appliance.url + "/ping").json() == httpx.get(appliance.url + "/health").json() == {"status": "ok"}
    assert httpx.get(appliance.url + "/load").json() == {"server_load": 0}
    with client.completions.create(model=MODEL, prompt="Count:", max_tokens=60, stream=True,
                                   extra_body={"ignore_eos": True}) as stream:
        next(iter(stream))
        assert httpx.get(appliance.url + "/load").json() == {"server_load": 1}
    tok = httpx.post(appliance.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) == 2 and tok["max_model_len"] == 8192
    text = httpx.post(appliance.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    pieces = httpx.post(appliance.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert pieces["tokens"] == tok["tokens"] and pieces["token_strs"] == ["Hello", "\u0120world"]
    chat = httpx.post(appliance.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    assert httpx.get(appliance.url + "/version").json()["version"]
    spec = httpx.get(appliance.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/models/{model}",
            "/tokenize", "/detokenize", "/tokenizer_info"} <= set(spec["paths"])
    # vLLM's /tokenizer_info: with /tokenize and /detokenize, a client's stand-in for the tokenizer (lm-evaluation-
    # harness' remote tokenizer): its EOS is one token, and its chat template renders what the server tokenizes
    info = httpx.get(appliance.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 8192 and info["tokenizer_class"]
    eos = httpx.post(appliance.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [2]
    import jinja2

    rendered = jinja2.Environment().from_string(info["chat_template"]).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = httpx.post(appliance.url + "/tokenize", json={"prompt": rendered, "add_special_tokens": False}).json()
    assert ids["tokens"] == chat["tokens"]
    # llama.cpp's /props: the same context and template, the scheduler's sequences as slots
    props = httpx.get(appliance.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == info["model_max_length"]
    assert props["chat_template"] == info["chat_template"] and props["eos_token"] == info["eos_token"]
    assert props["total_slots"] == 64 and props["model_alias"] == MODEL  # (the default scheduler.max_num_seqs)
    assert props["model_path"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and "/" not in props["model_path"]
    params = props["default_generation_settings"]["params"]
    assert {"temperature", "top_p", "top_k", "repeat_penalty", "n_predict"} <= set(params)
    assert "max_tokens" not in params and "repetition_penalty" not in params  # (llama.cpp's names)
    assert set(props) == set(spec["components"]["schemas"]["PropsResponse"]["properties"])  # (the OpenAPI document's)
    applied = httpx.post(appliance.url + "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert applied.json() == {"prompt": rendered}
    bare = httpx.post(appliance.url + "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                "add_generation_prompt": False}).json()["prompt"]
    assert rendered.startswith(bare) and len(bare) < len(rendered)
    empty = httpx.post(appliance.url + "/apply-template", json={"messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def test_metrics_use_vllm_names(appliance, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    text = httpx.get(appliance.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_success_total", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
                 "vllm:request_inference_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "vllm:request_params_n_bucket",
                 "vllm:request_params_max_tokens_bucket", "vllm:prompt_tokens_cached_total"):
        assert name in text, name
    assert appliance.metric("vllm:generation_tokens_total") >= 2
    # each finished request's phases, as vLLM's: its queue and prefill times from the engine, its decode time
    # (first token to last) from the frontend; the request histograms count requests, labelled with their replica
    finished = appliance.metric("vllm:request_success_total")
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:request_params_n_count"):
        assert appliance.metric(name) >= 1, name
    assert appliance.metric("vllm:request_prefill_time_seconds_sum") > 0
    assert re.search(r'^vllm:request_generation_tokens_count\{engine="0",model_name="[^"]+"\} \S+$', text, re.M)
    assert finished >= 1
    # a client that goes away mid-answer: its request counts as finished with reason "abort", as vLLM counts it
    aborted = re.compile(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', re.M)

    def aborts() -> float:
        found = aborted.search(httpx.get(appliance.url + "/metrics").text)
        return float(found.group(1)) if found else 0.0

    before = aborts()
    with httpx.stream("POST", appliance.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}) as stream:
        next(stream.iter_lines())
    deadline = time.monotonic() + 10
    while aborts() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborts() == before + 1

    # an embedding's one token and an echoed prompt's alone are never shown: no generation tokens, no first-token
    # time; an embedding counts as finished with "stop" (as vLLM's pooling requests)
    def counts() -> tuple[float, float]:
        return (appliance.metric("vllm:generation_tokens_total"),
                appliance.metric("vllm:time_to_first_token_seconds_count"))

    stops = re.compile(r'^vllm:request_success_total\{[^}]*finished_reason="stop"[^}]*\} (\S+)$', re.M)

    def stopped() -> float:  # (none yet where this test runs alone: its first request ends at its length)
        found = stops.search(httpx.get(appliance.url + "/metrics").text)
        return float(found.group(1)) if found else 0.0

    tokens, firsts, stops_before = *counts(), stopped()
    asked = appliance.metric("vllm:request_params_n_count")
    client.embeddings.create(model=MODEL, input=["a text", "another one"])
    assert appliance.metric("vllm:request_params_n_count") == asked  # (no such parameters: vLLM's pooling requests)
    client.completions.create(model=MODEL, prompt="Scored alone", max_tokens=0, echo=True)
    client.completions.create(model=MODEL, prompt="Then", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while counts()[0] < tokens + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts() == (tokens + 3, firsts + 1)
    assert stopped() == stops_before + 2


def test_text_offsets_stay_on_the_text_where_tokens_split_characters(client):
    """A token holding part of a character (its text a U+FFFD) moves text_offset only once the character is whole:
    every whole token is found at its offset in the choice's text, streamed or not (they had counted each part as a
    character, and every later offset was off)."""
    prompt = "我爱你 and the capital of France is"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    text, lp = whole.text, whole.logprobs
    assert "\ufffd" in "".join(lp.tokens[:8]), "the prompt's characters no longer split: pick another"
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    for token, at in zip(lp.tokens, lp.text_offset, strict=True):
        assert "\ufffd" in token or text[at:at + len(token)] == token, (token, at, text)
    assert lp.text_offset[lp.tokens.index(" and")] == 3
    streamed = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_streamed_logprobs_cover_every_token_even_when_text_is_held_back(client):
    # the stop string holds text back; its tokens' logprobs must still all arrive
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                            logprobs=1, stream=True, stop=["</answer-never-appears>"],
                                            stream_options={"include_usage": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert len(tokens) == chunks[-1].usage.completion_tokens == 12
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(set(offsets)) == len(offsets)


def test_stream_lines_survive_unicode_line_separators(appliance):
    """Echoed text holding U+2028, U+2029 and U+0085 (which a sampled token can hold too) arrives escaped: a
    client that splits lines as str.splitlines does (httpx's aiter_lines) still reads whole JSON events; so does
    the first event of a long prompt echoed with its logprobs (encoded off the event loop, with msgspec)."""
    for prompt, logprobs in (("one\u2028two\u2029three\x85four", None), ("one\u2028two\u2029three\x85four " * 30, 1)):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "stream": True,
                "logprobs": logprobs}
        with httpx.stream("POST", appliance.url + "/v1/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        events = [json.loads(line[6:]) for line in lines]  # each line a whole event
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]).startswith(prompt)
        if logprobs:
            first = events[0]["choices"][0]["logprobs"]
            assert len(first["tokens"]) > 64 and "".join(first["tokens"]).startswith("one")  # (a separator's three
            # bytes are tokens of their own, each "\ufffd" alone, as OpenAI's token strings show them)
            assert first["token_logprobs"][0] is None and all(v <= 0 for v in first["token_logprobs"][1:])



def test_embeddings_are_the_models_normalized_last_hidden_states(client):
    """/v1/embeddings with the official client: each input's vector is the last token's final hidden state,
    L2-normalized, as transformers computes it for the same file (cosine > 0.99: the default spec's int16
    activations and bfloat16 KV cache); the client's default base64 encoding decodes to the float one; token ids
    give the text's vector; usage counts the inputs' tokens; a near paraphrase is nearer than an unrelated text."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec

    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock markets fell sharply today."]
    got = client.embeddings.create(model=MODEL, input=texts)  # base64, decoded by the client
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    vectors = np.array([d.embedding for d in got.data])
    assert [d.index for d in got.data] == [0, 1, 2] and vectors.shape == (3, 576)
    assert np.allclose(vectors, np.array([d.embedding for d in floats.data]), atol=1e-7)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    path = resolve_source(ModelSpec()).path
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(gguf_file=path.name,
                                                                                dequantize=True)).eval()
    ids = [tokenizer(t).input_ids for t in texts]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    for row, prompt in zip(vectors, ids, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        assert float(np.dot(row, torch.nn.functional.normalize(hidden, dim=0).numpy())) > 0.99
    by_ids = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float").data[0].embedding
    assert float(np.dot(by_ids, vectors[0])) > 0.9999
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] and similarity[0, 1] > similarity[1, 2]
    # more inputs than the engine's waiting queue holds (256): in waves of 64, every one answered in order
    many = [f"{texts[i % 3]} ({i})" for i in range(300)]
    waves = client.embeddings.create(model=MODEL, input=many, encoding_format="float")
    assert [d.index for d in waves.data] == list(range(300))
    for i in (0, 64, 299):
        alone = client.embeddings.create(model=MODEL, input=many[i], encoding_format="float").data[0].embedding
        assert float(np.dot(alone, waves.data[i].embedding)) > 0.9999
    # one input of token ids longer than 2,048 (the limit counts inputs, not a list's tokens)
    long_ids = (ids[2] * 400)[:2100]
    assert client.embeddings.create(model=MODEL, input=long_ids).usage.prompt_tokens == 2100


def test_embeddings_pooled_as_the_spec_says(client, tmp_path):
    """model.pooling "mean" reaches /v1/embeddings: each input's vector is the mean of transformers' final hidden
    states of its tokens, L2-normalized (the default server's last-token vector is another), asked twice (the
    second time its prompt's blocks are cached: a mean-pooled input computes its prompt whole all the same)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec
    from tests.server.conftest import BASE_SPEC, Appliance

    app = Appliance(tmp_path, BASE_SPEC, ("model.pooling=mean",)).wait_ready()
    try:
        pooled = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
        texts = ["The cat sat on the mat.", "Stock markets fell sharply today, and again in the evening."]
        got = [pooled.embeddings.create(model=MODEL, input=texts, encoding_format="float") for _ in range(2)]
    finally:
        app.stop()
    last = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    path = resolve_source(ModelSpec()).path
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(gguf_file=path.name,
                                                                                dequantize=True)).eval()
    for i, text in enumerate(texts):
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer(text).input_ids]), output_hidden_states=True).hidden_states[-1][0]
        want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).numpy()
        for answer in got:
            assert float(np.dot(answer.data[i].embedding, want)) > 0.999
        assert float(np.dot(last.data[i].embedding, want)) < 0.99


def test_speculative_decoding_streams_the_answer_the_plain_server_gives(appliance, client, tmp_path):
    """The appliance with n-gram drafts on (scheduler.speculative): a chat that copies its prompt, streamed (several
    tokens may come from one step) and whole, with logprobs, says what the shared appliance (drafts off) says; the
    drafts kept show in /metrics."""
    from tests.server.conftest import Appliance

    app = Appliance(tmp_path, sets=("scheduler.speculative.method=ngram",))
    drafting = openai.OpenAI(base_url=app.wait_ready().url + "/v1", api_key="unused", max_retries=0)
    text = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
            "members agreed to increase funding for the library by ten percent.")
    ask = dict(model="smollm2", messages=[{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
               temperature=0, max_tokens=48, logprobs=True, top_logprobs=2)
    expected = client.chat.completions.create(**ask).choices[0]
    whole = drafting.chat.completions.create(**ask).choices[0]
    streamed = list(drafting.chat.completions.create(**ask, stream=True))
    assert whole.message.content == expected.message.content and whole.finish_reason == expected.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.message.content
    ours = [t.logprob for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert ours == pytest.approx([t.logprob for t in expected.logprobs.content], abs=2e-3)
    # the engine's counters reach /metrics with its heartbeat, twice a second: where both answers took less, not yet
    deadline = time.monotonic() + 3
    while (kept := app.metric("vllm:spec_decode_num_accepted_tokens_total")) <= 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kept > 10
    assert app.stop() == 0, app.logs()[-3000:]


def test_bad_words_keep_their_tokens_out_of_the_answer(appliance, client):
    """vLLM's bad_words: greedy, the answer to the capital of France holds " Paris" (one token); with "Paris" a bad
    word it does not, and the answer is otherwise the model's greedy one up to there. The Responses API refuses it."""
    def ids(text):
        return httpx.post(appliance.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    def answer(**extra):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
            max_tokens=24, logprobs=True, extra_body={"return_tokens_as_token_ids": True, **extra})
        return [int(t.token.removeprefix("token_id:")) for t in chat.choices[0].logprobs.content]

    banned = {tuple(ids("Paris")), tuple(ids(" Paris"))}
    assert (ids(" Paris")[0],) in banned and len(ids(" Paris")) == 1
    plain, held = answer(), answer(bad_words=["Paris"])
    at = plain.index(ids(" Paris")[0])
    assert held[:at] == plain[:at] and held[at] != plain[at]
    assert not any(tuple(held[i:i + len(word)]) == word for word in banned for i in range(len(held)))
    blank = httpx.post(appliance.url + "/v1/completions", json={"prompt": "Hi", "bad_words": ["ok", "  "]})
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "bad_words"
    refused = httpx.post(appliance.url + "/v1/responses", json={"input": "Hi", "bad_words": ["x"]})
    assert refused.status_code == 400 and "bad_words" in refused.text
