"""Timings of the paged attention kernel alone: chunked prefill and batched decode.

`python -m app.benchmark.attention` pins one thread per allowed CPU and times `kernels.paged_attention`
with the default model's shapes (9 query heads, 3 KV heads, head_dim 64, block size 16) on random
data: one sequence with a chunk of new queries whose earlier tokens are already cached (chunked
prefill), and many sequences with one query each (decode). Prints one line per case (median time).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from app import kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _case(dtype: torch.dtype, context_lens: list[int], q_lens: list[int], heads: tuple[int, int, int], block: int):
    # one sequence after another in the pool, blocks in order: q [sum(q_lens), Hq, D]
    q_heads, kv_heads, head_dim = heads
    need = [math.ceil(c / block) for c in context_lens]
    kc = torch.randn(sum(need), kv_heads, head_dim, block).to(dtype)  # keys transposed within a block
    vc = torch.randn(sum(need), kv_heads, block, head_dim).to(dtype)
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    first = 0
    for s, n in enumerate(need):
        tables[s, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    q = torch.randn(sum(q_lens), q_heads, head_dim).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
    return q, kc, vc, tables, torch.tensor(context_lens, dtype=torch.int32), starts


def time_attention(dtype: torch.dtype, context_lens: list[int], q_lens: list[int], repeats: int,
                   heads: tuple[int, int, int] = (9, 3, 64), block: int = 16) -> float:
    """Median seconds of one paged_attention call over these sequences."""
    q, kc, vc, tables, lens, starts = _case(dtype, context_lens, q_lens, heads, block)
    out = torch.empty_like(q)
    scale = heads[2] ** -0.5
    kernels.paged_attention(q, kc, vc, tables, lens, starts, scale, out=out)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.paged_attention(q, kc, vc, tables, lens, starts, scale, out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="repeatable; default: both")
    parser.add_argument("--chunk", type=int, default=2048, help="new queries of the prefill sequence")
    parser.add_argument("--context", type=int, action="append", help="prefill contexts; default: 2048 4096 8192")
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-context", type=int, action="append", help="default: 512 2048")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print(kernels.bind_threads(cpus).splitlines()[0], f"(CPUs {cpus}); kernels: {kernels.isa()}", flush=True)
    for name in args.dtype or list(DTYPES):
        for ctx in args.context or [2048, 4096, 8192]:
            seconds = time_attention(DTYPES[name], [ctx], [args.chunk], args.repeats)
            print(f"prefill  {name:9} {args.chunk} new queries at context {ctx:5}  {seconds * 1000:9.1f} ms", flush=True)
        for ctx in args.decode_context or [512, 2048]:
            batch = args.decode_batch
            seconds = time_attention(DTYPES[name], [ctx] * batch, [1] * batch, args.repeats * 4)
            print(f"decode   {name:9} {batch} sequences x 1 query at context {ctx:5}  {seconds * 1000:9.3f} ms", flush=True)


if __name__ == "__main__":
    main()
