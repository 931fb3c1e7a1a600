"""Connection-level limits of a frontend worker: slow headers, too many connections.

uvicorn closes idle keep-alive connections but has no deadline for a request's headers, so a client
that sends them one byte at a time (slowloris) holds a connection, and a file descriptor, forever.
`GuardedH11Protocol` gives every request `header_timeout` seconds from the moment the connection is
ready for it (connected, or the previous response sent) to the end of its headers, and caps the
open connections of the worker: at the cap the oldest connection still waiting for headers is closed
to make room (a slow client loses its slot, not a new one), or else the new connection. Request
bodies get their deadline in the ASGI gate (`app.server.app.Gate`), where a 408 can still be sent.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("app.server")


class GuardedH11Protocol(H11Protocol):
    header_timeout = 10.0
    max_connections = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the next request on this keep-alive connection gets its own deadline

    # --- the header deadline ---

    def waiting_since(self) -> float | None:
        return None if self._header_timer is None else self._header_timer.when()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection from %s: no complete request headers in %.0f s",
                     _peer(self.client), self.header_timeout)
            self.transport.close()

    # --- the connection cap ---

    def _make_room(self) -> None:
        waiting = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.waiting_since() is not None
                   and c is not self]
        victim = min(waiting, key=lambda c: c.waiting_since(), default=self)
        log.warning("%d open connections, the limit is %d: closing %s", len(self.connections), self.max_connections,
                    "the new one" if victim is self else f"one from {_peer(victim.client)} still sending headers")
        victim._disarm()
        victim.transport.close()


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})


def _peer(client) -> str:
    return "%s:%d" % tuple(client[:2]) if client else "an unknown peer"
