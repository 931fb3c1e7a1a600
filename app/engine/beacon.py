"""An engine's heartbeat publisher (`Beacon`): its stats for the frontends, twice a second, from its own thread."""

from __future__ import annotations

import math
import threading
import time

HEARTBEAT_SECONDS = 0.5


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
            if snapshot is not None and (now >= due or asked > self.answered):  # (`quiet` waits for its beat)
                quiet = quiet_until - now
                self.socket.send(encoder.encode(msgspec.structs.replace(snapshot, quiet_for=quiet) if quiet > 0
                                                else snapshot))
                with self.answer:
                    self.answered = asked
                    self.answer.notify_all()
                due = time.monotonic() + HEARTBEAT_SECONDS
