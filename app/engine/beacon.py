"""An engine's heartbeat publisher (`Beacon`): its stats for the frontends, twice a second, from its own thread."""

from __future__ import annotations

import logging
import math
import threading
import time

HEARTBEAT_SECONDS = 0.5
# A step held up this long by a TP rank that is alive but has not reached a collective (stopped, stuck): the beats
# stop until it arrives, so that the frontends fail the step's requests and report the replica down (as they do
# for a rank 0 that stopped) rather than wait with it: the requests fail ~3 s later (the frontends' DEAD_AFTER).
# Ranks run the same step on equal shares, so a live rank this far behind the others is stopped or stuck.
STALL_SECONDS = 5.0

log = logging.getLogger("app.engine")


class Beacon:
    """The heartbeat publisher: the latest snapshot twice a second from its own thread, whatever the main loop
    is doing, and at once to each frontend that subscribes.

    Opened before the model loads (`open`, once the process is pinned: its thread and ZeroMQ's inherit the
    binding), so that the frontends are subscribed by the time the engine is ready; an XPUB socket, because
    a plain PUB drops what it sends before a subscription has arrived (a worker that connects just after the
    engine became ready would otherwise wait for the next beat, up to half a second of every start). Nothing
    is sent until the main loop sets the first `snapshot`."""

    WAKE_SECONDS = 0.02  # how soon the first snapshot goes out once the main loop has set it

    def __init__(self, address: str):
        self.address = address
        self.snapshot = None  # the latest Heartbeat; replaced (never mutated) by `publish`
        self.socket = None
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        # until `quiet_until` (time.monotonic()), beats say the engine may go unheard (Heartbeat.quiet_for); `quiet`
        # counts its asks, and the beat thread answers each with a beat that carries it
        self.quiet_until, self.asked, self.answered = 0.0, 0, 0
        self.answer = threading.Condition()
        self.stall = None  # () -> (rank, seconds) a step has waited for a live TP rank, or None (TPExecutor.stalled)
        self.stalled_by: int | None = None  # the rank the beats are held for, once said in the log

    def open(self) -> None:
        import zmq

        from app.engine.ipc import heartbeat_address

        self.socket = zmq.Context.instance().socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        self.socket.bind(heartbeat_address(self.address))
        self.thread = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        self.thread.start()

    def publish(self, snapshot) -> None:
        """The Heartbeat to send from now on (the first one goes out at once)."""
        self.snapshot = snapshot

    def quiet(self, seconds: float) -> None:
        """The next `seconds` of silence are expected (0: no longer, which the next beat says): a beat that says so
        goes out now, and this returns once it has (within ~0.1 s; at most 1 s)."""
        with self.answer:
            self.quiet_until = time.monotonic() + seconds
            self.asked += 1
            asked = self.asked
            if seconds > 0 and self.thread is not None and self.snapshot is not None:
                self.answer.wait_for(lambda: self.answered >= asked, timeout=1.0)

    def close(self) -> None:
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.socket.close(0)
            self.thread = None

    def _beat_forever(self) -> None:
        import msgspec

        from app.engine.ipc import encoder

        due = 0.0  # when the next beat goes out; 0: as soon as there is a snapshot
        while not self.stopping.is_set():
            wait = self.WAKE_SECONDS if self.snapshot is None else max(0.0, due - time.monotonic())
            if self.socket.poll(min(math.ceil(wait * 1000), 100)):  # a stop is seen within 0.1 s
                while self.socket.poll(0):
                    self.socket.recv()  # a (un)subscription: answer it with the current snapshot now
                due = 0.0
            with self.answer:
                snapshot, now, asked, quiet_until = self.snapshot, time.monotonic(), self.asked, self.quiet_until
            if snapshot is not None and self._held():
                due = now + self.WAKE_SECONDS * 5  # (looked at again in 0.1 s)
                continue
            if snapshot is not None and (now >= due or asked > self.answered):  # (`quiet` waits for its beat)
                quiet = quiet_until - now
                self.socket.send(encoder.encode(msgspec.structs.replace(snapshot, quiet_for=quiet) if quiet > 0
                                                else snapshot))
                with self.answer:
                    self.answered = asked
                    self.answer.notify_all()
                due = time.monotonic() + HEARTBEAT_SECONDS

    def _held(self) -> bool:
        """Whether a step has waited over STALL_SECONDS for a live TP rank (`stall`): no beats then; the log says
        when that begins and ends."""
        stalled = self.stall() if self.stall is not None else None
        if stalled is not None and stalled[1] > STALL_SECONDS:
            if self.stalled_by is None:
                self.stalled_by = stalled[0]
                log.error("TP rank %d has not reached this step's all-reduce in %.0f s (alive, but stopped or stuck): "
                          "heartbeats held, so the frontends fail this replica's requests until it does",
                          stalled[0], stalled[1])
            return True
        if self.stalled_by is not None:
            log.warning("TP rank %d answered again; heartbeats resume", self.stalled_by)
            self.stalled_by = None
        return False
