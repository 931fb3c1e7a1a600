"""An engine process: one rank's model and EngineCore behind a ZeroMQ ROUTER socket.

Started by the bootstrap with the spawn start method (never fork: the parent may hold threads and
torch state that a forked child would inherit half-initialised), with the rank's OpenMP variables
already in its environment so that they are read when torch loads.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("app.engine")

HEARTBEAT_SECONDS = 0.5


@dataclass(frozen=True)
class EngineProcessConfig:
    replica: int
    address: str  # ipc:// endpoint to bind
    model_path: str
    model_format: str
    served_name: str
    dtype: str
    kv_dtype: str
    cpus: tuple[int, ...]
    memory_nodes: tuple[int, ...]
    interleave: bool
    kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    prefix_caching: bool
    max_waiting_requests: int
    step_time_budget: float = 0.0
    log_level: str = "info"
    log_format: str = "text"


def run_engine(cfg: EngineProcessConfig) -> None:
    """The engine process's main: bind, load, serve until SIGTERM."""
    from app.logs import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the bootstrap, which drains first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a clean exit: finalizers run, nothing leaks
    configure_logging(cfg.log_level, cfg.log_format, f"engine-{cfg.replica}")
    _thread_lock_for_progress_bars()
    core = _build_core(cfg)
    EngineServer(core, cfg.address, cfg.max_waiting_requests).serve_forever()


def _thread_lock_for_progress_bars() -> None:
    """tqdm's default lock is a multiprocessing one: a named semaphore in /dev/shm that a killed process leaks."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _build_core(cfg: EngineProcessConfig):
    import torch

    from app import kernels
    from app.engine.core import EngineCore
    from app.engine.model_runner import ModelRunner
    from app.engine.scheduler import SchedulerConfig
    from app.model.loader import load_model
    from app.model.source import ModelSource

    for line in kernels.bind_threads(cfg.cpus, cfg.memory_nodes, cfg.interleave).splitlines():
        log.info("binding: %s", line.strip())
    log.info("kernels: %s; torch threads: %d", kernels.isa(), torch.get_num_threads())
    from pathlib import Path

    loaded = load_model(ModelSource(Path(cfg.model_path), cfg.model_format, cfg.served_name), cfg.dtype,
                        tokenizer=False)
    runner = ModelRunner(loaded.model, cfg.kv_blocks, cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                         getattr(torch, cfg.kv_dtype))
    sched = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.chunked_prefill,
                            cfg.step_time_budget)
    return EngineCore(runner, sched, cfg.kv_blocks, cfg.block_size, cfg.prefix_caching, f"{cfg.model_path}:{cfg.dtype}")


class EngineServer:
    """The loop: receive new and aborted requests -> step -> send each worker its tokens; heartbeat."""

    def __init__(self, core, address: str, max_waiting: int):
        import zmq

        self.core, self.max_waiting = core, max_waiting
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = address
        self.owner: dict[str, bytes] = {}
        self.snapshot = None  # the latest Heartbeat; replaced (never mutated) by the main loop

    def serve_forever(self) -> None:
        import threading

        self._update_snapshot()
        threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True).start()
        log.info("engine ready: %d KV blocks of %d tokens", self.core.kv.num_blocks, self.core.kv.block_size)
        while True:
            self._receive(timeout_ms=0 if self.core.has_work() else int(HEARTBEAT_SECONDS * 1000))
            if self.core.has_work():
                self._send_outputs(self.core.step())
            self._update_snapshot()

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
                                                                      f"({self.max_waiting} requests); retry later"))
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
            lp = d.logprobs
            by_worker.setdefault(worker, []).append(Delta(
                d.request_id, d.token_id, lp.logprob if lp else None, [tuple(t) for t in lp.top] if lp else None,
                d.finish_reason.value if d.finish_reason else None, d.num_prompt_tokens, d.num_output_tokens))
            if d.finish_reason is not None:
                del self.owner[d.request_id]
        for worker, batch in by_worker.items():
            self._send(worker, Outputs(batch))

    def _update_snapshot(self) -> None:
        from app.engine.ipc import Heartbeat

        stats, kv = self.core.stats(), self.core.kv
        self.snapshot = Heartbeat(True, stats.running, stats.waiting, stats.kv_usage,
                                  kv.num_blocks - kv.num_free_blocks(), kv.num_blocks, kv.queries, kv.hits,
                                  self.core.scheduler.num_preemptions)

    def _beat_forever(self) -> None:
        """Publish the latest snapshot twice a second, whatever the main loop is doing."""
        import zmq

        from app.engine.ipc import encoder, heartbeat_address

        beats = zmq.Context.instance().socket(zmq.PUB)
        beats.setsockopt(zmq.LINGER, 0)
        beats.bind(heartbeat_address(self.address))
        while True:
            beats.send(encoder.encode(self.snapshot))
            time.sleep(HEARTBEAT_SECONDS)

    def _send(self, worker: bytes, message) -> None:
        import zmq

        from app.engine.ipc import encoder

        try:
            self.socket.send_multipart([worker, encoder.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a worker that went away must not stop the engine
            log.debug("could not send to %r: %s", worker, exc)
