"""A frontend worker's connection to the engine process: send requests, stream their tokens back.

The engine heartbeats every half second with its stats; a silence of DEAD_AFTER seconds means it is
gone, and every request in flight is failed with EngineUnavailable instead of hanging. A dead engine
is seen sooner than that: its request socket disconnects (the engine process is gone), and the replica
counts as unavailable until a heartbeat comes from a new process (Heartbeat.incarnation). A restart
can take less than DEAD_AFTER (0.5-1 s for a small model on a fast CPU); without this, the requests
it lost hung and /health never said so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from app.engine.params import SamplingParams

from app.engine.ipc import (Abort, Accepted, AddRequest, Delta, Heartbeat, Outputs, Rejected,
                            decode_from_engine, encoder, heartbeat_address)

log = logging.getLogger("app.server.engine")
DEAD_AFTER = 3.0
WATCH_EVERY = 0.5  # seconds between checks of the heartbeat (and of how long the event loop was held up)
HELD_UP = 0.25  # a check this much later than due: the event loop was held up (less: a timer's usual lateness)


ACCEPTED = object()  # what generate() yields first, once the engine has queued the request


class EngineUnavailable(Exception):
    """The engine is starting, has stopped, or stopped answering."""

    def __init__(self, message: str, replica: int | None = None):
        super().__init__(message)
        self.replica = replica


class EngineRejected(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class EngineClient:
    """One engine process (a data-parallel replica), as one frontend worker sees it."""

    def __init__(self, address: str, replica: int = 0):
        self.address, self.replica = address, replica
        self.identity = f"worker-{os.getpid()}".encode()
        self.socket: zmq.asyncio.Socket | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = Heartbeat(ready=False)
        self.ours_at_beat = 0  # this worker's requests in flight when the last heartbeat came (router._load)
        self.last_beat = 0.0
        self._tick: float | None = None  # when _watch last ran (None: not started)
        self.was_ready = False
        self.lost: int | None = None  # the incarnation whose process is gone (its socket disconnected)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.address)
        self.beats = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.beats.setsockopt(zmq.LINGER, 0)
        self.beats.setsockopt(zmq.SUBSCRIBE, b"")
        self.beats.connect(heartbeat_address(self.address))
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tick = time.monotonic()
        self._tasks = [asyncio.create_task(self._read(self.socket)), asyncio.create_task(self._read(self.beats)),
                       asyncio.create_task(self._watch()), asyncio.create_task(self._disconnects())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.socket is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
            self.socket.close(0)
            self.beats.close(0)

    # --- health ---

    def ready(self) -> bool:
        return self.lost is None and self.stats.ready and self._beating()

    def state(self) -> str:
        if self.ready():
            return "ready"
        if self.lost is None and self.stats.draining and self._beating():
            return "draining"  # finishing its requests before a restart (a spec reload)
        return "unavailable" if self.was_ready else "starting"

    def _beating(self) -> bool:
        """A heartbeat read within DEAD_AFTER seconds of this process's event loop running (or within the quiet time
        the last one announced: Heartbeat.quiet_for): time the loop was held up (a large body's JSON, say: the beats
        wait unread meanwhile) does not count against the engine."""
        now = time.monotonic()
        forgiven = min(self._held_up(now), 10 * DEAD_AFTER)  # (bounded: were _watch to die)
        return now - self.last_beat - forgiven < max(DEAD_AFTER, self.stats.quiet_for)

    def _held_up(self, now: float) -> float:
        """How long past its due time _watch is: the event loop held up that long (0 within a timer's usual
        lateness, or before start)."""
        late = 0.0 if self._tick is None else now - self._tick - WATCH_EVERY
        return late if late > HELD_UP else 0.0

    # --- requests ---

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, eos_token_id: int | None,
                       wait_for: str | None = None) -> AsyncIterator[Delta]:
        """ACCEPTED once the engine queued the request, then its token deltas; aborts it if the caller stops early."""
        if not self.ready() and self.state() != "draining":
            raise EngineUnavailable(f"the engine is {self.state()}", self.replica)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            await self._send(AddRequest(request_id, prompt_ids, params, eos_token_id, wait_for))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = isinstance(item, EngineRejected)  # rejected: the engine holds nothing
                    raise item
                if item is ACCEPTED:
                    yield item
                    continue
                finished = item.finish_reason is not None
                if item.finish_reason == "abort":  # the engine gave up on it (a failed step): an error here
                    raise EngineRejected(500, "the engine could not finish this request; see the engine log")
                yield item
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            if not finished:  # the client went away, or a sibling failed: free its KV blocks now
                with contextlib.suppress(Exception):
                    await self._send(Abort([request_id]))

    async def abort(self, request_ids: list[str]) -> None:
        await self._send(Abort(request_ids))

    async def _send(self, message) -> None:
        await self.socket.send(encoder.encode(message))

    # --- background ---

    async def _read(self, socket) -> None:
        while True:
            payload = await socket.recv()
            try:
                message = decode_from_engine(payload)
            except Exception as exc:
                log.warning("dropping a malformed message from the engine: %s", exc)
                continue
            if isinstance(message, Heartbeat):
                if message.incarnation == self.lost:
                    continue  # sent by the process that is gone, before it went
                if self.stats.incarnation and message.incarnation != self.stats.incarnation:
                    self._fail_in_flight(f"engine {self.replica} was restarted")  # they died with the old process
                self.lost = None
                self.stats, self.last_beat, self.ours_at_beat = message, time.monotonic(), len(self.queues)
                self.was_ready = self.was_ready or message.ready
            elif isinstance(message, Outputs):
                for delta in message.deltas:
                    queue = self.queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(message, Accepted):
                queue = self.queues.get(message.request_id)
                if queue is not None:
                    queue.put_nowait(ACCEPTED)
            elif isinstance(message, Rejected):
                queue = self.queues.get(message.request_id)
                if queue is not None:
                    queue.put_nowait(EngineRejected(message.status, message.message))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY)
            now = time.monotonic()  # a loop held up: that long is forgiven the engine's heartbeat (_beating)
            self.last_beat = min(now, self.last_beat + self._held_up(now))
            self._tick = now
            if self.was_ready and self.state() not in ("ready", "draining"):
                self._fail_in_flight(f"engine {self.replica} stopped answering")

    async def _disconnects(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            event = await recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED and self.was_ready:
                self.lost = self.stats.incarnation  # unavailable until a new process heartbeats
                self._fail_in_flight(f"engine {self.replica}'s process is gone")

    def _fail_in_flight(self, why: str) -> None:
        if not self.queues:
            return
        log.error("%s; failing %d request(s) in flight", why, len(self.queues))
        for queue in list(self.queues.values()):
            queue.put_nowait(EngineUnavailable(f"{why.replace(f'engine {self.replica}', 'the engine', 1)}; the request "
                                               "was not finished", self.replica))
