"""Offline throughput through the whole engine (`LLM.generate`): `python -m app bench offline`.

Workloads use random token ids (as vLLM's throughput benchmark does), so the numbers do not depend
on a dataset; every request generates exactly its max_tokens (ignore_eos).
"""

from __future__ import annotations

import gc
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
    sched = llm.core.scheduler
    sched.peak_running, drafts, kept = 0, sched.num_draft_tokens, sched.num_accepted_tokens
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    found = llm.core.kv.hits - hits
    speculative = {} if sched.cfg.speculative is None else {  # drafts computed and kept (speculative decoding)
        "draft_tokens": sched.num_draft_tokens - drafts, "accepted_tokens": sched.num_accepted_tokens - kept}
    return {"requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": produced,
            "seconds": round(seconds, 2), "output_tokens_per_s": round(produced / seconds, 1),
            "total_tokens_per_s": round((produced + prompt_tokens) / seconds, 1),
            "prefix_hit_rate": round(found / max(llm.core.kv.queries - queries, 1), 3),
            "peak_running": sched.peak_running, **speculative}


def run(spec: str | None, dtype: str | None, requests: int, input_len: int, output_len: int,
        max_num_seqs: int | None = None, prefix_workload: bool = True) -> list[dict]:
    """The throughput workload (`requests` random prompts, at most `max_num_seqs` running: the engine's side
    of a served run at that concurrency), then, with `prefix_workload`, the shared-prefix one with prefix
    caching on and off. `dtype` and `max_num_seqs` default to the spec's."""
    results = []
    cpus = os.sched_getaffinity(0)
    model = {"dtype": dtype} if dtype else {}
    scheduler = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
    for prefix_caching in (True, False) if prefix_workload else (True,):
        os.sched_setaffinity(0, cpus)  # the previous LLM pinned this thread to its rank 0's CPUs
        llm = LLM(spec, model=model, scheduler={**scheduler, "prefix_caching": prefix_caching})
        gc.freeze()  # as the served engine does (app/engine/process.py): the collector stops walking the model
        try:
            dtype_used, vocab = llm.dtype, llm.core.executor.vocab_size
            if prefix_caching:
                plain = _timed(llm, _random_prompts(requests, input_len, vocab, 0), output_len)
                results.append({"workload": f"{requests} x {input_len} -> {output_len}", "dtype": dtype_used,
                                "max_num_seqs": llm.spec.scheduler.max_num_seqs, **plain})
            if prefix_workload:
                shared = _random_prompts(1, 512, vocab, 1)[0]
                workload = _random_prompts(32, 32, vocab, 2, prefix=shared)
                _timed(llm, workload[:1], 1)  # the first request caches the shared prefix (when caching is on)
                result = _timed(llm, workload[1:], 16)
                results.append({"workload": "31 x (512 shared + 32) -> 16", "dtype": dtype_used,
                                "prefix_caching": prefix_caching, **result})
        finally:
            llm.close()
    for r in results:
        print(json.dumps(r))
    return results
