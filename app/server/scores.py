"""vLLM's score and rerank endpoints (`/score`, `/rerank`, and their `/v1/`, `/v2/rerank` names; llama.cpp's server
answers `/v1/rerank` too), answered as vLLM answers them for an embedding model: a pair's score is the cosine of
its two texts' embeddings (embeddings.py: the served model's final hidden states, pooled as model.pooling says).

`/score` pairs `text_1` with `text_2` (or vLLM's other names for them: `queries` with `documents` or `items`,
`data_1` with `data_2`) one to one, or one to many; `/rerank` scores a `query` against each of `documents` and
answers them best first (`top_n` of them, or all). A text's vector is computed once however many pairs hold it.
There is no cross-encoder here: an instruction-tuned chat model is no trained retrieval model, and its scores rank
less well than a reranker's would.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server.embeddings import check_context, embed
from app.server.errors import APIError
from app.server.openai_api import json_answer, read_body
from app.server.protocol import MAX_SCORED_TEXTS, RerankRequest, ScoreRequest, ScoringFields

# More documents than this are answered off the event loop (rerank echoes each document's text)
BIG_ANSWER = 16


async def score(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: ScoreRequest = await read_body(request, ScoreRequest)
    ctx.check_model(body.model)
    first, second = body.side_names()
    scores, tokens = await _scores(ctx, request, body, body.side(first), body.side(second), (first, second))
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": f"score-{body.request_id or uuid.uuid4().hex}", "object": "list",
                         "created": int(time.time()), "model": ctx.served_name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


async def rerank(request: Request) -> Response:
    ctx = request.app.state.ctx
    body: RerankRequest = await read_body(request, RerankRequest)
    ctx.check_model(body.model)
    documents = [body.documents] if isinstance(body.documents, str) else body.documents
    scores, tokens = await _scores(ctx, request, body, [body.query], documents, ("query", "documents"))
    order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)[:body.top_n or len(documents)]

    def answer() -> dict:
        results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]
        return {"id": f"rerank-{body.request_id or uuid.uuid4().hex}", "model": ctx.served_name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await json_answer(ctx, answer, len(order) > BIG_ANSWER)


async def _scores(ctx, request: Request, body: ScoringFields, queries: list[str], documents: list[str],
                  names: tuple[str, str]) -> tuple[list[float], int]:
    """The cosine of each pair's embeddings (one query for every document, or one each), and the tokens read
    (every text given, a query paired with many once; vLLM counts a query once a pair)."""
    if len(queries) + len(documents) > MAX_SCORED_TEXTS:
        raise APIError(400, f"a request may score up to {MAX_SCORED_TEXTS} texts, {names[0]} and {names[1]} "
                            f"together; this one has {len(queries) + len(documents)}", names[1], "invalid_value")
    for limit, name in ((body.max_tokens_per_query, "max_tokens_per_query"),
                        (body.max_tokens_per_doc, "max_tokens_per_doc")):
        if limit >= ctx.max_model_len:
            raise APIError(400, f"{name} ({limit}) must be less than the model's context length "
                                f"({ctx.max_model_len})", name, "invalid_value")
    ids = {}  # each different (text, limit) computed once
    for texts, limit, name in ((queries, body.max_tokens_per_query, names[0]),
                               (documents, body.max_tokens_per_doc, names[1])):
        for i, text in enumerate(texts):
            if (text, limit) not in ids:
                ids[text, limit] = await _prompt(ctx, body, text, limit, name, i)
    keys = list(ids)
    vectors = dict(zip(keys, np.asarray(await embed(ctx, request, [ids[k] for k in keys]), dtype=np.float64),
                       strict=True))
    query_keys = [(q, body.max_tokens_per_query) for q in queries]
    pairs = [(query_keys[0] if len(queries) == 1 else query_keys[i], (doc, body.max_tokens_per_doc))
             for i, doc in enumerate(documents)]
    scores = [_cosine(vectors[q], vectors[d]) for q, d in pairs]
    tokens = sum(len(ids[k]) for k in query_keys) + sum(len(ids[d]) for _, d in pairs)
    return scores, tokens


async def _prompt(ctx, body: ScoringFields, text: str, limit: int, name: str, index: int) -> list[int]:
    """A text's token ids as scored: its first `limit` tokens where a limit is set, the last truncate_prompt_tokens
    where that is; a 400 naming `name` where it is longer than the context."""
    bounded = body.truncate_prompt_tokens is None and not limit
    try:
        ids = (await ctx.prompt_ids(text, name, bounded=bounded))[0]
    except APIError as error:
        if error.code != "empty_prompt":
            raise
        raise APIError(400, f"{name} {index} is empty: there is nothing to score", name, "empty_prompt") from None
    ids = body.truncated(await _first_tokens(ctx, text, ids, limit, name), ctx.max_model_len)
    check_context(ctx, [ids], name, index)
    return ids


async def _first_tokens(ctx, text: str, ids: list[int], limit: int, name: str) -> list[int]:
    """vLLM's max_tokens_per_query / _doc: the text's first `limit` tokens, with the tokenizer's special tokens (a
    BOS) kept around them as the whole text has them."""
    if not limit:
        return ids
    bare = (await ctx.prompt_ids(text, name, add_special_tokens=False, bounded=False))[0]
    if len(bare) <= limit:
        return ids
    start = next((k for k in range(len(ids) - len(bare) + 1) if ids[k:k + len(bare)] == bare), 0)
    return ids[:start] + bare[:limit] + ids[start + len(bare):]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return min(1.0, max(-1.0, float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))))
