"""Timings of the paged attention kernel alone: chunked prefill and batched decode.

`python -m app.benchmark.attention` pins one thread per allowed CPU and times `kernels.paged_attention`
with the default model's shapes (9 query heads, 3 KV heads, head_dim 64, block size 16) on random
data: one sequence with a chunk of new queries whose earlier tokens are already cached (chunked
prefill), and many sequences with one query each (decode). Prints one line per case (median time).

`--layers N` times N calls, each on a cache of its own, as a decode step's N layers run: together
their caches outgrow the last-level cache, so the kernel streams them from memory as it does in the
model (one layer of 32 sequences x 300 tokens, 7 MB in bfloat16, stays in a 32 MB L3).
`--kv-dtype` gives the cache another dtype than q (the default spec: float32 q, bfloat16 cache).
`--against DTYPE` times every case over a cache of that dtype too, the two alternated round by round (the order
flipped each round) and reported as both medians and the median of their per-round ratios: on a noisy machine the
paired ratio, not either time, is the measure.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from app import kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _case(dtype: torch.dtype, context_lens: list[int], q_lens: list[int], heads: tuple[int, int, int], block: int,
          kv_dtype: torch.dtype, layers: int):
    # one sequence after another in the pool, blocks in order: q [sum(q_lens), Hq, D]; a cache a layer
    q_heads, kv_heads, head_dim = heads
    need = [math.ceil(c / block) for c in context_lens]
    caches = [kernels.kv_cache_from_blocks(torch.randn(sum(need), kv_heads, block, head_dim),
                                           torch.randn(sum(need), kv_heads, block, head_dim), kv_dtype)
              for _ in range(layers)]
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    first = 0
    for s, n in enumerate(need):
        tables[s, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    q = torch.randn(sum(q_lens), q_heads, head_dim).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64)
    return q, caches, tables, torch.tensor(context_lens, dtype=torch.int32), starts


def _stepper(dtype: torch.dtype, context_lens: list[int], q_lens: list[int], heads: tuple[int, int, int], block: int,
             kv_dtype: torch.dtype, layers: int):
    """A function that runs `layers` paged_attention calls (one a cache) over these sequences; warmed up."""
    q, caches, tables, lens, starts = _case(dtype, context_lens, q_lens, heads, block, kv_dtype, layers)
    out = torch.empty_like(q)
    scale = heads[2] ** -0.5

    def step() -> None:
        for kc, vc in caches:
            kernels.paged_attention(q, kc, vc, tables, lens, starts, scale, out=out)

    step()
    return step


def _seconds(step, calls: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls


def time_attention(dtype: torch.dtype, context_lens: list[int], q_lens: list[int], repeats: int,
                   heads: tuple[int, int, int] = (9, 3, 64), block: int = 16, kv_dtype: torch.dtype | None = None,
                   layers: int = 1) -> float:
    """Median seconds of `layers` paged_attention calls (one a cache) over these sequences."""
    step = _stepper(dtype, context_lens, q_lens, heads, block, kv_dtype or dtype, layers)
    return statistics.median(_seconds(step) for _ in range(repeats))


@dataclass(frozen=True)
class Paired:
    first: float  # median seconds over the first cache dtype
    second: float  # ... and over the second
    ratio: float  # median of the rounds' second / first
    low: float  # the rounds' smallest and largest ratio
    high: float


def paired_stats(first: list[float], second: list[float]) -> Paired:
    """What `pair_attention` reports of its rounds' times (one of each cache a round)."""
    ratios = [b / a for a, b in zip(first, second, strict=True)]
    return Paired(statistics.median(first), statistics.median(second), statistics.median(ratios), min(ratios),
                  max(ratios))


def pair_attention(dtype: torch.dtype, context_lens: list[int], q_lens: list[int], rounds: int,
                   kv_dtypes: tuple[torch.dtype, torch.dtype], heads: tuple[int, int, int] = (9, 3, 64),
                   block: int = 16, layers: int = 1, calls: int = 3) -> Paired:
    """The same case over two cache dtypes, alternated: each round times `calls` steps of each, the order flipped
    from round to round, so that a machine's drift lands on both alike."""
    steps = [_stepper(dtype, context_lens, q_lens, heads, block, kv, layers) for kv in kv_dtypes]
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            times[i].append(_seconds(steps[i], calls))
    return paired_stats(*times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="repeatable; default: both")
    parser.add_argument("--chunk", type=int, default=2048, help="new queries of the prefill sequence")
    parser.add_argument("--context", type=int, action="append", help="prefill contexts; default: 2048 4096 8192")
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-context", type=int, action="append", help="default: 512 2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-dtype", choices=[*DTYPES, "float16"], help="the cache's dtype (default: the same as q's)")
    parser.add_argument("--layers", type=int, default=1,
                        help="calls a case, each on a cache of its own (default: 1); N times the memory")
    parser.add_argument("--no-prefill", action="store_true", help="time decode only (--context then does nothing)")
    parser.add_argument("--against", choices=[*DTYPES, "float16"],
                        help="also time every case over a cache of this dtype, alternated, and report the ratio "
                             "(3 calls of each a round: 6x the steps, and both caches in memory)")
    parser.add_argument("--bf16-dot", choices=["auto", "on", "off"], default="auto",
                        help="against a bfloat16 cache: vdpbf16ps (on) or float32 FMAs (off); auto: the engine's choice")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, not {args.layers}")
    if args.chunk < 1 or min([*(args.context or []), *(args.decode_context or []), args.decode_batch]) < 1:
        parser.error("--chunk, --context, --decode-context and --decode-batch must be at least 1")
    short = [c for c in args.context or [] if c < args.chunk]
    if short and not args.no_prefill:  # the chunk's queries are the context's last tokens
        parser.error(f"--context {short[0]} is shorter than --chunk {args.chunk} (the new queries are the context's "
                     f"last tokens): give --chunk {short[0]} or less")
    cpus = sorted(os.sched_getaffinity(0))
    kv = getattr(torch, args.kv_dtype) if args.kv_dtype else None
    cache = f" ({args.kv_dtype} cache)" if args.kv_dtype else ""
    layers = f" x {args.layers} layers" if args.layers > 1 else ""

    def report(what: str, name: str, lens: list[int], q_lens: list[int], repeats: int, digits: int) -> None:
        if args.against is None:
            seconds = time_attention(DTYPES[name], lens, q_lens, repeats, kv_dtype=kv, layers=args.layers)
            print(f"{what}{layers}{cache}  {seconds * 1000:9.{digits}f} ms", flush=True)
            return
        first = args.kv_dtype or name
        pair = pair_attention(DTYPES[name], lens, q_lens, repeats, (kv or DTYPES[name], getattr(torch, args.against)),
                              layers=args.layers)
        print(f"{what}{layers}: {first} cache {pair.first * 1000:.{digits}f} ms, {args.against} cache "
              f"{pair.second * 1000:.{digits}f} ms, {args.against}/{first} {pair.ratio:.2f} ({pair.low:.2f}-"
              f"{pair.high:.2f}, {repeats} rounds)", flush=True)

    with kernels.use_bf16_dot(args.bf16_dot):
        print(kernels.bind_threads(cpus).splitlines()[0], f"(CPUs {cpus}); kernels: {kernels.describe()}", flush=True)
        for name in args.dtype or list(DTYPES):
            for ctx in [] if args.no_prefill else args.context or [2048, 4096, 8192]:
                report(f"prefill  {name:9} {args.chunk} new queries at context {ctx:5}", name, [ctx], [args.chunk],
                       args.repeats, 1)
            for ctx in args.decode_context or [512, 2048]:
                batch = args.decode_batch
                report(f"decode   {name:9} {batch} sequences x 1 query at context {ctx:5}", name, [ctx] * batch,
                       [1] * batch, args.repeats * 4, 3)


if __name__ == "__main__":
    main()
