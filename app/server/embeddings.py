"""POST /v1/embeddings: OpenAI's embeddings endpoint (llama.cpp's server has it; vLLM serves it for models it runs as
pooling models), on the generative model this appliance serves.

Each input's embedding is its final hidden states, after the model's last norm, pooled as model.pooling says and
L2-normalized: by default its last token's, vLLM's default pooling for a decoder model (`LAST`, normalized) and what
llama.cpp's `--pooling last` gives; "mean" and "cls" as llama.cpp's `--pooling mean` and `cls`. The engine computes
the prompt as for a completion of one token (SamplingParams.embed) and sends the vector with that token, which is not
shown; under "last", a prompt whose blocks are in the prefix cache computes only the rest, and gives the same vector
but for rounding (~2e-4). A request's inputs go to the engine in waves (`WAVE`). An instruction-tuned chat model is
no trained embedding model: its vectors serve retrieval less well than a model made for it would.
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from app.engine.params import SamplingParams
from app.server.errors import APIError
from app.server.generation import Generation
from app.server.openai_api import add_prompt, collect, json_answer, read_body, start_generation
from app.server.protocol import EmbeddingRequest

# More inputs than this are encoded off the event loop (2,048 inputs of SmolLM2's 576 floats are ~14 MB of JSON)
BIG_ANSWER = 16
# Inputs in the engine at once for one request, in waves (a completion's most sequences, openai_api.MAX_SEQUENCES):
# 2,048 at once would overflow the engine's waiting queue (256 by default) and crowd out every other client
WAVE = 64


async def embeddings(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: EmbeddingRequest = await read_body(request, EmbeddingRequest)
    ctx.check_model(body.model)
    if body.dimensions is not None:  # vLLM's answer too, for a model that was not trained to be cut (Matryoshka)
        raise APIError(400, "dimensions: this model's embeddings cannot be shortened (it is no Matryoshka "
                            "embedding model); leave dimensions out", "dimensions", "invalid_value")
    texts = await ctx.prompt_ids(body.input, "input", bounded=body.truncate_prompt_tokens is None)
    prompts = [body.truncated(ids, ctx.max_model_len) for ids in texts]
    check_context(ctx, prompts, "input")
    vectors = await embed(ctx, request, prompts)

    def answer() -> dict:
        data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
                for i, vector in enumerate(vectors)]
        tokens = sum(len(ids) for ids in prompts)
        return {"id": f"embd-{body.request_id or uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "data": data, "model": ctx.served_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await json_answer(ctx, answer, len(prompts) > BIG_ANSWER)


async def embed(ctx, request: Request, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's vector (normalized, pooled as the spec says), computed in the engine in waves of `WAVE`."""
    vectors: list[list[float]] = []
    for first in range(0, len(prompts), WAVE):  # (up to 2,048 inputs: the engine's queue holds 256 requests)
        gen = Generation(ctx.engine, ctx.metrics, ctx.tokenizer,
                         SamplingParams(temperature=0, max_tokens=1, embed=True, pooling=ctx.cfg.pooling),
                         ctx.eos_token_id, "embd")
        for ids in prompts[first:first + WAVE]:
            add_prompt(gen, ids, 1, 1)
        await start_generation(gen)
        await collect(gen, request)
        missing = [first + seq.index for seq in gen.sequences if seq.text.embedding is None]
        if missing:  # the engine ended it without one (its logits were not finite numbers: a broken model)
            raise APIError(500, f"the engine could not compute the embedding of input {missing[0]}", "input",
                           "internal_error")
        vectors += [seq.text.embedding for seq in gen.sequences]
    return vectors


def check_context(ctx, prompts: list[list[int]], param: str, first: int = 0) -> None:
    """A 400 before any input runs where one is too long (the engine computes an input as a one-token completion);
    `first`: the index in `param` of prompts[0]."""
    for i, ids in enumerate(prompts, first):
        if len(ids) >= ctx.max_model_len:
            raise APIError(400, f"This model's maximum context length is {ctx.max_model_len} tokens. However, {param} "
                                f"{i} has {len(ids)} tokens: an embedding's input may have up to "
                                f"{ctx.max_model_len - 1}.", param, "context_length_exceeded")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: the floats, or base64 of their little-endian float32 bytes (the openai client asks
    for this one by default and decodes it with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
