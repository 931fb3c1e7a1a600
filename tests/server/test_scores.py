"""vLLM's /score and /rerank (and llama.cpp's /v1/rerank): a pair's score is the cosine of the two texts'
embeddings, the vectors /v1/embeddings gives (themselves checked against transformers in test_openai_client.py and
LLM.score's against transformers in tests/engine/test_llm.py)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

MODEL = "smollm2"
TEXTS = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock markets fell sharply today.",
         "Dogs are loyal animals that like to play fetch."]


def _post(appliance, path: str, body: dict) -> httpx.Response:
    return httpx.post(appliance.url + path, json=body, timeout=120)


def _vectors(appliance, inputs) -> np.ndarray:
    data = _post(appliance, "/v1/embeddings", {"input": inputs, "encoding_format": "float"}).json()["data"]
    return np.array([d["embedding"] for d in data], dtype=np.float64)


def _tokens(appliance, text: str) -> list[int]:
    return _post(appliance, "/tokenize", {"prompt": text}).json()["tokens"]


def test_scores_are_the_cosines_of_the_embeddings(appliance):
    """One text against many, one to one, under each of vLLM's names for the sides and paths; usage counts every
    text given (a single first text once)."""
    v = _vectors(appliance, TEXTS)
    cos = v @ v.T / np.outer(np.linalg.norm(v, axis=1), np.linalg.norm(v, axis=1))
    tokens = [len(_tokens(appliance, t)) for t in TEXTS]
    one_to_many = _post(appliance, "/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert one_to_many.status_code == 200, one_to_many.text
    answer = one_to_many.json()
    assert answer["object"] == "list" and answer["id"].startswith("score-") and answer["model"]
    assert [d["index"] for d in answer["data"]] == [0, 1, 2] and {d["object"] for d in answer["data"]} == {"score"}
    assert [d["score"] for d in answer["data"]] == pytest.approx(cos[0, 1:], abs=1e-3)
    assert answer["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens), "completion_tokens": 0}
    assert cos[0, 1] > cos[0, 2]  # the paraphrase scores above the unrelated text
    for path, first, second in (("/v1/score", "queries", "documents"), ("/score", "queries", "items"),
                                ("/score", "data_1", "data_2")):
        pairs = _post(appliance, path, {first: TEXTS[:2], second: [TEXTS[3], TEXTS[2]]}).json()
        assert [d["score"] for d in pairs["data"]] == pytest.approx([cos[0, 3], cos[1, 2]], abs=1e-3), path


def test_rerank_answers_the_documents_best_first(appliance):
    """/rerank, /v1/rerank (llama.cpp's and Jina's) and /v2/rerank (Cohere's): each document's cosine with the
    query, best first, its index and text; top_n keeps the best n."""
    v = _vectors(appliance, TEXTS)
    want = [float(v[0] @ v[i] / np.linalg.norm(v[0]) / np.linalg.norm(v[i])) for i in range(1, 4)]
    order = sorted(range(3), key=lambda i: want[i], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = _post(appliance, path, {"query": TEXTS[0], "documents": TEXTS[1:]}).json()
        assert answer["id"].startswith("rerank-")
        assert [r["index"] for r in answer["results"]] == order, path
        assert [r["document"]["text"] for r in answer["results"]] == [TEXTS[1 + i] for i in order]
        assert [r["relevance_score"] for r in answer["results"]] == pytest.approx([want[i] for i in order], abs=1e-3)
    best = _post(appliance, "/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}).json()
    assert [r["index"] for r in best["results"]] == order[:1]


def test_truncation_keeps_the_first_or_last_tokens(appliance):
    """vLLM's max_tokens_per_doc scores a document's first n tokens; truncate_prompt_tokens every text's last k."""
    long_doc = TEXTS[3] + " " + TEXTS[2]
    ids = _tokens(appliance, long_doc)
    first, last = _vectors(appliance, [ids[:6], ids[-5:]])
    query = _vectors(appliance, TEXTS[0])[0]
    cut = _post(appliance, "/score", {"text_1": TEXTS[0], "text_2": long_doc, "max_tokens_per_doc": 6}).json()
    assert cut["data"][0]["score"] == pytest.approx(float(query @ first), abs=1e-3)
    assert cut["usage"]["prompt_tokens"] == len(_tokens(appliance, TEXTS[0])) + 6
    kept = _post(appliance, "/rerank", {"query": TEXTS[0], "documents": [long_doc], "truncate_prompt_tokens": 5})
    query_last = _vectors(appliance, [_tokens(appliance, TEXTS[0])[-5:]])[0]
    assert kept.json()["results"][0]["relevance_score"] == pytest.approx(float(query_last @ last), abs=1e-3)


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_2", "text_1 holds 2 texts and text_2 4"),
    ("/score", {"text_1": TEXTS[0]}, "text_2", "give the two sides to score"),
    ("/score", {"text_1": "a", "text_2": "b", "queries": "c", "documents": ["d"]}, "documents", "one pair of sides"),
    ("/score", {"queries": TEXTS[0], "documents": []}, "documents", "give 1 to 2048 texts, not 0"),
    ("/score", {"text_1": "a", "text_2": ["b"] * 2048}, "text_2", "up to 2048 texts"),
    ("/score", {"text_1": "a", "text_2": "b", "instruction": "Rank by relevance"}, "instruction", "instruction is not"),
    ("/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 8192}, "max_tokens_per_doc", "less than"),
    ("/rerank", {"documents": ["b"]}, "query", "query"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n"),
    ("/rerank", {"query": "a " * 9000, "documents": ["b"]}, "query", "maximum context length"),
    ("/rerank", {"query": "a", "documents": ["b", "a " * 9000]}, "documents", "documents 1 has"),
    ("/rerank", {"query": "a", "documents": ["b", "c", ""]}, "documents", "documents 2 is empty"),
])
def test_bad_score_requests_are_400s_that_name_the_field(appliance, path, body, param, message):
    answer = _post(appliance, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_invocations_answers_each_request_as_its_own_endpoint(appliance):
    """vLLM's /invocations (SageMaker's one route) tells a request apart by its fields and answers it as the
    endpoint it is for would; a body of none of them, or not JSON, is a 400."""
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
    same = [
        ("/v1/chat/completions", chat, lambda a: a["choices"][0]["message"]["content"]),
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
         lambda a: a["choices"][0]["text"]),
        ("/v1/embeddings", {"input": TEXTS[:2]}, lambda a: [x for d in a["data"] for x in d["embedding"]]),
        ("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:3]}, lambda a: [d["score"] for d in a["data"]]),
        ("/rerank", {"query": TEXTS[0], "documents": TEXTS[1:]},
         lambda a: [x for r in a["results"] for x in (r["index"], r["relevance_score"])]),
    ]
    for path, body, read in same:
        direct, invoked = _post(appliance, path, body), _post(appliance, "/invocations", body)
        assert direct.status_code == invoked.status_code == 200, (path, invoked.text)
        want = read(direct.json())
        assert read(invoked.json()) == (want if isinstance(want, str) else pytest.approx(want, abs=1e-4)), path
    unknown = _post(appliance, "/invocations", {"text": "hello"})
    assert unknown.status_code == 400 and "messages (chat)" in unknown.json()["error"]["message"]
    broken = httpx.post(appliance.url + "/invocations", content=b"{not json", timeout=60)
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
    packed = httpx.post(appliance.url + "/invocations", content=b"x", headers={"Content-Encoding": "gzip"})
    assert packed.status_code == 415, packed.text
    data = _post(appliance, "/invocations", {"data_1": TEXTS[0], "data_2": TEXTS[1]}).json()["data"][0]["score"]
    text = _post(appliance, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]}).json()["data"][0]["score"]
    assert data == pytest.approx(text, abs=1e-4)
