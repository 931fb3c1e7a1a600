"""vLLM's use_beam_search against a beam search of the same rules over transformers' float32 logits of the same
file: the same beams, in the same order, on both endpoints; and what it cannot follow is refused."""

from __future__ import annotations

import httpx
import pytest
import torch

WIDTH, STEPS = 3, 6


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec

    path = resolve_source(ModelSpec()).path
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(gguf_file=path.name,
                                                                                dequantize=True)).eval()
    return tokenizer, model


def beams_of(model, prompt: list[int], ends: set[int], width: int = WIDTH, steps: int = STEPS) -> list[list[int]]:
    """The rules of app/server/beam.py, written out: 2 x width candidates a beam, the width likeliest kept, ended
    ones set aside, best by summed logprob / (prompt + output, end token not counted)."""
    def score(tokens, logprob, ended):
        return logprob / (len(prompt) + len(tokens) - ended)

    live, ended = [([], 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, logprob in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            top = torch.log_softmax(logits.double(), -1).topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (ended if token in ends else candidates).append((tokens + [token], logprob + value))
        live = sorted(candidates, key=lambda b: -b[1])[:width]
        best = sorted(ended, key=lambda b: -score(*b, True))[:width]
        if not live or (len(best) == width and score(*live[0], False) < score(*best[-1], True)):
            break
    every = [(t, lp, True) for t, lp in ended] + [(t, lp, False) for t, lp in live]
    return [t[:-1] if e else t for t, _, e in sorted(every, key=lambda b: -score(*b))[:width]]


def test_beam_search_finds_the_beams_of_the_reference(appliance, reference):
    tokenizer, model = reference
    ends = {tokenizer.eos_token_id}  # <|im_end|>: the server's only end token for this file (app.model.tokenizer)
    prompt = "The capital of France is"
    got = httpx.post(appliance.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": STEPS, "n": WIDTH, "use_beam_search": True}).json()
    want = beams_of(model, tokenizer(prompt).input_ids, ends)
    assert [c["text"] for c in got["choices"]] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in want]
    assert got["usage"]["completion_tokens"] >= sum(len(ids) for ids in want)
    messages = [{"role": "user", "content": "Say hi."}]
    chat = httpx.post(appliance.url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": STEPS, "n": 2, "use_beam_search": True}).json()
    ids = httpx.post(appliance.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    want = beams_of(model, ids, ends, width=2)
    assert [c["message"]["content"] for c in chat["choices"]] == \
        [tokenizer.decode(ids, skip_special_tokens=True) for ids in want]


@pytest.mark.parametrize(("extra", "param"), [({"stream": True}, "stream"), ({"stop": ["."]}, "stop"),
                                              ({"logprobs": 2}, "logprobs"), ({"n": 11}, "n"),
                                              ({"response_format": {"type": "json_object"}}, "response_format")])
def test_beam_search_refuses_what_it_cannot_follow(appliance, extra, param):
    answer = httpx.post(appliance.url + "/v1/completions", json={"prompt": "Hi", "use_beam_search": True, **extra})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
