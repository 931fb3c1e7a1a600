"""The request gate of a frontend worker (pure ASGI): body size and deadline, the API key, draining, and the
client's X-Request-Id echoed on the answer."""

from __future__ import annotations

import asyncio
import hmac
import os

from starlette.responses import Response

from app.server.config import FrontendConfig
from app.server.errors import APIError, error_response

# The routes that start work in an engine: refused once the server drains (POST)
WORK_PATHS = ("/v1/", "/v2/", "/score", "/rerank", "/invocations")


class Gate:
    """Pure ASGI middleware: checks that must happen before a body is read or a handler runs."""

    def __init__(self, app, cfg: FrontendConfig):
        self.app, self.cfg = app, cfg

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = _echo_request_id(scope, send)
        refusal = self._refuse(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, self._limited(receive), send)

    def _refuse(self, scope) -> Response | None:
        headers = dict(scope["headers"])
        if b"transfer-encoding" in headers and b"content-length" in headers:  # (RFC 9112 6.3: a request smuggler's)
            return error_response(400, "a request may not have both Transfer-Encoding and Content-Length", None,
                                  "invalid_request")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.cfg.max_body_size:
            return error_response(413, f"the request body is larger than {self.cfg.max_body_size} bytes", None,
                                  "body_too_large")
        path = scope["path"]
        if self._needs_key(path) and not self._has_key(headers):
            return error_response(401, "missing or invalid API key (send Authorization: Bearer <key>)", None,
                                  "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if self.cfg.draining_marker and path.startswith(WORK_PATHS) and scope["method"] == "POST" and \
                os.path.exists(self.cfg.draining_marker):
            return error_response(503, "the server is shutting down", None, "draining", {"Retry-After": "5"})
        return None

    def _needs_key(self, path: str) -> bool:
        """Every route but the probes' /health and /ping (and /metrics when `server.metrics_auth` is off)."""
        if not self.cfg.api_key or path in ("/health", "/ping"):
            return False
        return path != "/metrics" or self.cfg.metrics_auth

    def _has_key(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, f"Bearer {self.cfg.api_key}".encode())

    def _limited(self, receive):
        """`receive` with the body's size limit and its deadline (`server.body_timeout` from the first read)."""
        seen, deadline, done = 0, None, False
        loop = asyncio.get_running_loop()

        async def wrapped():
            nonlocal seen, deadline, done
            if done:  # the body is in: what follows is a wait for the client to hang up, with no deadline
                return await receive()
            deadline = deadline or loop.time() + self.cfg.body_timeout
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.cfg.body_timeout:g} s", None,
                               "body_timeout", {"Connection": "close"}) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.cfg.max_body_size:
                    raise APIError(413, f"the request body is larger than {self.cfg.max_body_size} bytes", None,
                                   "body_too_large")
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return wrapped


def _echo_request_id(scope, send):
    """`send` that gives the answer the request's X-Request-Id header, where it had one (what vLLM's
    --enable-request-id-headers does, without its made-up ids), so a proxy's or client's trace id comes back."""
    request_id = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
    if not request_id:
        return send

    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id)]}
        await send(message)

    return wrapped
