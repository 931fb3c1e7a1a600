"""Offline throughput through the whole engine (`LLM.generate`): `python -m app bench offline`.

Workloads use random token ids (as vLLM's throughput benchmark does), so the numbers do not depend
on a dataset; every request generates exactly its max_tokens (ignore_eos).
"""

from __future__ import annotations

import json
import os
import time

import torch

from app.engine.llm import LLM
from app.engine.params import SamplingParams


def _random_prompts(count: int, length: int, vocab: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(100, vocab, (count, length), generator=g).tolist()
    return [(prefix or []) + ids for ids in body]


def _timed(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    hits, queries = llm.core.kv.hits, llm.core.kv.queries
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    found = llm.core.kv.hits - hits
    return {"requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": produced,
            "seconds": round(seconds, 2), "output_tokens_per_s": round(produced / seconds, 1),
            "total_tokens_per_s": round((produced + prompt_tokens) / seconds, 1),
            "prefix_hit_rate": round(found / max(llm.core.kv.queries - queries, 1), 3)}


def run(spec: str | None, dtype: str, requests: int, input_len: int, output_len: int) -> list[dict]:
    results = []
    cpus = os.sched_getaffinity(0)
    for prefix_caching in (True, False):
        os.sched_setaffinity(0, cpus)  # the previous LLM pinned this thread to its rank 0's CPUs
        llm = LLM(spec, model={"dtype": dtype}, scheduler={"prefix_caching": prefix_caching})
        vocab = llm.core.executor.vocab_size
        if prefix_caching:
            plain = _timed(llm, _random_prompts(requests, input_len, vocab, 0), output_len)
            results.append({"workload": f"{requests} x {input_len} -> {output_len}", "dtype": dtype, **plain})
        shared = _random_prompts(1, 512, vocab, 1)[0]
        workload = _random_prompts(32, 32, vocab, 2, prefix=shared)
        _timed(llm, workload[:1], 1)  # the first request caches the shared prefix (when caching is on)
        result = _timed(llm, workload[1:], 16)
        results.append({"workload": "31 x (512 shared + 32) -> 16", "dtype": dtype,
                        "prefix_caching": prefix_caching, **result})
        llm.close()
    for r in results:
        print(json.dumps(r))
    return results
