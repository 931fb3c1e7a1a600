"""The Starlette application of one frontend worker: routes, errors, OpenAPI (the request gate: gate.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
import weakref
from pathlib import Path
from typing import NamedTuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.model.source import ModelSource
from app.model.tokenizer import end_token_ids
from app.server import embeddings, openai_api, responses, scores
from app.server.config import FrontendConfig
from app.server.router import EngineRouter
from app.server.errors import APIError, error_response, from_api_error
from app.server.gate import Gate
from app.server.generation import LIVE, ShuttingDown
from app.server.metrics import EngineCollector, Metrics, render
from app.server.protocol import (ApplyTemplateRequest, ChatMessage, ChatTemplateFields, DetokenizeRequest,
                                 TokenizeRequest)
from app.server.reasoning import opens_thinking
from app.server.response_store import ResponseStore
from app.server.tools import ToolPlan, conversation as tool_conversation, plan as plan_tools
from app.server.tokenizer import AsyncTokenizer

log = logging.getLogger("app.server")
VERSION = "0.1.0"


class ChatPrompt(NamedTuple):
    ids: list[int]
    thinking: bool  # the prompt leaves a <think> block open (and answers' blocks come back apart): see reasoning.py


class Context:
    """What every handler of this worker shares."""

    def __init__(self, cfg: FrontendConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.served_name, self.max_model_len = cfg.served_name, cfg.max_model_len
        self.text = AsyncTokenizer(tokenizer, cfg.max_model_len, cfg.chat_template, cfg.reasoning)
        self.eos_token_id, self.vocab_size = self.text.eos_token_id, self.text.vocab_size
        # the model's other end-of-generation tokens: each request stops at them too (unless it ignores EOS)
        self.end_token_ids = end_token_ids(ModelSource(Path(cfg.model_path), cfg.model_format, cfg.served_name),
                                           tokenizer)
        self.sampling_defaults = cfg.sampling_defaults  # the model's and the spec's, for fields a request leaves out
        self.engine = EngineRouter(cfg.engine_addresses)
        self.metrics = Metrics(cfg.served_name)
        self.collector = EngineCollector(cfg.served_name, self.engine)
        self.created = int(time.time())
        self.responses = ResponseStore(cfg.responses_dir, cfg.responses_store)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.served_name}`.",
                           "model", "model_not_found")

    async def prompt_ids(self, prompt, param: str = "prompt", add_special_tokens: bool = True,
                         bounded: bool = True) -> list[list[int]]:
        """Each prompt's token ids; `bounded`: texts too long for the context refused first (AsyncTokenizer.encode)."""
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        for p in prompts:  # refuse a hopeless text before tokenizing any of them
            if isinstance(p, str) and bounded:
                self.text.check_length(len(p), param)
        out = []
        for p in prompts:
            ids = await self.text.encode(p, param, add_special_tokens, bounded) if isinstance(p, str) else list(p)
            self._check_ids(ids, param)
            out.append(ids)
        return out

    async def chat_prompt(self, messages: list[ChatMessage], rendering: ChatTemplateFields,
                          tools: ToolPlan | None = None, add_special_tokens: bool = False,
                          bounded: bool = True) -> ChatPrompt:
        """The rendered conversation's ids: the template writes the special tokens (vLLM's add_special_tokens adds
        the tokenizer's too, such as a BOS); `bounded` as prompt_ids'."""
        text = await self.render_chat(messages, rendering, tools, bounded)
        ids = await self.text.encode(text, "messages", add_special_tokens, bounded)
        self._check_ids(ids, "messages")
        prefill = messages[-1].text() if rendering.continue_final_message and messages else None
        return ChatPrompt(ids, self.text.thinks and opens_thinking(text, prefill))

    async def render_chat(self, messages: list[ChatMessage], rendering: ChatTemplateFields,
                          tools: ToolPlan | None = None, bounded: bool = True) -> str:
        """The conversation as the chat template writes it (with the tools it renders, in the tool format's
        history)."""
        knows_tools = self.text.template_knows_tools
        conversation = tool_conversation(messages, tools, knows_tools, self.text.tool_format,
                                         self.text.template_knows_developer)
        template_tools = tools.template_tools() if tools is not None and knows_tools else None
        return await self.text.render_chat(conversation, rendering.template_options(), "messages", template_tools,
                                           bounded)

    def check_token_ids(self, ids: list[int] | None, param: str) -> None:
        """Token ids a request names besides its prompt (`stop_token_ids`, `logit_bias`'s keys); none is fine."""
        self._check_ids(ids or [0], param)

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param, "empty_prompt")
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0-{self.vocab_size - 1})", param,
                           "invalid_value")

    def room_asked(self, requested: int | None, min_tokens: int = 0) -> int:
        """The tokens a request asks the context to leave its completion (what truncate_prompt_tokens -1 leaves):
        `requested` (None: the sampling defaults' max_tokens), at least min_tokens and one."""
        if requested is None:
            requested = self.sampling_defaults.get("max_tokens")
        return max(1, min_tokens, requested or 0)

    def output_limit(self, ids: list[int], requested: int | None, param: str, prompt_param: str,
                     min_tokens: int = 0) -> int:
        """How many tokens a sequence may generate: what was `requested` (None: the sampling defaults' max_tokens,
        else all), cut to what the context leaves (as vLLM and llama.cpp cut it; the answer then ends with
        finish_reason "length"). 400 where the prompt alone leaves
        no room (naming `prompt_param`), the request asks for more than any context holds (naming `param`), or
        for at least `min_tokens` where fewer are left."""
        room = self.max_model_len - len(ids)
        if requested is not None and requested > self.max_model_len:
            raise APIError(400, f"{param}={requested} cannot be greater than this model's maximum context length "
                                f"({self.max_model_len} tokens). Please request fewer output tokens.", param,
                           "context_length_exceeded")
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                f"prompt has {len(ids)} tokens, which leaves no room for the completion. Please "
                                "reduce the prompt.", prompt_param, "context_length_exceeded")
        if min_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                f"prompt has {len(ids)} tokens, which leaves {room} for the completion, fewer than "
                                f"min_tokens ({min_tokens}).", "min_tokens", "context_length_exceeded")
        if requested is None:  # (chat's, the Responses API's: a completion's default is 16)
            requested = self.sampling_defaults.get("max_tokens")
        return room if requested is None else min(requested, room)


# --- small routes ---


async def models(request: Request) -> Response:
    """The served model, once an engine can take requests: clients (vLLM's benchmark among them) poll this
    route to wait for a server, then send; before that it is a 503, as the completions routes are."""
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.ctx)]})


async def model(request: Request) -> Response:
    """One model by its id (the openai client's `models.retrieve`); ids may hold slashes ("org/name"). No id at all
    ("/v1/models/") is the list."""
    ctx = request.app.state.ctx
    if not request.path_params["model"]:
        return await models(request)
    ctx.check_model(request.path_params["model"])
    return JSONResponse(_model_card(ctx))


def _model_card(ctx: Context) -> dict:
    if not ctx.engine.serving():
        raise APIError(503, f"the engine is {ctx.engine.state()}; the model is listed once it can serve", None,
                       "engine_unavailable")
    # vLLM's card: `root` the model it was loaded from (here the file or directory's name, not where it lies), and
    # OpenAI's earlier `permission` list, which some clients still read
    return {"id": ctx.served_name, "object": "model", "created": ctx.created, "owned_by": "appliance",
            "root": Path(ctx.cfg.model_path).name, "parent": None, "max_model_len": ctx.max_model_len,
            "permission": [{"id": f"modelperm-{ctx.served_name}", "object": "model_permission",
                            "created": ctx.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}


async def tokenize(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: TokenizeRequest = await openai_api.read_body(request, TokenizeRequest)
    ctx.check_model(body.model)
    if body.messages is not None:
        ids = (await ctx.chat_prompt(body.messages, body, plan_tools(body, ctx.text.tool_format))).ids
    else:
        ids = await ctx.text.encode(body.prompt, "prompt", body.add_special_tokens)
    answer = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if body.return_token_strs:  # vLLM's: the tokenizer's own pieces ("Ġworld"), not decoded text
        answer["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(answer)


async def apply_template(request: Request) -> Response:
    """llama.cpp's /apply-template: the conversation as the chat template renders it for a chat request with the
    same fields, run through nothing."""
    ctx = request.app.state.ctx
    body: ApplyTemplateRequest = await openai_api.read_body(request, ApplyTemplateRequest)
    ctx.check_model(body.model)
    return JSONResponse({"prompt": await ctx.render_chat(body.messages, body, plan_tools(body, ctx.text.tool_format))})


async def detokenize(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: DetokenizeRequest = await openai_api.read_body(request, DetokenizeRequest)
    ctx.check_model(body.model)
    bad = [t for t in body.tokens if t >= ctx.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0-{ctx.vocab_size - 1})", "tokens",
                       "invalid_value")
    return JSONResponse({"prompt": await ctx.text.decode(body.tokens)})


async def tokenizer_info(request: Request) -> Response:
    """vLLM's /tokenizer_info: enough of the tokenizer for a client to stand in for it through /tokenize and
    /detokenize (lm-evaluation-harness' `tokenizer_backend=remote`); `model_max_length` is the served context."""
    ctx = request.app.state.ctx
    tok = ctx.tokenizer

    def text(name: str) -> str | None:
        value = getattr(tok, name, None)
        return None if value is None else str(value)

    flags = {name: getattr(tok, name) for name in ("add_bos_token", "add_eos_token")
             if isinstance(getattr(tok, name, None), bool)}
    return JSONResponse({"tokenizer_class": type(tok).__name__,
                         **{name: text(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
                         "additional_special_tokens": [str(t) for t in getattr(tok, "additional_special_tokens", [])],
                         **flags, "model_max_length": ctx.max_model_len, "chat_template": _chat_template(ctx)})


def _chat_template(ctx: Context) -> str | None:
    """The chat template in use (the spec's, or the model's own) as text; None where there is none as one text."""
    template = ctx.text.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


async def props(request: Request) -> Response:
    """llama.cpp's /props, which its web UI and some clients read for the context size and the chat template: the
    served model, `default_generation_settings` (`n_ctx` and the sampling defaults a request that leaves a field
    out gets), the sequences run at once (`total_slots`), the template and its BOS / EOS tokens."""
    ctx = request.app.state.ctx
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, **ctx.sampling_defaults}
    # under llama.cpp's names; n_predict -1: no cap but the context (chat's default; a completion's is 16)
    params = {{"repetition_penalty": "repeat_penalty", "max_tokens": "n_predict"}.get(name, name): value
              for name, value in defaults.items()}
    params = {"n_predict": -1, **params, "seed": -1, "stop": []}
    tokens = {name: str(getattr(ctx.tokenizer, name, None) or "") for name in ("bos_token", "eos_token")}
    slots = sum(r.stats.max_num_seqs for r in ctx.engine.replicas)  # (each replica's, from its heartbeats)
    return JSONResponse({"default_generation_settings": {"n_ctx": ctx.max_model_len, "params": params},
                         "total_slots": slots, "model_alias": ctx.served_name,
                         "model_path": Path(ctx.cfg.model_path).name,
                         "modalities": {"vision": False, "video": False, "audio": False},
                         "endpoint_slots": False, "endpoint_props": True, "endpoint_metrics": True,
                         "chat_template": _chat_template(ctx) or "", **tokens,
                         "build_info": f"appliance {VERSION}", "is_sleeping": False})


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def health(request: Request) -> Response:
    ctx = request.app.state.ctx
    engine = ctx.engine
    if ctx.cfg.draining_marker and os.path.exists(ctx.cfg.draining_marker):
        return error_response(503, "the server is shutting down", None, "draining")
    if engine.serving():  # (with several replicas, one draining while the others restart serves too: "degraded")
        state = engine.state()
        if state == "degraded" and ctx.cfg.started_marker and not os.path.exists(ctx.cfg.started_marker):
            # at start-up, ready means every replica: a replica still loading is not a degraded one
            return error_response(503, "the engine is starting: " + ", ".join(
                f"replica {r['replica']} {r['state']}" for r in engine.states()), None, "starting")
        body = {"status": "ok" if state == "ready" else "degraded"}
        if len(engine.replicas) > 1:
            body["replicas"] = engine.states()
        return JSONResponse(body)
    return error_response(503, f"the engine is {engine.state()}", None, engine.state())


# vLLM's /invocations (SageMaker's one route): the first field of these that the body holds picks the endpoint
INVOCATIONS = (("messages", openai_api.chat_completions), ("prompt", openai_api.completions),
               ("input", embeddings.embeddings), ("text_1", scores.score), ("data_1", scores.score),
               ("queries", scores.score), ("documents", scores.rerank))


async def invocations(request: Request) -> Response:
    """vLLM's /invocations: a chat, completion, embedding, score or rerank request, told apart by its fields."""
    data = await openai_api.read_json(request)  # (the endpoint reads it again from request.state)
    for field, endpoint in INVOCATIONS:
        if data.get(field) is not None:
            return await endpoint(request)
    raise APIError(400, "an /invocations body holds messages (chat), prompt (completions), input (embeddings), "
                        "text_1 and text_2, data_1 and data_2 or queries (score), or query and documents (rerank)",
                   None, "invalid_value")


async def load(request: Request) -> Response:
    """vLLM's /load: the requests this HTTP worker is answering (their generations under way), for a load balancer."""
    return JSONResponse({"server_load": len(LIVE)})


async def metrics(request: Request) -> Response:
    ctx = request.app.state.ctx
    return Response(render(ctx.collector, ctx.cfg.metrics_dir), media_type="text/plain; version=0.0.4")


async def openapi(request: Request) -> Response:
    from app.server.openapi import openapi_document

    return JSONResponse(openapi_document(VERSION))


# --- errors ---


async def _api_error(request: Request, exc: APIError) -> Response:
    return from_api_error(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = "no such route" if exc.status_code == 404 else exc.detail
    path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."  # (not 100 KB back)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, f"{message}: {request.method} {path}", None, code)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    traced = request.headers.get("x-request-id")  # (this handler answers outside the Gate, which echoes it)
    return error_response(500, "internal server error", None, "internal_error",
                          {"X-Request-Id": traced} if traced else None)


def _tokenizer(cfg: FrontendConfig):
    from app.model import tokenizer

    if cfg.tokenizer_dir is not None:
        from transformers import PreTrainedTokenizerFast  # noqa: F401 (imported while the export runs: 0.5-1 s)

        tokenizer.wait_for_export(cfg.tokenizer_dir)  # the worker boots while the bootstrap still exports it
        return tokenizer.load_exported(cfg.tokenizer_dir)
    return tokenizer.load_tokenizer(ModelSource(Path(cfg.model_path), cfg.model_format, cfg.served_name))


async def _warm_grammars(ctx: Context, settle: float = 1.0) -> None:
    """llguidance's view of the tokenizer (AsyncTokenizer.warm_grammars), built a second after an engine is first
    ready: not during the engine's load, whose CPUs it would share, nor while /health tells the bootstrap so."""
    while not ctx.engine.ready():
        await asyncio.sleep(0.1)
    await asyncio.sleep(settle)
    ctx.text.warm_grammars()


async def _end_at_grace(cfg: FrontendConfig) -> None:
    """Once the bootstrap drains (its marker appears), the answers still running when server.shutdown_grace runs
    out end with a 503 "shutting_down" error (a stream's last event, then [DONE]), not with a connection cut when
    gunicorn kills the worker a second later."""
    while True:
        try:
            began = os.stat(cfg.draining_marker).st_mtime
            break
        except FileNotFoundError:
            await asyncio.sleep(0.25)
    await asyncio.sleep(max(0.0, began + cfg.shutdown_grace - time.time()))
    ended: weakref.WeakSet = weakref.WeakSet()
    while True:  # until gunicorn stops the worker: answers that start late (a grammar compiling, a next wave) too
        for gen in set(LIVE) - set(ended):
            ended.add(gen)
            gen.interrupt(ShuttingDown(f"the server is shutting down and server.shutdown_grace "
                                       f"({cfg.shutdown_grace:g} s) ran out before this request finished"))
        await asyncio.sleep(0.1)


def create_app(cfg: FrontendConfig, tokenizer=None) -> Starlette:
    if tokenizer is None:
        tokenizer = _tokenizer(cfg)
    ctx = Context(cfg, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await ctx.engine.start()
        warming = asyncio.create_task(_warm_grammars(ctx))
        grace = asyncio.create_task(_end_at_grace(cfg)) if cfg.draining_marker else None
        gc.freeze()  # the modules and the tokenizer live as long as the process: the collector stops walking them
        yield
        warming.cancel()
        if grace is not None:
            grace.cancel()
        await ctx.engine.close()
        ctx.text.close()

    routes = [
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/responses", responses.responses, methods=["POST"]),
        Route("/v1/responses/{response_id:path}", responses.stored, methods=["GET", "DELETE"]),
        Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
        *(Route(path, scores.score, methods=["POST"]) for path in ("/score", "/v1/score")),
        *(Route(path, scores.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        Route("/invocations", invocations, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/props", props, methods=["GET"]),  # llama.cpp's
        Route("/version", version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # vLLM's (SageMaker's probe): /health
        Route("/load", load, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    middleware = [Middleware(Gate, cfg=cfg)]
    if cfg.cors_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=cfg.cors_origins, allow_methods=["*"],
                                        allow_headers=["*"]))
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
    # a path with a trailing slash is a 404, not Starlette's 307 to the same path without it: that redirect is built
    # from the client's Host header (any host it names), and clients that follow it send their body again
    app.router.redirect_slashes = False
    app.state.ctx = ctx
    return app
