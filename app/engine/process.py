"""An engine process: one rank's model and EngineCore behind a ZeroMQ ROUTER socket.

Started by the bootstrap with the spawn start method (never fork: the parent may hold threads and
torch state that a forked child would inherit half-initialised), with the rank's OpenMP variables
already in its environment so that they are read when torch loads.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from app.cache import entry_name
from app.engine.beacon import HEARTBEAT_SECONDS, Beacon
from app.engine.launch import RankLaunch

log = logging.getLogger("app.engine")

# how long the beacon may fall silent while llguidance's tokenizer is built (it holds the GIL: ~0.35 s for SmolLM2, 4-8
# s seen on two cores shared with other processes), without a frontend taking the engine for lost
WARM_QUIET_SECONDS = 30.0
# Draining (SIGUSR1, a spec reload): once the heartbeat says so, frontends stop routing here; requests sent
# just before still arrive. The engine exits after this long with nothing to do since it began draining.
DRAIN_IDLE_SECONDS = 4 * HEARTBEAT_SECONDS


def run_engine(launches: list[RankLaunch]) -> None:
    """The engine process's main (rank 0 of a replica; `launches` are the replica's ranks): bind, load, serve
    until SIGTERM, or until SIGUSR1 has drained it (exit code 0 either way)."""
    from app.logs import configure_logging, thread_lock_for_progress_bars
    from app.parallel.worker import die_with_parent

    die_with_parent(signal.SIGTERM)  # a SIGKILLed supervisor leaves no engine behind (SIGTERM: its workers stop too)
    # Ctrl-C goes to the bootstrap, which drains first; SIGHUP too, which reloads the spec (a signal sent to the
    # whole process group, or a closed terminal's, would otherwise kill the engine under a server that goes on)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a clean exit: finalizers run, nothing leaks
    launch = launches[0]
    configure_logging(launch.log_level, launch.log_format, launch.name)
    thread_lock_for_progress_bars()
    drain = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: drain.set())  # before loading: a reload may come at any time
    beacon = Beacon(launch.address)
    core, _ = build_core(launches, before_load=beacon.open)  # the frontends subscribe while the model loads
    from app.engine.executor import ExecutorFailed
    # What exists now lives as long as the process (modules, the model): the collector stops walking it.
    # Full collections over torch's objects were ~3% of a loaded step's samples (perf, offline engine).
    gc.freeze()
    try:
        EngineServer(core, launch.address, launch.max_waiting_requests, beacon, drain,
                     on_ready=partial(warm_grammars, core, launch, beacon)).serve_forever()
    except ExecutorFailed as exc:  # (a dead TP rank: what happened is the message, not where it was noticed)
        log.error("%s; the engine stops", exc)
        sys.exit(1)
    finally:
        beacon.close()
        core.close()


def warm_grammars(core, launch: RankLaunch, beacon: Beacon | None = None) -> None:
    """Build structured outputs' tokenizer (app/engine/structured.py `Grammars`) on the grammar thread once the engine
    is ready and said so (its first heartbeat is out), from the tokenizer the bootstrap exported: the first request
    with a grammar would otherwise have it built then, and every stream of the engine would wait for it. The build
    still holds the GIL (~0.35 s for SmolLM2's vocabulary) just after ready, once a process: the beacon announces
    the silence it may cause first (WARM_QUIET_SECONDS; on a busy machine it had outlasted the frontends' DEAD_AFTER,
    and they failed the first requests of an engine that was fine). Where the cache has no export, nothing is
    converted here: it is built for the first grammar, as before."""
    from app.model.source import ModelSource
    from app.model.tokenizer import cache_entry, cached_export

    m = launch.model
    source = ModelSource(Path(m.path), m.format, m.served_name)
    entry = cache_entry(source)
    if entry is not None and (entry / "tokenizer.json").is_file():  # (read on the grammar thread)
        if beacon is not None:
            beacon.quiet(WARM_QUIET_SECONDS)
        built = core.executor.grammars.warm_from(partial(cached_export, source), "as the engine started")
        if beacon is not None:
            built.add_done_callback(lambda _: beacon.quiet(0.0))


def build_core(launches: list[RankLaunch], bind: bool = True, tokenizer: bool = False,
               before_load: Callable[[], None] | None = None):
    """Rank 0 of a replica: start its TP workers (if any), pin and bind this process as the plan says, call
    `before_load` (threads it starts have the binding), load this rank's shard, and build the EngineCore.
    Returns (core, LoadedModel)."""
    launch, rest = launches[0], launches[1:]
    group, workers = None, []
    if launch.tp > 1:
        from app.parallel.group import ShmGroup
        from app.parallel.worker import ready, start_workers

        group = ShmGroup(ShmGroup.new_name(), 0, launch.tp)
        # before this process is pinned (theirs is their own) and before it imports torch: the ranks import it
        # side by side, not one after the other (~2 s each on a 2-core Zen 1)
        workers = start_workers(rest, group.name, bind)
    try:
        import torch

        from app import kernels
        from app.engine.core import EngineCore
        from app.engine.executor import LocalExecutor, TPExecutor
        from app.engine.model_runner import ModelRunner
        from app.model.loader import load_model
        from app.model.source import ModelSource
        from app.model.tokenizer import tokenizer_json

        if bind:
            placement = launch.placement
            for line in kernels.bind_threads(placement.cpus, placement.memory_nodes, placement.interleave).splitlines():
                log.info("binding: %s", line.strip())
        log.info("kernels: %s; torch threads: %d", kernels.describe(), torch.get_num_threads())
        if before_load is not None:
            before_load()
        m = launch.model
        source = ModelSource(Path(m.path), m.format, m.served_name)
        loaded = load_model(source, m.dtype, tokenizer=tokenizer, quantized=m.quantized, group=group, rank=0,
                            size=launch.tp, activations=m.quantized_activations)
        runner = ModelRunner(loaded.model, launch.kv, launch.scheduler.max_num_batched_tokens,
                             launch.scheduler.max_num_seqs, tokenizer_json=partial(tokenizer_json, source))
        if group is None:
            executor = LocalExecutor(runner)
        else:
            _wait_for_workers(group, workers)
            ready(group)
            log.info("TP group of %d ranks ready", launch.tp)
            executor = TPExecutor(runner, group, workers)
        cache = Path(launch.cache_dir) if launch.cache_dir else None
        key = calibration_key(launches) if cache is not None else None  # (stats app/'s sources: only where kept)
        return EngineCore(executor, launch.scheduler, launch.kv, m.model_id, key, cache), loaded
    except BaseException:
        if group is not None:
            group.abort("TP rank 0 failed to start")
            group.close()
        for worker in workers:
            worker.kill()
        raise


def calibration_key(launches: list[RankLaunch]) -> dict | None:
    """What a replica's step times depend on, beyond the scheduler's shapes: the model file and how it is run, the
    kernels (ISA and how it multiplies, the library's build), the code that stages a step, the CPU, the allocator
    and OpenMP runtime, each rank's threads. The engine keeps its step cost's fit under it (EngineCore); None where
    a file cannot be read."""
    from app import _native

    model = launches[0].model
    if os.path.isdir(model.path):  # a Hugging Face directory: its files
        files = [*sorted(Path(model.path).glob("*.safetensors")), Path(model.path, "config.json")]
    else:
        files = [Path(model.path)]
    code = sorted(Path(__file__).parent.parent.rglob("*.py"))  # app/: an edit to a runner or a layer refits
    try:
        model_files = [_stamp(f) for f in files]
        library, sources = _stamp(Path(_native.__file__)), [_stamp(f) for f in code]
    except OSError:
        return None
    try:
        release = version("llm-appliance")
    except PackageNotFoundError:  # run from a source tree
        release = "unknown"
    return {"version": 1, "model": [model_files, model.dtype, model.quantized, model.quantized_activations],
            # the ISA, not kernels.describe(): that has bf16_dot_ratio, measured at each start
            "kernels": [_native.isa(), _native.widens_prompts(), _native.bf16_dot(),
                        _native.widens_prompts() and _native.wide_int_tiles(), _native.amx_status() == "in use",
                        library, release],
            "code": entry_name(sources), "cpu": _cpu_identity(), "preload": os.environ.get("LD_PRELOAD", ""),
            "kv": [launches[0].kv.dtype, launches[0].kv.block_size],
            "ranks": [[len(r.placement.cpus), len(r.placement.memory_nodes), r.placement.interleave,
                       sorted(r.placement.openmp_env)] for r in launches]}  # (the runtime's variables, not CPU ids)


def _stamp(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _cpu_identity() -> list[str]:
    """The fields of /proc/cpuinfo that name the CPU (x86: vendor, family, model, stepping; arm64: part)."""
    try:
        with open("/proc/cpuinfo") as file:
            first = file.read().split("\n\n", 1)[0]
    except OSError:
        return []
    wanted = ("vendor_id", "cpu family", "model", "model name", "stepping", "CPU implementer", "CPU part",
              "CPU variant")
    return [line.strip() for line in first.splitlines() if line.partition(":")[0].strip() in wanted]


def _wait_for_workers(group, workers, timeout: float = 120) -> None:
    """Every worker attached to the group, or a clear error as soon as one has died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            group.wait_attached(0.2)
            return
        except RuntimeError:
            dead = [w for w in workers if not w.is_alive()]
            if dead:
                raise RuntimeError(f"TP worker {dead[0].name} exited (code {dead[0].exitcode}) while starting") from None
            if time.monotonic() > deadline:
                raise


class EngineServer:
    """The loop: receive new and aborted requests -> step -> send each worker its tokens; heartbeat."""

    def __init__(self, core, address: str, max_waiting: int, beacon: Beacon, drain: threading.Event | None = None,
                 on_ready: Callable[[], None] | None = None):
        import zmq

        self.core, self.max_waiting, self.beacon, self.on_ready = core, max_waiting, beacon, on_ready
        self.drain = drain or threading.Event()  # set: announce draining, finish what comes, then return
        self.drain_started: float | None = None
        self.last_busy = time.monotonic()
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.owner: dict[str, bytes] = {}

    def serve_forever(self) -> None:
        """Until drained (see `drain`); a SIGTERM ends it sooner through SystemExit."""
        self._update_snapshot()
        cfg = self.core.scheduler.cfg
        log.info("engine ready: %d KV blocks of %d tokens; max_num_seqs %d, max_num_batched_tokens %d",
                 self.core.kv.num_blocks, self.core.kv.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        if self.on_ready is not None:  # (after the heartbeat that says so)
            self.on_ready()
        self.beacon.stall = self.core.executor.stalled  # a TP peer that holds a step up silences the beats
        while not self._drained():
            self._receive(timeout_ms=0 if self.core.has_work() else int(HEARTBEAT_SECONDS * 1000))
            if self.core.has_work():
                self._send_outputs(self.core.step())
                self.last_busy = time.monotonic()
            else:
                self.core.executor.check_workers()  # a TP rank that died between requests ends the engine now
            self._update_snapshot()

    def _drained(self) -> bool:
        if not self.drain.is_set():
            return False
        now = time.monotonic()
        if self.drain_started is None:
            self.drain_started = now
            log.info("draining: finishing %d request(s), accepting what is already on its way", len(self.owner))
            return False
        if self.core.has_work() or now - max(self.drain_started, self.last_busy) < DRAIN_IDLE_SECONDS:
            return False
        log.info("drained in %.1f s; exiting", now - self.drain_started)
        return True

    def _receive(self, timeout_ms: int) -> None:
        import zmq

        from app.engine.ipc import decode_to_engine

        if not self.socket.poll(timeout_ms):
            return
        while True:
            try:
                worker, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode_to_engine(payload)
            except Exception as exc:  # a malformed message is logged and dropped, never fatal
                log.warning("dropping a malformed message from %r: %s", worker, exc)
                continue
            self._handle(worker, message)

    def _handle(self, worker: bytes, message) -> None:
        from app.engine.core import RequestRejected
        from app.engine.ipc import Abort, Accepted, AddRequest, Rejected

        if isinstance(message, Abort):
            for request_id in message.request_ids:
                self.core.abort(request_id)
                self.owner.pop(request_id, None)
        elif isinstance(message, AddRequest):
            if len(self.core.scheduler.waiting) >= self.max_waiting:
                self._send(worker, Rejected(message.request_id, 429, f"the engine's waiting queue is full "
                                                                      f"({self.max_waiting} sequences: each prompt "
                                                                      f"and each of its n choices is one); retry "
                                                                      f"later"))
                return
            try:
                self.core.add_request(message.request_id, message.prompt_ids, message.params,
                                      message.eos_token_id, message.wait_for)
            except (RequestRejected, ValueError) as exc:
                self._send(worker, Rejected(message.request_id, 400, str(exc)))
                return
            self.owner[message.request_id] = worker
            self._send(worker, Accepted(message.request_id))

    def _send_outputs(self, deltas) -> None:
        from app.engine.ipc import Delta, Outputs

        by_worker: dict[bytes, list[Delta]] = {}
        for d in deltas:
            worker = self.owner.get(d.request_id)
            if worker is None:
                continue
            lp, prompt = d.logprobs, d.prompt_logprobs
            by_worker.setdefault(worker, []).append(Delta(
                d.request_id, d.token_id, lp.logprob if lp else None, [tuple(t) for t in lp.top] if lp else None,
                d.finish_reason.value if d.finish_reason else None, d.num_prompt_tokens, d.num_output_tokens,
                None if prompt is None else [None if p is None else (p.logprob, list(p.top), p.rank) for p in prompt],
                d.embedding, d.timings, d.cached_tokens))
            if d.finish_reason is not None:
                del self.owner[d.request_id]
        for worker, batch in by_worker.items():
            self._send(worker, Outputs(batch))

    def _update_snapshot(self) -> None:
        from app.engine.ipc import Heartbeat

        stats, kv = self.core.stats(), self.core.kv
        self.beacon.publish(Heartbeat(
            self.drain_started is None, stats.running, stats.waiting, stats.kv_usage,
            kv.num_blocks - kv.num_free_blocks(), kv.num_blocks, kv.queries, kv.hits,
            self.core.scheduler.num_preemptions, self.core.scheduler.num_draft_tokens,
            self.core.scheduler.num_accepted_tokens, self.drain_started is not None, os.getpid(),
            max_num_seqs=self.core.scheduler.cfg.max_num_seqs))

    def _send(self, worker: bytes, message) -> None:
        import zmq

        from app.engine.ipc import encoder

        try:
            self.socket.send_multipart([worker, encoder.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a worker that went away must not stop the engine
            log.debug("could not send to %r: %s", worker, exc)
