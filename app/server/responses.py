"""OpenAI's Responses API (`POST /v1/responses`) on the chat machinery.

A request becomes a chat completion request (`ResponsesRequest.chat_fields`): the same template, tool plan, grammar
and readers run it, and the answer's fields (thinking, text, tool calls) become the Responses API's output items,
whole or as its stream of typed events; one answer a request (no `n`). Where server.responses_store keeps them
(response_store.py), a response asked with `store: true` is kept with the conversation that led to it:
`previous_response_id` continues it (its input items and output come before the request's own, as OpenAI's do; its
instructions do not), `GET /v1/responses/{id}` reads it back and `DELETE` drops it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from app.server.errors import APIError, from_validation_error
from app.server.generation import Generation
from app.server.openai_api import (AnswerReader, chat_logprobs, chat_message, collect, read_body, sse_json,
                                   start_chat, stream_error)
from app.server.protocol import ChatCompletionRequest, ResponseDeleted, ResponsesRequest


async def responses(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: ResponsesRequest = await read_body(request, ResponsesRequest)
    ctx.check_model(body.model)
    conversation = await _continued(ctx, body)
    try:
        chat = ChatCompletionRequest.model_validate(body.chat_fields())
    except ValidationError as exc:
        raise _in_responses_terms(from_validation_error(exc)) from None
    try:
        gen, forced, reader = await start_chat(ctx, chat)
    except APIError as exc:
        raise _in_responses_terms(exc) from None
    answer = _Answer(gen, body, ctx.served_name, conversation if body.store and ctx.responses.enabled else None,
                     ctx.sampling_defaults.get("max_tokens"))
    if body.stream:
        return StreamingResponse(_encode(answer, reader(), ctx.responses), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    await collect(gen, request)
    seq = gen.sequences[0]
    message = chat_message(seq, forced, reader())
    fields = message["message"]
    reasoning, text = fields.get("reasoning"), fields.get("content")
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in fields.get("tool_calls") or ()]
    answer.finished(seq.text.finish_reason.value if seq.text.finish_reason else None)
    logprobs = answer.logprobs(seq.text.token_ids, seq.text.logprobs)
    response = answer.response(answer.items(reasoning, text, calls, logprobs))
    await answer.keep(ctx.responses, response)
    return JSONResponse(response)


async def stored(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response as it was answered; DELETE: drop it (OpenAI's answers)."""
    ctx = request.app.state.ctx
    response_id = request.path_params["response_id"]
    record = await ctx.responses.get(response_id) if ctx.responses.enabled else None
    if record is None:
        kept = "" if ctx.responses.enabled else " (server.responses_store is 0: this server keeps no responses)"
        raise APIError(404, f"Response with id '{response_id}' not found{kept}.", "response_id", "not_found")
    if request.method == "DELETE":
        if not await ctx.responses.delete(response_id):  # (deleted by another request meanwhile)
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id", "not_found")
        return JSONResponse(ResponseDeleted(id=response_id).model_dump())
    return JSONResponse(record["response"])


async def _continued(ctx, body: ResponsesRequest) -> list[dict]:
    """The input items the answer reads, as JSON (what a stored response keeps): where `previous_response_id` names
    a stored response, its conversation and output come first (and join `body.input`)."""
    own = [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in body.input]
    if body.previous_response_id is None:
        return own
    if not ctx.responses.enabled:
        raise APIError(400, "previous_response_id: this server keeps no responses (server.responses_store is 0); "
                            "send the whole conversation in input", "previous_response_id", "invalid_value")
    record = await ctx.responses.get(body.previous_response_id)
    if record is None:  # (OpenAI's answer)
        raise APIError(400, f"Previous response with id '{body.previous_response_id}' not found.",
                       "previous_response_id", "previous_response_not_found")
    try:
        earlier = ResponsesRequest.model_validate({"input": record["conversation"] + record["response"]["output"]})
    except ValidationError as exc:  # (a function call that max_output_tokens cut: its arguments are no JSON)
        reason = from_validation_error(exc).message
        raise APIError(400, f"previous_response_id: response '{body.previous_response_id}' cannot be continued: "
                            f"{reason}", "previous_response_id", "invalid_value") from None
    body.input = earlier.input + body.input
    # kept as validated: what the answer reads, without the output's logprobs and ids (each turn keeps the chain)
    return [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in earlier.input] + own


def _in_responses_terms(error: APIError) -> APIError:
    """A chat field's error under the Responses API's names: `input` for the messages (whose positions differ from
    the input's items: the instructions come first, calls join their assistant message), `max_output_tokens`,
    `text.format`; the tools' paths (`tools.<i>.function.parameters` -> `tools.<i>.parameters`)."""
    names = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
             "response_format": "text.format", ".function.": "."}
    param, message = error.param, error.message
    if param is not None and param.startswith("messages"):
        param = "input"
    for chat_name, name in names.items():
        param = param.replace(chat_name, name) if param is not None else None
        message = message.replace(chat_name, name)
    return APIError(error.status, message, param, error.code, error.headers)


class _Answer:
    """One response: its ids, its output items as they are made, and the response object around them."""

    def __init__(self, gen: Generation, body: ResponsesRequest, model: str, conversation: list[dict] | None = None,
                 default_max_tokens: int | None = None):
        self.gen, self.body, self.model = gen, body, model
        self.conversation = conversation  # None: not to be stored
        # what the response reports is what ran: the spec's or the model's defaults where the body left a field out
        self.max_output_tokens = body.max_output_tokens if body.max_output_tokens is not None else default_max_tokens
        self.id = body.request_id or f"resp_{gen.id}"
        self.created = int(time.time())
        self.status, self.incomplete = "in_progress", None
        self.sequence = 0
        self.output: list[dict] = []  # the items written whole so far (a stream's)

    def finished(self, reason: str | None) -> None:
        """The engine's finish reason: a cut by max_output_tokens leaves the response incomplete."""
        self.status = "incomplete" if reason == "length" else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if reason == "length" else None

    def response(self, output: list[dict]) -> dict:
        body, seq = self.body, self.gen.sequences[0]
        done = self.status != "in_progress"
        usage = None
        if done:
            prompt, generated = len(seq.prompt_ids), len(seq.text.token_ids)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": seq.text.cached_tokens},
                     "output_tokens": generated,
                     "output_tokens_details": {"reasoning_tokens": self.gen.reasoning_tokens() or 0},
                     "total_tokens": prompt + generated}
        tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "error": None, "incomplete_details": self.incomplete, "instructions": body.instructions,
            "max_output_tokens": self.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": None, "store": self.conversation is not None,
            "temperature": self.gen.params.temperature if body.temperature is None else body.temperature,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_p": self.gen.params.top_p if body.top_p is None else body.top_p, "top_logprobs": body.top_logprobs,
            "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }

    async def keep(self, store, response: dict) -> None:
        """Store a finished response where it was asked to be (and the server keeps responses)."""
        if self.conversation is not None and response["status"] in ("completed", "incomplete"):
            await store.put(response, self.conversation)

    def logprobs(self, token_ids: list[int], logprobs) -> list[dict]:
        """The tokens' logprobs in the Responses API's shape (chat's: token, bytes, logprob, top_logprobs), where
        the request asked for them."""
        if not self.body.logprobs or not token_ids:
            return []
        return chat_logprobs(self.gen.tokenizer, token_ids, logprobs)["content"]

    def items(self, reasoning: str | None, text: str | None, calls: list[tuple[str, str, str]],
              logprobs: list[dict] = ()) -> list[dict]:
        """A whole answer's output items: its thinking, its text (with `logprobs`), then its function calls (the
        order it wrote them)."""
        out = []
        if reasoning:
            out.append(_reasoning_item(self._item_id("rs"), reasoning))
        if text or not (reasoning or calls):  # (an empty answer is an empty message, as OpenAI's: never no output)
            out.append(_message_item(self._item_id("msg"), text or "", logprobs))
        out += [_call_item(self._item_id("fc"), call_id, name, arguments) for call_id, name, arguments in calls]
        if out and self.status == "incomplete":
            out[-1]["status"] = "incomplete"  # the item the cut ended
        return out

    def _item_id(self, kind: str) -> str:
        return f"{kind}_{uuid.uuid4().hex}"

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    async def events(self, reader: AnswerReader) -> AsyncIterator[dict]:
        """The stream: response.created, then each output item opened, its deltas, and closed, then
        response.completed (or response.incomplete)."""
        yield self._event("response.created", response=self.response([]))
        yield self._event("response.in_progress", response=self.response([]))
        output = self.output
        item: dict | None = None  # the item being written
        calls: dict[int, dict] = {}  # a stream's tool call index -> its item
        pending: list[dict] = []  # logprobs of tokens no text delta carried yet (a thinking block's, the end token)
        async for event in self.gen.events():
            last = event.finish_reason is not None
            pending += self.logprobs(event.token_ids, event.logprobs)
            delta = reader.feed(event.text, last=last)
            pieces = [("reasoning", delta["reasoning"])] if delta.get("reasoning") else []
            pieces += [("text", delta["content"])] if delta.get("content") else []
            pieces += [("call", call) for call in delta.get("tool_calls") or ()]
            for kind, piece in pieces:
                opened = kind == "call" and piece["index"] not in calls
                if item is None or item["kind"] != kind or opened:
                    for e in self._close(item, output):
                        yield e
                    item = self._open(kind, piece, len(output), calls)
                    for e in item.pop("opening"):
                        yield e
                target = calls[piece["index"]] if kind == "call" else item
                text = piece.get("function", {}).get("arguments", "") if kind == "call" else piece
                if text:
                    target["text"] += text
                    extra = {"content_index": 0} if kind != "call" else {}
                    if kind == "text":  # the logprobs of the tokens since the last text delta (where asked)
                        extra["logprobs"], pending = pending, []
                        target["logprobs"] += extra["logprobs"]
                    yield self._event(target["delta"], item_id=target["item"]["id"], output_index=target["index"],
                                      delta=text, **extra)
            if last:
                self.finished(event.finish_reason)
                if item is None and not output:  # nothing written: an empty message, as the whole answer has
                    item = self._open("text", "", len(output), calls)
                    for e in item.pop("opening"):
                        yield e
                if item is not None and item["kind"] == "text":
                    item["logprobs"] += pending  # the end token's
                for e in self._close(item, output, "incomplete" if self.status == "incomplete" else "completed"):
                    yield e
                item = None
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        yield self._event(kind, response=self.response(output))

    def _open(self, kind: str, piece, index: int, calls: dict[int, dict]) -> dict:
        if kind == "reasoning":
            item = {**_reasoning_item(self._item_id("rs"), ""), "status": "in_progress"}
            opening = [self._event("response.output_item.added", output_index=index, item=item)]
            state = {"delta": "response.reasoning_text.delta"}
        elif kind == "text":
            item = {**_message_item(self._item_id("msg"), ""), "status": "in_progress", "content": []}
            opening = [self._event("response.output_item.added", output_index=index, item=item),
                       self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part(""))]
            state = {"delta": "response.output_text.delta"}
        else:
            function = piece.get("function", {})
            item = {**_call_item(self._item_id("fc"), piece.get("id", ""), function.get("name", ""), ""),
                    "status": "in_progress"}
            opening = [self._event("response.output_item.added", output_index=index, item=item)]
            state = {"delta": "response.function_call_arguments.delta"}
        state.update(kind=kind, item=item, index=index, text="", logprobs=[], opening=opening)
        if kind == "call":
            calls[piece["index"]] = state
        return state

    def _close(self, state: dict | None, output: list[dict], status: str = "completed") -> list[dict]:
        """`status`: "incomplete" for the item a max_output_tokens cut ended (a call's arguments then are not
        whole JSON)."""
        if state is None:
            return []
        item, index, text = state["item"], state["index"], state["text"]
        events = []
        if state["kind"] == "reasoning":
            done = _reasoning_item(item["id"], text)
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text))
        elif state["kind"] == "text":
            done = _message_item(item["id"], text, state["logprobs"])
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=state["logprobs"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part(text, state["logprobs"]))]
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text)
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=text))
        done["status"] = status
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        output.append(done)
        return events


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _text_part(text: str, logprobs: list[dict] = ()) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _message_item(item_id: str, text: str, logprobs: list[dict] = ()) -> dict:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [_text_part(text, logprobs)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


async def _encode(answer: _Answer, reader: AnswerReader, store=None) -> AsyncIterator[bytes]:
    """Server-sent events as OpenAI sends the Responses API's: `event: <type>` and `data: <json>`; a failure is an
    `error` event, then `response.failed`. The last event's response is the one stored."""
    try:
        async for event in answer.events(reader):
            if event["type"] in ("response.completed", "response.incomplete"):
                await answer.keep(store, event["response"])
            yield _sse(event)
    except Exception as exc:  # whatever happens, the client gets an error event (the chat stream's rules)
        error = stream_error(exc)
        yield _sse(answer._event("error", code=error.code, message=error.message, param=error.param))
        answer.status = "failed"
        failed = {**answer.response(answer.output), "error": {"code": error.code or "server_error",
                                                               "message": error.message}}
        yield _sse(answer._event("response.failed", response=failed))


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {sse_json(event)}\n\n".encode()
