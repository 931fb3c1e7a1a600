"""POST /v1/completions and POST /v1/chat/completions: JSON in, engine requests out, JSON or SSE back."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import json
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from app.engine.params import SamplingParams
from app.server.engine_client import EngineRejected, EngineUnavailable
from app.server import beam
from app.server.beam import check_beam_request
from app.server.errors import APIError, error_body, from_validation_error
from app.server.generation import Event, Generation, ShuttingDown
from app.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, json_value
from app.server.reasoning import ReasoningReader
from app.server.tools import ToolPlan, parameters_schema
from app.server.tools import plan as plan_tools

log = logging.getLogger("app.server")
MAX_SEQUENCES = 64  # prompts x n in one request: more would let one client fill the waiting queue

async def read_body(request: Request, model):
    """The body as `model`; anything JSON or the tokenizer cannot take is a 400 that names the problem."""
    data = await read_json(request)
    header = request.headers.get("x-request-id")
    if header and "request_id" in model.model_fields:  # vLLM's: the header wins over the body's request_id
        data["request_id"] = header
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def read_json(request: Request) -> dict:
    """The body's JSON object (read once a request: kept in request.state); what is no JSON object is a 4xx."""
    if getattr(request.state, "json", None) is not None:
        return request.state.json
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed", None,
                       "unsupported_media_type")
    try:
        raw = await request.body()
    except ClientDisconnect:  # hung up before the body was all there: nobody to answer, nothing to log
        raise APIError(499, "the client closed the connection") from None
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    where = None
    if _may_hold_surrogates(raw, data):  # (its JSON path only where the walk is short: 1.6 s for 2M numbers)
        where = _lone_surrogate(data) if len(raw) <= SURROGATE_WALK_BYTES else ""
    if where is not None:
        raise APIError(400, f"{where or 'the body'}: a string holds a lone UTF-16 surrogate (such as \\ud800), "
                            f"which is not Unicode text", where or None, "invalid_json")
    request.state.json = data
    return data


def parse_json(raw: bytes):
    try:
        return json_value(raw)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply", None, "invalid_json") from None
    except UnicodeDecodeError as exc:  # (JSON is UTF-8; Python's json would guess UTF-16 and UTF-32 too)
        raise APIError(400, f"the request body is not UTF-8 text (byte {exc.start}: {exc.reason})", None,
                       "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, NaN or an overflowing number, an integer of thousands of digits
        what = "it holds an integer of over 4,300 digits" if "integer string conversion" in str(exc) else exc
        raise APIError(400, f"the request body is not valid JSON: {what}", None, "invalid_json") from None


def _may_hold_surrogates(raw: bytes, data) -> bool:
    """Whether a JSON text can hold a UTF-16 surrogate: only as a \\uD800-\\uDFFF escape (UTF-8 cannot encode one).
    Most bodies have none, and skip _lone_surrogate's walk (a second of the event loop for 2M numbers); those with
    emoji escaped by an ASCII-only encoder (surrogate pairs, all sound) take the walk only where one is alone."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return False
    try:
        json.dumps(data, ensure_ascii=False).encode()  # (C's speed: only a lone surrogate fails to encode)
        return False
    except UnicodeEncodeError:
        return True


SURROGATE_WALK_BYTES = 1 << 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _lone_surrogate(data) -> str | None:
    """The JSON path of the first string (or key) that is not valid Unicode, or None. Iterative: no depth limit."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode()
                except UnicodeEncodeError:
                    return path.encode("utf-8", "backslashreplace").decode()  # the path may hold it too
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((f"{path}.{key}" if path else str(key), key))
                stack.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


async def completions(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: CompletionRequest = await read_body(request, CompletionRequest)
    ctx.check_model(body.model)
    texts = await ctx.prompt_ids(body.prompt, add_special_tokens=body.add_special_tokens is not False,
                                 bounded=body.truncate_prompt_tokens is None)
    room = ctx.room_asked(body.max_tokens, body.min_tokens)
    prompts = [body.truncated(ids, ctx.max_model_len, room) for ids in texts]
    if len(prompts) * body.n > MAX_SEQUENCES:
        raise APIError(400, f"{len(prompts)} prompts x n={body.n} is more than {MAX_SEQUENCES} sequences", "n",
                       "invalid_value")
    if body.use_beam_search:
        check_beam_request(body)
        return JSONResponse(await beam.completion_answer(ctx, request, body, prompts))
    # echo with logprobs scores the prompt too (OpenAI's legacy API, vLLM's; lm-evaluation-harness asks this way)
    scored = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    gen = await _generation(ctx, body, body.logprobs, "cmpl", prompt_logprobs=max(scored, default=None))
    gen.prompt_only = body.max_tokens == 0  # (only with echo): the engine generates one token, not shown
    for ids in prompts:
        add_prompt(gen, ids, body.n, ctx.output_limit(ids, 1 if gen.prompt_only else body.max_tokens, "max_tokens",
                                                       "prompt", body.min_tokens))
    echo = [await ctx.text.decode(ids) for ids in prompts] if body.echo else None
    await start_generation(gen)
    if body.stream:
        return _sse(_completion_chunks(gen, body, ctx.served_name, echo, ctx.text.run))
    events = await collect(gen, request)

    def answer() -> dict:
        choices = []
        for seq in gen.sequences:
            generated = "" if gen.prompt_only else seq.text.text
            text = generated if echo is None else echo[seq.index // body.n] + generated
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs_of(ctx.tokenizer, *_shown_logprobs(gen, seq, body.echo),
                                                   body.logprobs, as_ids=body.return_tokens_as_token_ids)
            choice = {"index": seq.index, "text": text, "logprobs": logprobs,
                      "finish_reason": "length" if gen.prompt_only else _reason(seq),
                      "stop_reason": None if gen.prompt_only else seq.text.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(ctx.tokenizer, seq, body.prompt_logprobs)
            choices.append(choice)
        return {"id": gen.response_id, "object": "text_completion", "created": int(time.time()),
                "model": ctx.served_name, "choices": choices, "usage": _usage(gen, events)}

    return await json_answer(ctx, answer, gen.params.scores_prompt)


async def chat_completions(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
    ctx.check_model(body.model)
    if body.use_beam_search:
        return JSONResponse(await _beam_chat(ctx, request, body))
    gen, forced, reader = await start_chat(ctx, body)
    if body.stream:
        return _sse(_chat_chunks(gen, body, ctx.served_name, forced, reader))
    events = await collect(gen, request)
    choices = [{"index": s.index, **chat_message(s, forced, reader(), body.echoed()),
                "logprobs": chat_logprobs(ctx.tokenizer, s.text.token_ids, s.text.logprobs,
                                          body.return_tokens_as_token_ids) if body.logprobs else None}
               for s in gen.sequences]

    def answer() -> dict:
        response = {"id": gen.response_id, "object": "chat.completion", "created": int(time.time()),
                    "model": ctx.served_name, "choices": choices, "usage": _usage(gen, events)}
        if body.prompt_logprobs is not None:  # vLLM's place for them in a chat answer: beside the choices
            response["prompt_logprobs"] = _vllm_prompt_logprobs(ctx.tokenizer, gen.sequences[0], body.prompt_logprobs)
        return response

    return await json_answer(ctx, answer, body.prompt_logprobs is not None)


async def _beam_chat(ctx, request: Request, body: ChatCompletionRequest) -> dict:
    check_beam_request(body)
    prompt = await ctx.chat_prompt(body.messages, body, None, add_special_tokens=bool(body.add_special_tokens),
                                   bounded=body.truncate_prompt_tokens is None)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    room = ctx.room_asked(body.output_limit(), body.min_tokens)
    return await beam.chat_answer(ctx, request, body, body.truncated(prompt.ids, ctx.max_model_len, room), param)


async def start_chat(ctx, body: ChatCompletionRequest) -> tuple[Generation, ToolPlan | None,
                                                                 Callable[[], AnswerReader]]:
    """A chat request's generation, started: the conversation rendered, its tool plan and constraint, and a maker of
    readers that split each choice's text into its fields (the chat endpoint's, and the Responses API's)."""
    structured = body.constraint() is not None
    tools = plan_tools(body, ctx.text.tool_format, structured, ctx.text.special_tags)
    prompt = await ctx.chat_prompt(body.messages, body, tools, add_special_tokens=bool(body.add_special_tokens),
                                   bounded=body.truncate_prompt_tokens is None)
    ids = body.truncated(prompt.ids, ctx.max_model_len, ctx.room_asked(body.output_limit(), body.min_tokens))
    top = (body.top_logprobs or 0) if body.logprobs else None
    forced = tools if tools is not None and tools.forced else None
    constraint = forced.constraint if forced else None
    # a held answer (structured outputs, a forced tool choice) is the grammar's: no thinking block split from it
    held = constraint is not None or structured
    thinking = prompt.thinking if ctx.text.thinks and not held else None
    keep = ctx.text.kept_tags(forced.format if forced is not None else None, thinking is not None)
    try:
        gen = await _generation(ctx, body, top, "chatcmpl", constraint, keep, body.prompt_logprobs)
    except APIError as exc:
        raise (await _tool_error(ctx, forced, exc) if forced and exc.param == "tools" else exc) from None
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    add_prompt(gen, ids, body.n, ctx.output_limit(ids, body.output_limit(), param, "messages", body.min_tokens))
    gen.thinking = thinking
    await start_generation(gen)
    return gen, forced, lambda: AnswerReader(forced, thinking)


async def json_answer(ctx, build: Callable[[], dict], big: bool) -> Response:
    """A JSON answer; a `big` one (a scored prompt's: a 6,000-token prompt's 20 most likely tokens a position are
    8.5 MB of JSON, seconds of Python; many embeddings) is built and encoded on the tokenizer's thread, and the
    event loop meanwhile serves the other requests."""
    if not big:
        return JSONResponse(build())
    # msgspec: 0.03 s for 6 MB where json.dumps holds the GIL (and so the event loop) for 0.3 s
    return Response(await ctx.text.run(lambda: msgspec.json.encode(build())), media_type="application/json")


class AnswerReader:
    """A chat choice's text as it grows, split into the message's fields: a thinking block's text (reasoning.py),
    the content, and tool calls (tools.py); `feed` gives a stream delta's fields (`last`: the answer ended)."""

    def __init__(self, tools: ToolPlan | None, thinking: bool | None):
        self.reasoning = ReasoningReader(thinking) if thinking is not None else None
        self.tools = tools.reader() if tools is not None else None

    def feed(self, text: str, last: bool) -> dict:
        reasoning, calls = "", []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if last:
                more, rest = self.reasoning.end()
                reasoning, text = reasoning + more, text + rest
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if last:
                more, rest = self.tools.finish()
                text, calls = text + more, calls + rest
        fields: dict = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
        return {**fields, **({"content": text} if text else {}), **({"tool_calls": calls} if calls else {})}


def chat_message(seq, tools: ToolPlan | None, reader: AnswerReader, echoed: str = "") -> dict:
    """A non-streamed choice's message and finish_reason: its text as content, tool calls and reasoning;
    `echoed` first in its content (ChatCompletionRequest.echoed)."""
    reason = _reason(seq)
    fields = reader.feed(seq.text.text, last=True)
    message = {"role": "assistant", "content": fields.get("content", ""), **fields}
    if "tool_calls" in fields:
        message["tool_calls"] = reader.tools.calls()  # whole calls: no stream `index`
        reason = tools.finish_reason(reason, reader.tools)
    block_only = reader.reasoning is not None and reader.reasoning.block_only
    if ("tool_calls" in fields or "reasoning" in fields or block_only) and not message["content"]:
        message["content"] = None  # as vLLM: calls or a thinking block alone (even an empty one), no content
    if echoed:
        message["content"] = echoed + (message["content"] or "")
    return {"message": message, "finish_reason": reason, "stop_reason": seq.text.stop_reason}


async def _tool_error(ctx, tools: ToolPlan, error: APIError) -> APIError:
    """A tool choice's grammar that llguidance refused: the first function whose own schema it refuses, named
    (`tools.<i>.function.parameters`; up to 128 functions), else the error as it was."""
    for i, tool in enumerate(tools.tools):
        try:
            await ctx.text.grammar("json", parameters_schema(tool, i), f"tools.{i}.function.parameters")
        except APIError as exc:
            return exc
    return error


# --- building a generation ---


async def _generation(ctx, body: SamplingFields, logprobs: int | None, prefix: str,
                      constraint: tuple[str, Any, str] | None = None, keep: tuple[int, ...] = (),
                      prompt_logprobs: int | None = None) -> Generation:
    """The request's generation; `constraint` (a forced tool choice's) in place of the body's structured output;
    `keep`: special tokens the answer's readers need in the text (AsyncTokenizer.kept_tags)."""
    bias = body.bias()
    ctx.check_token_ids(body.stop_token_ids, "stop_token_ids")
    ctx.check_token_ids([token for token, _ in bias], "logit_bias")
    ctx.check_token_ids(body.allowed_token_ids, "allowed_token_ids")
    constraint = constraint or body.constraint()
    if constraint is not None and body.allowed_token_ids:  # (a grammar allowing none of them would leave no token)
        raise APIError(400, f"allowed_token_ids cannot be combined with {constraint[2]}", "allowed_token_ids",
                       "invalid_value")
    grammar = None if constraint is None else await ctx.text.grammar(*constraint)
    if any(not word.strip() for word in body.bad_words or ()):  # (vLLM's 400 too: it would tokenize to nothing)
        raise APIError(400, "bad_words: a word of only whitespace bans nothing", "bad_words", "invalid_value")
    bad_words = await ctx.text.bad_words(body.bad_words) if body.bad_words else ()
    try:
        params = _sampling_params(body, logprobs, bias, grammar, keep, ctx.end_token_ids, prompt_logprobs,
                                  ctx.sampling_defaults, bad_words)
    except ValueError as exc:
        raise _clash(exc) from None
    return Generation(ctx.engine, ctx.metrics, ctx.tokenizer, params, ctx.eos_token_id, prefix,
                      client_id=body.request_id)


def _sampling_params(body: SamplingFields, logprobs: int | None, bias: tuple[tuple[int, float], ...],
                     grammar: str | None, keep: tuple[int, ...] = (), ends: tuple[int, ...] = (),
                     prompt_logprobs: int | None = None, defaults: dict | None = None,
                     bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    """`ends`: the model's end-of-generation tokens besides EOS, stop tokens of every request that does not ignore
    EOS (Context.end_token_ids); `defaults`: the sampling fields' where the body leaves them out (Context's)."""
    defaults = defaults or {}

    def given(name: str, neutral: float) -> float:  # the request's, else the server's default, else OpenAI's
        value = getattr(body, name)
        return defaults.get(name, neutral) if value is None else value

    return SamplingParams(
        temperature=given("temperature", 1.0), top_k=given("top_k", 0), top_p=given("top_p", 1.0),
        min_p=given("min_p", 0.0), repetition_penalty=given("repetition_penalty", 1.0),
        frequency_penalty=given("frequency_penalty", 0.0), presence_penalty=given("presence_penalty", 0.0),
        seed=None if body.seed is None else body.seed % 2**64,
        min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, stop=body.stops(),
        include_stop_str_in_output=body.include_stop_str_in_output,
        allowed_token_ids=tuple(body.allowed_token_ids or ()), bad_words_token_ids=bad_words,
        stop_token_ids=(*(body.stop_token_ids or ()), *(() if body.ignore_eos else ends)), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens, keep_special_ids=keep, logit_bias=bias, grammar=grammar,
        max_tokens=None)


def add_prompt(gen: Generation, ids: list[int], n: int, max_tokens: int) -> None:
    """`n` sequences of a prompt in `gen`; a clash of parameters or no ready replica is the client's error."""
    try:
        gen.add_prompt(ids, n, max_tokens)
    except ValueError as exc:  # parameters that clash with each other, e.g. min_tokens > max_tokens
        raise _clash(exc) from None
    except EngineUnavailable as exc:  # no replica is ready to take it
        raise _api_error(exc) from None


async def start_generation(gen: Generation) -> None:
    """Queue the sequences in the engine before answering, so that refusals get their own status."""
    try:
        await gen.start()
    except (EngineRejected, EngineUnavailable) as exc:
        raise _api_error(exc) from None


async def collect(gen: Generation, request: Request) -> list[Event]:
    """All events of a non-streaming request; a client that hangs up aborts its sequences."""
    async def consume() -> list[Event]:
        return [event async for event in gen.events()]

    work, gone = asyncio.create_task(consume()), asyncio.create_task(_disconnected(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise APIError(499, "the client closed the connection")
    gone.cancel()
    try:
        return work.result()
    except (EngineRejected, EngineUnavailable) as exc:
        raise _api_error(exc) from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _clash(exc: ValueError) -> APIError:
    """SamplingParams' refusal as a 400: its messages begin with the parameter they are about."""
    first = str(exc).split(" ", 1)[0]
    return APIError(400, str(exc), first if first.isidentifier() else None, "invalid_value")


def _api_error(exc: EngineRejected | EngineUnavailable) -> APIError:
    """The HTTP error for an engine that refused a request or is not there."""
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), None, "shutting_down")
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), None, "engine_unavailable")
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return APIError(exc.status, exc.message, None, "queue_full" if exc.status == 429 else "rejected", headers)


def _reason(seq) -> str | None:
    reason = seq.text.finish_reason
    return reason.value if reason is not None else None


def _usage(gen: Generation, events: list[Event] | None = None) -> dict:
    prompts = {id(s.prompt_ids): len(s.prompt_ids) for s in gen.sequences}
    prompt_tokens = sum(prompts.values())
    completion_tokens = 0 if gen.prompt_only else sum(len(s.text.token_ids) for s in gen.sequences)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": gen.cached_tokens()}}
    reasoning = gen.reasoning_tokens()
    if reasoning is not None:  # a thinking model's chat: the tokens that wrote its blocks (OpenAI's)
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


# --- streaming ---


def _counted(chunk: dict, gen: Generation, body: SamplingFields) -> dict:
    """A stream chunk, with the request's usage so far where vLLM's continuous_usage_stats asks for it."""
    options = body.stream_options
    if options is not None and options.include_usage and options.continuous_usage_stats:
        chunk["usage"] = _usage(gen)
    return chunk


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def encode() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:  # (a chunk already encoded, as bytes, is an event as it is)
                yield chunk if isinstance(chunk, bytes) else sse_event(chunk)
        except Exception as exc:  # whatever happens, the client gets an error event and the end of the stream
            yield _sse_error(stream_error(exc))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def stream_error(exc: Exception) -> APIError:
    """The error event of a stream that failed: an engine's refusal or absence as the JSON answer would carry it,
    anything else an internal error (logged)."""
    if isinstance(exc, (EngineRejected, EngineUnavailable)):
        return _api_error(exc)
    log.error("a stream failed", exc_info=exc)
    return APIError(500, "internal server error", None, "internal_error")


# Characters str.splitlines() breaks lines at that json.dumps leaves raw (it escapes those below U+0020). SSE
# lines end at CR or LF only, but clients split with splitlines-like decoders (httpx's aiter_lines is one): a
# sampled token holding U+2028 cut our own benchmark's JSON in two. Escaped, the event is the same JSON.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_LINE_BREAK_BYTES = [(char.encode(), escaped.encode()) for char, escaped in (
    ("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))]  # (UTF-8: no other character holds these)


def sse_json(chunk: dict) -> str:
    return json.dumps(chunk, ensure_ascii=False).translate(_LINE_BREAKS)


def sse_event(chunk: dict, fast: bool = False) -> bytes:
    """`chunk` as one server-sent event; `fast`: encoded with msgspec (a big chunk, on the tokenizer's thread: 10x
    json.dumps' speed, holding the GIL a tenth as long), the same JSON."""
    if not fast:
        return f"data: {sse_json(chunk)}\n\n".encode()
    encoded = msgspec.json.encode(chunk)
    for raw, escaped in _LINE_BREAK_BYTES:
        encoded = encoded.replace(raw, escaped)
    return b"data: " + encoded + b"\n\n"


def _sse_error(error: APIError) -> bytes:
    return f"data: {json.dumps(error_body(error.status, error.message, error.param, error.code))}\n\n".encode()


async def _completion_chunks(gen: Generation, body: CompletionRequest, model: str, echo: list[str] | None,
                             run: Callable) -> AsyncIterator[dict]:
    """`run`: the tokenizer thread's runner (AsyncTokenizer.run), for the logprobs of an echoed prompt."""
    created = int(time.time())
    echoed: set[int] = set()
    offsets: dict[int, TextOffsets] = {}  # text_offset continues across a choice's chunks
    async for event in gen.events():
        text, token_ids, token_logprobs = ("", [], []) if gen.prompt_only else \
            (event.text, event.token_ids, event.logprobs)
        if echo is not None and event.index not in echoed:  # the prompt, with its logprobs where asked, comes first
            echoed.add(event.index)
            text = echo[event.index // body.n] + text
            prompt = gen.sequences[event.index]
            if body.logprobs is not None and prompt.text.prompt_logprobs is not None:
                token_ids = [*prompt.prompt_ids, *token_ids]
                token_logprobs = [*prompt.text.prompt_logprobs, *token_logprobs]
        with_logprobs = body.logprobs is not None and token_logprobs
        reason = "length" if gen.prompt_only and event.finish_reason else event.finish_reason
        if not text and reason is None and not with_logprobs:
            continue
        logprobs, big = None, with_logprobs and len(token_logprobs) > 64  # a prompt's: MBs of JSON
        if with_logprobs:
            if event.index not in offsets:
                offsets[event.index] = TextOffsets()
            build = functools.partial(_completion_logprobs_of, gen.tokenizer, token_ids, token_logprobs,
                                      body.logprobs, offsets[event.index], body.return_tokens_as_token_ids)
            logprobs = await run(build) if big else build()  # (a big one off the event loop)
        chunk = _counted({"id": gen.response_id, "object": "text_completion", "created": created, "model": model,
                          "choices": [{"index": event.index, "text": text, "logprobs": logprobs,
                                       "finish_reason": reason,
                                       "stop_reason": None if gen.prompt_only else event.stop_reason}]}, gen, body)
        yield await run(lambda chunk=chunk: sse_event(chunk, fast=True)) if big else chunk  # encoded there too
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": gen.response_id, "object": "text_completion", "created": created, "model": model,
               "choices": [], "usage": _usage(gen)}


async def _chat_chunks(gen: Generation, body: ChatCompletionRequest, model: str, tools: ToolPlan | None,
                       reader: Callable[[], AnswerReader]) -> AsyncIterator[dict]:
    created = int(time.time())
    base = {"id": gen.response_id, "object": "chat.completion.chunk", "created": created, "model": model}
    for seq in gen.sequences:  # the role comes first, as OpenAI sends it
        yield _counted({**base, "choices": [{"index": seq.index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]}, gen, body)
    if body.echoed():  # then the echoed prefill, a chunk for each choice (vLLM's)
        for seq in gen.sequences:
            yield _counted({**base, "choices": [{"index": seq.index, "delta": {"content": body.echoed()},
                                                 "logprobs": None, "finish_reason": None}]}, gen, body)
    readers = {seq.index: reader() for seq in gen.sequences}
    async for event in gen.events():
        reason = event.finish_reason
        delta = readers[event.index].feed(event.text, last=reason is not None)
        if reason is not None and tools is not None:
            reason = tools.finish_reason(reason, readers[event.index].tools)
        if not delta and reason is None and not (body.logprobs and event.logprobs):
            continue
        logprobs = chat_logprobs(gen.tokenizer, event.token_ids, event.logprobs,
                                 body.return_tokens_as_token_ids) if body.logprobs else None
        yield _counted({**base, "choices": [{"index": event.index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": reason, "stop_reason": event.stop_reason}]}, gen, body)
    if body.stream_options and body.stream_options.include_usage:
        yield {**base, "choices": [], "usage": _usage(gen)}


# --- logprobs in OpenAI's two shapes ---


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """A token's own bytes (OpenAI's logprobs `bytes`): its text's UTF-8, but where it holds only part of a
    character (its text a U+FFFD), the bytes the token stands for, from its byte-level BPE piece (GPT-2's alphabet
    of 256 characters) or its byte-fallback piece (<0xE9>), so that a client can join the tokens' bytes into the
    answer's text."""
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return [int(piece[3:5], 16)]
        decoder = _byte_level_alphabet()
        if piece and all(c in decoder for c in piece):
            return [decoder[c] for c in piece]
    return list(text.encode())


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _shown_logprobs(gen: Generation, seq, echo: bool) -> tuple[list[int], list]:
    """A non-streamed completion choice's tokens and their logprobs: with echo, the prompt's first (the first
    token's None), then the generated ones (none with max_tokens 0)."""
    token_ids, logprobs = ([], []) if gen.prompt_only else (seq.text.token_ids, seq.text.logprobs)
    if echo and seq.text.prompt_logprobs is not None:
        return [*seq.prompt_ids, *token_ids], [*seq.text.prompt_logprobs, *logprobs]
    return token_ids, logprobs


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its text}


def _token_texts(tokenizer) -> Callable[[int], str]:
    """Each token id's text (`decode([id])`), decoded once per tokenizer: logprobs name the same tokens over and
    over (a scored prompt's top tokens at every position)."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXTS[tokenizer] = {}

    def text(token_id: int) -> str:
        found = texts.get(token_id)
        if found is None:
            found = texts[token_id] = tokenizer.decode([token_id])
        return found

    return text


class TextOffsets:
    """A choice's `text_offset`s: the character of the text in which each token's first byte falls. A token that
    holds part of a character (its own text a U+FFFD) adds to the count only once the character is whole, so the
    offsets stay on the text the choice returns, as its `text` has each character once."""

    def __init__(self) -> None:
        self._chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, data: bytes) -> int:
        """The offset of a token of these bytes, the next in the text."""
        at = self._chars
        self._chars += len(self._utf8.decode(data))
        return at


def _completion_logprobs_of(tokenizer, token_ids: list[int], logprobs, k: int,
                            offsets: TextOffsets | None = None, as_ids: bool = False) -> dict:
    """OpenAI's legacy shape, `k` most likely tokens at each position besides the token; a None entry (an echoed
    prompt's first token) has a token and an offset only. `offsets`: where the choice's earlier chunks left off;
    `as_ids`: tokens named "token_id:<id>" (vLLM's return_tokens_as_token_ids; the offsets stay the text's)."""
    decode = _token_texts(tokenizer)
    name = _as_id if as_ids else decode
    texts = [decode(t) for t in token_ids[: len(logprobs)]]
    tokens = [name(t) for t in token_ids[: len(logprobs)]] if as_ids else texts
    where = offsets if offsets is not None else TextOffsets()
    text_offset = [where.take(bytes(token_bytes(tokenizer, t, text))) for t, text in zip(token_ids, texts)]
    # as OpenAI's and vLLM's: the sampled token is always among its position's top logprobs (up to logprobs + 1)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _clamped(lp.logprob) for lp in logprobs],
            "top_logprobs": [None if lp is None else {**{name(t): _clamped(p) for t, p in lp.top[:k]},
                                                      token: _clamped(lp.logprob)}
                             for token, lp in zip(tokens, logprobs)],
            "text_offset": text_offset}


def _as_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def _clamped(logprob: float) -> float:
    """-inf (a token the model rules out entirely) as vLLM writes it: JSON has no infinity."""
    return max(logprob, -9999.0)


def _vllm_prompt_logprobs(tokenizer, seq, k: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id: {"logprob", "rank",
    "decoded_token"}} for the token itself and the k most likely there (ranks 1 to k)."""
    if seq.text.prompt_logprobs is None:  # the request ended before its prompt was computed
        return None
    decode = _token_texts(tokenizer)

    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": _clamped(logprob), "rank": rank, "decoded_token": decode(token_id)}

    return [None if lp is None else {str(token): entry(token, lp.logprob, lp.rank),
                                     **{str(t): entry(t, p, i + 1) for i, (t, p) in enumerate(lp.top[:k])
                                        if t != token}}
            for token, lp in zip(seq.prompt_ids, seq.text.prompt_logprobs, strict=False)]


def chat_logprobs(tokenizer, token_ids: list[int], logprobs, as_ids: bool = False) -> dict:
    """OpenAI's chat shape; `as_ids`: tokens named "token_id:<id>" (vLLM's return_tokens_as_token_ids), their
    `bytes` still the token's own."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": _as_id(token_id) if as_ids else text, "logprob": _clamped(logprob),
                "bytes": token_bytes(tokenizer, token_id, text)}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, p) for i, p in lp.top]}
                        for t, lp in zip(token_ids, logprobs, strict=False)]}
