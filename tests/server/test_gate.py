"""The request gate on its own (ASGI, no model): which routes need the key. (Its body deadline is tested
against the real server in test_hardening.py: the test client reads a body whole before the app sees it.)"""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from app.server.app import FrontendConfig, _api_error
from app.server.gate import Gate
from app.server.errors import APIError


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


def client(**settings) -> TestClient:
    cfg = FrontendConfig("m", "/nowhere", "gguf", 64, "ipc:///nowhere", **settings)
    routes = [Route(path, echo, methods=["GET", "POST"])
              for path in ("/health", "/metrics", "/tokenize", "/v1/x", "/v2/rerank", "/score", "/rerank")]
    app = Starlette(routes=routes, middleware=[Middleware(Gate, cfg=cfg)], exception_handlers={APIError: _api_error})
    return TestClient(app)


@pytest.mark.parametrize(("metrics_auth", "metrics_status"), [(True, 401), (False, 200)])
def test_metrics_follow_their_switch_and_everything_else_needs_the_key(metrics_auth, metrics_status):
    c = client(api_key="sk-12345678", metrics_auth=metrics_auth)
    assert c.get("/health").status_code == 200
    assert c.get("/metrics").status_code == metrics_status
    assert c.post("/tokenize").status_code == c.post("/v1/x").status_code == 401
    assert c.post("/tokenize", headers={"Authorization": "Bearer sk-12345678"}).status_code == 200
    assert c.post("/tokenize", headers={"Authorization": "Bearer sk-1234567"}).status_code == 401


def test_without_a_key_nothing_needs_one():
    c = client()
    assert all(c.get(path).status_code == 200 for path in ("/metrics", "/tokenize", "/v1/x"))


def test_a_server_error_carries_the_requests_id_back_too():
    """The 500 handler answers outside the Gate (Starlette's outermost layer): it echoes X-Request-Id itself."""
    from app.server.app import _server_error

    async def broken(request: Request) -> JSONResponse:
        raise RuntimeError("a bug")

    cfg = FrontendConfig("m", "/nowhere", "gguf", 64, "ipc:///nowhere")
    app = Starlette(routes=[Route("/v1/x", broken, methods=["POST"])], middleware=[Middleware(Gate, cfg=cfg)],
                    exception_handlers={APIError: _api_error, Exception: _server_error})
    answer = TestClient(app, raise_server_exceptions=False).post("/v1/x", headers={"X-Request-Id": "t-500"})
    assert answer.status_code == 500 and answer.headers["x-request-id"] == "t-500"


def test_a_draining_server_refuses_new_work_and_still_answers_the_rest(tmp_path):
    """Once the drain marker exists, a POST that would start engine work (/v1/..., /v2/rerank, /score, /rerank) is
    a 503 with Retry-After; probes and /tokenize still answer."""
    marker = tmp_path / "draining"
    c = client(draining_marker=str(marker))
    assert c.post("/score").status_code == 200
    marker.touch()
    for path in ("/v1/x", "/v2/rerank", "/score", "/rerank"):
        answer = c.post(path)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "5", path
        assert answer.json()["error"]["code"] == "draining"
    assert c.get("/health").status_code == c.post("/tokenize").status_code == 200
