"""TP ranks 1..tp-1: worker processes that run every step rank 0 broadcasts, on their own shard.

Rank 0 (the engine core's process) starts them with `spawn`, each with its rank's OpenMP variables
in the environment before torch loads; each pins its threads and binds its memory as the plan says,
loads only its shard, and then loops: receive a step, run the forward pass (its all-reduces meet
rank 0's), until told to stop. A worker dies with rank 0 (parent-death signal), and a failure on any
rank aborts the group, so the others raise instead of waiting.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

import msgspec

from app.engine.launch import RankLaunch

log = logging.getLogger("app.engine")

PR_SET_PDEATHSIG = 1
IDLE_POLL = 1.0  # seconds a worker waits for a step before looking at its parent again


class Step(msgspec.Struct, tag="step", array_like=True):
    # per request: (token ids, tokens already cached, block table, how many of the ids are prompt tokens, how many
    # (the last) need their final hidden state or -1 for all: every rank's last layer must run the same rows)
    requests: list[tuple[list[int], int, list[int], int, int]]


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


encoder = msgspec.msgpack.Encoder()
decode = msgspec.msgpack.Decoder(Step | Stop).decode


def encode_step(output) -> bytes:
    """A SchedulerOutput as the workers need it: what to compute and where its K/V go (no sampling)."""
    return encoder.encode(Step([(list(r.token_ids), r.num_computed, list(r.block_ids), r.prompt_rows,
                                 -1 if r.hidden_rows is None else r.hidden_rows) for r in output.requests]))


def start_workers(launches: list[RankLaunch], group_name: str, bind: bool) -> list[multiprocessing.Process]:
    """Spawn ranks 1.. of `launches`, each with its own OpenMP environment."""
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for launch in launches:
        saved = {key: os.environ.get(key) for key in launch.placement.openmp_env}
        os.environ.update(launch.placement.openmp_env)
        try:
            worker = ctx.Process(target=run_worker, args=(launch, group_name, bind), name=launch.name, daemon=True)
            worker.start()
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        log.info("TP rank %d started (pid %d)", launch.rank, worker.pid)
        workers.append(worker)
    return workers


def run_worker(launch: RankLaunch, group_name: str, bind: bool = True) -> None:
    from app.logs import configure_logging, thread_lock_for_progress_bars

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the bootstrap's signals, as the engine's: app/engine/process.py)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    configure_logging(launch.log_level, launch.log_format, launch.name)
    thread_lock_for_progress_bars()
    from app.parallel.group import ShmGroup

    group = ShmGroup(group_name, launch.rank, launch.tp)
    try:
        runner = _load(launch, group, bind)
        ready(group)
        _serve(group, runner)
    except Exception as exc:
        group.abort(f"TP rank {launch.rank}: {type(exc).__name__}: {exc}")
        log.exception("TP rank %d failed", launch.rank)
        raise
    finally:
        group.close()


def ready(group) -> None:
    """A barrier: every rank has loaded its shard. Loading takes what it takes, so this one waits without
    a time limit (a rank that dies meanwhile still makes it raise); collectives after it get 120 s."""
    import torch

    group.set_timeout(0)
    group.all_reduce(torch.zeros(1))
    group.set_timeout(120)


def _load(launch: RankLaunch, group, bind: bool):
    from pathlib import Path

    from app import kernels
    from app.engine.model_runner import ModelRunner
    from app.model.loader import load_model
    from app.model.source import ModelSource

    if bind:
        p = launch.placement
        for line in kernels.bind_threads(p.cpus, p.memory_nodes, p.interleave).splitlines():
            log.info("binding: %s", line.strip())
    m = launch.model
    loaded = load_model(ModelSource(Path(m.path), m.format, m.served_name), m.dtype, tokenizer=False, quantized=m.quantized,
                        group=group, rank=launch.rank, size=launch.tp, activations=m.quantized_activations)
    return ModelRunner(loaded.model, launch.kv, launch.scheduler.max_num_batched_tokens, launch.scheduler.max_num_seqs)


def _serve(group, runner) -> None:
    from app.engine.scheduler import ScheduledRequest, SchedulerOutput

    parent = os.getppid()
    while True:
        message = group.broadcast(None, timeout=IDLE_POLL)
        if message is None:
            if os.getppid() != parent:
                return  # rank 0 is gone (and the parent-death signal did not come)
            continue
        step = decode(message)
        if isinstance(step, Stop):
            return
        output = SchedulerOutput(tuple(
            ScheduledRequest("", tuple(ids), computed, tuple(blocks), False, prompt, hidden_rows=None if hidden < 0
                             else hidden) for ids, computed, blocks, prompt, hidden in step.requests))
        runner.forward(output)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (however it exits)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: the idle loop still notices the parent is gone
        pass
