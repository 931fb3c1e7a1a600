"""All-reduce latency of the shared-memory TP group: `python -m app.benchmark.allreduce [--ranks 2]`.

Each rank is a process pinned to its own CPU (round robin over this process's CPUs); the median of
many back-to-back calls is reported per message size and dtype.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

SIZES = [576, 4 * 576, 32 * 576, 256 * 576, 2048 * 576, 2048 * 4096]  # hidden states of 1..2048 tokens


def _rank(name: str, rank: int, world: int, cpu: int, dtype: str, repeats: int, results) -> None:
    os.sched_setaffinity(0, {cpu})
    import torch

    from app.parallel.group import ShmGroup

    torch.set_num_threads(1)
    group = ShmGroup(name, rank, world)
    group.wait_attached(60)
    out = []
    for size in SIZES:
        x = torch.ones(size, dtype=getattr(torch, dtype))
        calls = max(5, min(repeats, int(2e8 // (size * x.element_size() * world))))
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            group.all_reduce(x)
            times.append(time.perf_counter() - start)
        out.append((size, statistics.median(times), calls))
    results.put((rank, out))
    group.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args(argv)
    from app.parallel.group import ShmGroup

    cpus = sorted(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    print(f"{args.ranks} ranks on CPUs {[cpus[r % len(cpus)] for r in range(args.ranks)]}")
    print(f"{'dtype':9} {'elements':>10} {'bytes':>10} {'median':>10} {'calls':>6}")
    for dtype in ("float32", "bfloat16"):
        results, name = ctx.Queue(), ShmGroup.new_name()
        procs = [ctx.Process(target=_rank, args=(name, r, args.ranks, cpus[r % len(cpus)], dtype, args.repeats, results))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        for (size, seconds, calls) in got[0]:
            width = 4 if dtype == "float32" else 2
            print(f"{dtype:9} {size:>10} {size * width:>10} {seconds * 1e6:>8.1f} us {calls:>6}")


if __name__ == "__main__":
    main()
