"""The Responses API's store (server.responses_store), with the official openai client: `previous_response_id`
continues a stored response as the same conversation sent whole would (its tool calls and their results too), across
HTTP workers; streamed responses are kept as answered; `GET` reads them back, `DELETE` and the capacity drop them;
without the store, the default server says so."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import BASE_SPEC, Appliance

MODEL = "smollm2"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False}}]


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A server that keeps its 3 newest responses, with two HTTP workers (a continuation may land on either)."""
    app = Appliance(tmp_path_factory.mktemp("store"), BASE_SPEC,
                    ("server.responses_store=3", "server.workers=2")).wait_ready()
    yield openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
    assert app.stop() == 0, app.logs()[-3000:]


def _ask(client, **fields):
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 16, **fields})


def test_a_continuation_is_the_conversation_sent_whole(kept):
    """The stored response's input and output come before the new input; its instructions do not (each request
    gives its own); the same questions sent whole read the same tokens and get the same answer."""
    first = _ask(kept, input="My name is Ada. Say hello.", instructions="Answer in one short sentence.")
    assert first.store is True and first.previous_response_id is None
    chain = [first]
    for _ in range(2):  # continued twice (each on whichever worker takes it)
        chain.append(_ask(kept, input="What is my name?", previous_response_id=chain[-1].id))
        assert chain[-1].previous_response_id == chain[-2].id
    whole = [{"role": "user", "content": "My name is Ada. Say hello."},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "What is my name?"},
             {"role": "assistant", "content": chain[1].output_text},
             {"role": "user", "content": "What is my name?"}]
    alone = _ask(kept, input=whole, store=False)
    assert alone.store is False
    assert chain[2].usage.input_tokens == alone.usage.input_tokens
    # the same tokens again: every whole block of them but the last token's came from the prefix cache
    assert alone.usage.input_tokens_details.cached_tokens == (alone.usage.input_tokens - 1) // 16 * 16 > 0
    assert chain[2].output_text == alone.output_text


def test_tool_calls_and_their_results_continue(kept):
    """An agent's turn: the stored answer's function call, then the call's result as the next request's input."""
    call = _ask(kept, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=64)
    assert [item.type for item in call.output] == ["function_call"] and call.status == "completed"
    item = call.output[0]
    result = {"type": "function_call_output", "call_id": item.call_id, "output": "22 degrees, sunny"}
    continued = _ask(kept, input=[result], previous_response_id=call.id, tools=TOOLS)
    whole = _ask(kept, input=[{"role": "user", "content": "What is the weather in Paris?"},
                              {"type": "function_call", "call_id": item.call_id, "name": item.name,
                               "arguments": item.arguments}, result], tools=TOOLS, store=False)
    assert continued.usage.input_tokens == whole.usage.input_tokens
    assert continued.output_text == whole.output_text


def test_streamed_responses_are_kept_read_back_deleted_and_dropped_as_the_oldest(kept):
    streamed = [e for e in kept.responses.create(model=MODEL, input="Count to three.", temperature=0,
                                                  max_output_tokens=8, stream=True)]
    final = streamed[-1].response
    assert streamed[-1].type in ("response.completed", "response.incomplete") and final.store is True
    again = kept.responses.retrieve(final.id)
    assert again.id == final.id and again.output_text == final.output_text and again.status == final.status
    kept.responses.delete(final.id)
    with pytest.raises(openai.NotFoundError):
        kept.responses.retrieve(final.id)
    with pytest.raises(openai.BadRequestError, match="Previous response with id"):
        _ask(kept, input="And then?", previous_response_id=final.id)
    oldest = _ask(kept, input="One.")
    for text in ("Two.", "Three.", "Four."):  # three newer ones: the store keeps 3
        _ask(kept, input=text)
    with pytest.raises(openai.BadRequestError) as error:
        _ask(kept, input="And then?", previous_response_id=oldest.id)
    assert error.value.body["code"] == "previous_response_not_found"
    assert error.value.body["param"] == "previous_response_id"


def test_a_call_cut_short_cannot_be_continued(kept):
    """A stored function call that max_output_tokens cut (its arguments are no JSON) is a 400 naming why, not a 500."""
    for limit in range(8, 24):  # the first cut inside the call's arguments (the call's name comes first)
        cut = _ask(kept, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False, max_output_tokens=limit)
        if cut.output[-1].type == "function_call" and cut.output[-1].arguments.startswith('{"'):
            break
    assert cut.status == "incomplete" and cut.output[-1].arguments.startswith('{"')
    with pytest.raises(openai.BadRequestError, match="cannot be continued") as error:
        _ask(kept, input=[{"type": "function_call_output", "call_id": cut.output[-1].call_id, "output": "sunny"}],
             previous_response_id=cut.id, tools=TOOLS)
    assert error.value.body["param"] == "previous_response_id"


def test_without_the_store_nothing_is_kept_and_continuing_is_a_clear_400(client):
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert answer.store is False
    with pytest.raises(openai.BadRequestError, match="server.responses_store is 0") as error:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=answer.id)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError, match="keeps no responses"):
        client.responses.retrieve(answer.id)


@pytest.fixture
def client(appliance):
    return openai.OpenAI(base_url=appliance.url + "/v1", api_key="unused", max_retries=0)
