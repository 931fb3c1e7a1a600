"""Forward-pass timings of the model on this machine: prefill throughput and decode step time.

`python -m app bench model` runs the real model and paged KV cache (no scheduler, no server), with
threads pinned one per allowed CPU, and prints one line per measurement plus a JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from app import kernels
from app.model.batch import make_batch
from app.model.loader import load_model
from app.model.source import ModelSource
from app.placement.plan import AUTO_KV_DTYPE


@dataclass
class Result:
    what: str
    dtype: str
    quantized: str  # "keep/<activations>" or "dequantize"
    kv_dtype: str
    batch: int
    context: int
    value: float
    unit: str


class Bench:
    def __init__(self, source: ModelSource, dtype: str, block_size: int = 16, capacity: int = 1024,
                 quantized: str = "keep", activations: str = "int16", kv_dtype: str | None = None,
                 native_stack: bool = True):
        self.loaded = load_model(source, dtype, tokenizer=False, quantized=quantized, activations=activations)
        self.loaded.model.native_stack = native_stack  # False: the Python layers, even where the native stack runs
        self.quantized = f"keep/{activations}" if quantized == "keep" else quantized
        self.model, self.dtype, self.block_size, self.capacity = self.loaded.model, dtype, block_size, capacity
        self.kv_name = AUTO_KV_DTYPE[dtype] if kv_dtype in (None, "auto") else kv_dtype  # as `serve` would take it
        self.kv_dtype = getattr(torch, self.kv_name)
        self.vocab = self.loaded.config.vocab_size

    def _cache(self, seqs: int):
        per_seq = self.capacity // self.block_size
        blocks = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(seqs)]
        return blocks, self.model.new_kv_cache(per_seq * seqs, self.block_size, self.kv_dtype)

    def _run(self, blocks, cache, done: list[int], new: list[int]) -> None:
        # (as a served step: the last layer on each sequence's last row only, the one whose logits are taken)
        batch = dataclasses.replace(make_batch(blocks, done, new, self.block_size),
                                    hidden_rows=torch.ones(len(new), dtype=torch.int64))
        ids = torch.randint(0, self.vocab, (sum(new),), generator=torch.Generator().manual_seed(0))
        hidden = self.model.forward(ids, batch, cache)
        self.model.logits(hidden[batch.logit_indices])

    def prefill(self, tokens: int, repeats: int, chunk: int | None = None) -> Result:
        """One prompt of `tokens`, `chunk` tokens per forward step (chunked prefill; None: all at once)."""
        blocks, cache = self._cache(1)
        chunk = min(chunk or tokens, tokens)

        def whole_prompt() -> None:
            for done in range(0, tokens, chunk):
                self._run(blocks, cache, [done], [min(chunk, tokens - done)])

        whole_prompt()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            whole_prompt()
            times.append(time.perf_counter() - start)
        what = "prefill" if chunk == tokens else f"prefill/{chunk}"
        return Result(what, self.dtype, self.quantized, self.kv_name, 1, tokens, tokens / statistics.median(times),
                      "tokens/s")

    def decode(self, batch: int, context: int, steps: int) -> Result:
        blocks, cache = self._cache(batch)
        self._run(blocks, cache, [0] * batch, [context] * batch)  # fill every sequence's context
        self._run(blocks, cache, [context] * batch, [1] * batch)  # warm-up step
        times = []
        for step in range(steps):
            start = time.perf_counter()
            self._run(blocks, cache, [context + 1 + step] * batch, [1] * batch)
            times.append(time.perf_counter() - start)
        return Result("decode step", self.dtype, self.quantized, self.kv_name, batch, context,
                      statistics.median(times) * 1000, "ms")


def run(source: ModelSource, dtypes: list[str], batches: list[int], context: int, prompt: int, steps: int,
        chunk: int | None = None, quantized: list[str] = ("keep",), activations: list[str] = ("int16",),
        kv_dtype: str | None = None, native_stack: bool = True) -> list[Result]:
    cpus = sorted(os.sched_getaffinity(0))
    print(kernels.bind_threads(cpus).splitlines()[0], f"(CPUs {cpus}); kernels: {kernels.describe()}", flush=True)
    results = []
    variants = [(q, a) for q in quantized for a in (activations if q == "keep" else activations[:1])]
    for dtype in dtypes:
        for weights, act in variants:
            bench = Bench(source, dtype, capacity=max(context + steps + 16, prompt + 16), quantized=weights,
                          activations=act, kv_dtype=kv_dtype, native_stack=native_stack)
            for result in [bench.prefill(prompt, repeats=3, chunk=chunk)] + [bench.decode(b, context, steps)
                                                                             for b in batches]:
                print(f"{result.what:12} {result.dtype:9} {result.quantized:11} kv {result.kv_dtype:8} batch "
                      f"{result.batch:3} context {result.context:5}  {result.value:9.1f} {result.unit}", flush=True)
                results.append(result)
    print(json.dumps([asdict(r) for r in results]))
    return results
