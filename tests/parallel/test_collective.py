"""The shared-memory all-reduce and broadcast against a plain sum, across real processes."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from app.parallel.group import ShmGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _inputs(rank: int, count: int, dtype: str, call: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(count, generator=generator).to(DTYPES[dtype])


def _reference(world: int, count: int, dtype: str, call: int = 0) -> torch.Tensor:
    total = torch.zeros(count, dtype=torch.float32)
    for rank in range(world):  # float32 accumulation in rank order, then the tensor's dtype
        total += _inputs(rank, count, dtype, call).float()
    return total.to(DTYPES[dtype])


def _rank_main(name: str, rank: int, world: int, cases: list, slot: int, results) -> None:
    torch.set_num_threads(1)
    group = ShmGroup(name, rank, world, slot_bytes=slot, broadcast_bytes=1 << 16, attach_timeout=60)
    group.wait_attached(60)
    out = []
    for count, dtype in cases:
        x = _inputs(rank, count, dtype)
        group.all_reduce(x)
        out.append(x.float().tolist())  # plain lists: a tensor would travel as a file descriptor
    results.put((rank, out))
    group.close()


def _run(world: int, cases: list, slot: int = 1 << 20) -> dict[int, list[torch.Tensor]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    name = ShmGroup.new_name()
    procs = [ctx.Process(target=_rank_main, args=(name, r, world, cases, slot, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert not Path("/dev/shm" + name).exists()
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_equals_the_plain_sum(world):
    # odd sizes, and with a 4 KiB slot, tensors of many chunks (10,007 floats = 10 chunks)
    cases = [(1, "float32"), (7, "bfloat16"), (1000, "float32"), (10_007, "float32"), (10_007, "bfloat16"),
             (65_537, "bfloat16")]
    got = _run(world, cases, slot=4096)
    for index, (count, dtype) in enumerate(cases):
        expected = _reference(world, count, dtype)
        for rank in range(world):
            torch.testing.assert_close(torch.tensor(got[rank][index]).to(expected.dtype), expected, rtol=1e-6, atol=1e-6)
        for rank in range(1, world):  # every rank holds the same bits: their residual streams stay equal
            assert got[rank][index] == got[0][index]


def _many_main(name: str, rank: int, world: int, calls: int, results) -> None:
    torch.set_num_threads(1)
    group = ShmGroup(name, rank, world, slot_bytes=1 << 16, broadcast_bytes=1 << 16)
    group.wait_attached(60)
    wrong = 0
    for call in range(calls):
        x = torch.full((33,), float(rank + call), dtype=torch.float32)
        group.all_reduce(x)
        wrong += int(x[0].item() != sum(r + call for r in range(world)) or x[-1].item() != x[0].item())
    results.put((rank, wrong))


def test_ten_thousand_back_to_back_calls():
    ctx = multiprocessing.get_context("spawn")
    results, name = ctx.Queue(), ShmGroup.new_name()
    procs = [ctx.Process(target=_many_main, args=(name, r, 3, 10_000, results)) for r in range(3)]
    for p in procs:
        p.start()
    assert dict(results.get(timeout=300) for _ in procs) == {0: 0, 1: 0, 2: 0}
    for p in procs:
        p.join(60)


def _dying_main(name: str, rank: int, world: int, results) -> None:
    torch.set_num_threads(1)
    group = ShmGroup(name, rank, world, slot_bytes=1 << 16, broadcast_bytes=1 << 16)
    group.wait_attached(60)
    x = torch.ones(100)
    group.all_reduce(x)  # one collective together
    if rank == world - 1:
        os._exit(3)  # killed before the next collective
    started = time.monotonic()
    try:
        group.all_reduce(x)
        results.put((rank, "returned", 0.0))
    except RuntimeError as exc:
        results.put((rank, str(exc), time.monotonic() - started))


def test_a_rank_that_dies_makes_the_others_raise_within_seconds():
    ctx = multiprocessing.get_context("spawn")
    results, name = ctx.Queue(), ShmGroup.new_name()
    procs = [ctx.Process(target=_dying_main, args=(name, r, 3, results)) for r in range(3)]
    for p in procs:
        p.start()
    outcomes = dict((rank, (message, seconds)) for rank, message, seconds in (results.get(timeout=60) for _ in range(2)))
    for rank in (0, 1):
        message, seconds = outcomes[rank]
        assert "TP rank 2" in message and "died" in message, message
        assert seconds < 5
    for p in procs:
        p.join(30)
    assert procs[2].exitcode == 3
    assert not Path("/dev/shm" + name).exists()


def _broadcast_main(name: str, rank: int, world: int, messages: list[bytes], results) -> None:
    group = ShmGroup(name, rank, world, slot_bytes=1 << 12, broadcast_bytes=1 << 20)
    group.wait_attached(60)
    got = [group.broadcast(m if rank == 0 else None) for m in messages]
    results.put((rank, got, group.broadcast(None, timeout=0.2) if rank else None))


def test_broadcast_delivers_every_message_in_order_and_times_out_cleanly():
    messages = [b"", b"x", os.urandom(1 << 20), b"step" * 1000] * 5
    ctx = multiprocessing.get_context("spawn")
    results, name = ctx.Queue(), ShmGroup.new_name()
    procs = [ctx.Process(target=_broadcast_main, args=(name, r, 3, messages, results)) for r in range(3)]
    for p in procs:
        p.start()
    got = {rank: (received, idle) for rank, received, idle in (results.get(timeout=120) for _ in procs)}
    for rank in range(3):
        assert got[rank][0] == messages
    assert got[1][1] is None and got[2][1] is None  # nothing more was sent: None after the timeout
    for p in procs:
        p.join(30)


def test_bad_group_arguments_are_clear():
    with pytest.raises(ValueError, match="rank must be in"):
        ShmGroup(ShmGroup.new_name(), 2, 2)
    with pytest.raises(ValueError, match="segment name"):
        ShmGroup("no-slash", 0, 2)
    with pytest.raises(RuntimeError, match="attaching"):
        ShmGroup(ShmGroup.new_name(), 1, 2, attach_timeout=0.1)
