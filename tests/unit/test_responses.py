"""The Responses API's translation to chat fields and its event stream, without an engine (app/server/responses.py;
served end to end in tests/server/test_openai_client.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from app.engine.params import SamplingParams
from app.server.engine_client import EngineUnavailable
from app.server.generation import Event, Generation
from app.server.openai_api import AnswerReader
from app.server.protocol import ChatCompletionRequest, ResponsesRequest
from app.server.responses import _Answer, _encode

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_input_items_become_the_chat_conversation():
    body = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                        "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
            CALL, {**CALL, "call_id": "call_2"},
            {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "unanswered"}]},
            {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 9,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}})
    fields = body.chat_fields()
    chat = ChatCompletionRequest.model_validate(fields)  # what the chat machinery is given
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[1].text() == "Weather in \nParis?"  # parts a line apart, as vLLM joins them
    assistant = fields["messages"][2]  # both calls in one assistant turn, with the thinking before them
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"] and assistant["reasoning_content"] == "Ask."
    assert "reasoning_content" not in fields["messages"][4]  # thinking that no answer followed is dropped
    assert chat.tool_choice.function.name == "get_weather" and chat.tools[0].function.name == "get_weather"
    assert chat.max_completion_tokens == 9 and chat.response_format.json_schema.json_schema == {"type": "object"}


class _Generation:
    """What `_Answer` reads of a Generation: its id, its parameters, its one sequence, and its events (then,
    optionally, a failure); its reasoning-token count is Generation's own."""

    thinking: bool | None = None
    reasoning_tokens = Generation.reasoning_tokens

    def __init__(self, pieces: list[str], reason: str | None, failure: Exception | None = None):
        self.id, self.params = "abc", SamplingParams()
        ends = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces))]
        text = SimpleNamespace(token_ids=[7] * len(pieces), cached_tokens=0, text="".join(pieces), text_ends=ends)
        self.sequences = [SimpleNamespace(prompt_ids=[1, 2, 3], text=text)]
        self.pieces, self.reason, self.failure = pieces, reason, failure

    async def events(self):
        for i, piece in enumerate(self.pieces):
            yield Event(0, piece, [7], [], self.reason if i == len(self.pieces) - 1 and not self.failure else None)
        if self.failure is not None:
            raise self.failure


def _stream(gen: _Generation, thinking: bool | None = None) -> list[dict]:
    gen.thinking = thinking  # (as start_chat sets it)

    async def run():
        answer = _Answer(gen, ResponsesRequest.model_validate({"input": "x", "stream": True}), "m")
        return [chunk async for chunk in _encode(answer, AnswerReader(None, thinking))]

    events = []
    for chunk in asyncio.run(run()):
        kind, data = chunk.decode().split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_stream_of_thinking_then_text_and_its_cut():
    events = _stream(_Generation(["<think>I know", " it.</think>", "Paris", " is"], "length"), thinking=False)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("reasoning", "completed"), ("message", "incomplete")]
    assert done[0]["content"][0]["text"] == "I know it." and done[1]["content"][0]["text"] == "Paris is"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Paris is"
    assert events[-1]["response"]["output"] == done and events[-1]["response"]["usage"]["output_tokens"] == 4
    assert events[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 2  # (up to </think>)


def test_a_stream_that_fails_ends_with_an_error_and_response_failed():
    events = _stream(_Generation(["Par"], None, EngineUnavailable("the engine died")))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_unavailable" and "died" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"]


def test_an_empty_answer_is_one_empty_message_whole_and_streamed():
    """A response whose answer has no text (its first token ended it) holds one message with "" (OpenAI's shape):
    clients read output[0], and a continuation renders an assistant turn."""
    events = _stream(_Generation([""], "stop"))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["content"][0]["text"]) for i in done] == [("message", "")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["output"] == done
    answer = _Answer(_Generation([], "stop"), ResponsesRequest.model_validate({"input": "x"}), "m")
    assert [i["type"] for i in answer.items(None, "", [])] == ["message"]
    assert [i["type"] for i in answer.items("thought", None, [])] == ["reasoning"]  # (thinking only: no message)
