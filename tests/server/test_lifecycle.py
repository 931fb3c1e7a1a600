"""Signals and failures: SIGTERM drains in-flight streams and exits 0; a dead engine makes the appliance
unhealthy, fails requests in flight and exits non-zero."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx

from tests.server.conftest import BASE_SPEC, Appliance


def _stream(app: Appliance, out: dict, max_tokens: int = 48) -> None:
    body = {"prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    lines = []
    try:
        with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=120) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    out.setdefault("first", time.monotonic())
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["lines"] = lines


def _status(app: Appliance, method: str, path: str) -> int | str:
    try:
        return httpx.request(method, app.url + path, json={"prompt": "x", "max_tokens": 1}, timeout=5).status_code
    except httpx.ConnectError:
        return "refused"


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(tmp_path):
    launched = time.monotonic()
    app = Appliance(tmp_path).wait_ready()
    deadline = time.monotonic() + 10  # the supervisor logs it on its next look at /health
    while (ready_in := re.search(r"ready in ([0-9.]+) s: serving", app.logs())) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # counted from the command's start, its re-execution with the preloads included
    assert ready_in is not None, app.logs()[-3000:]
    assert 0 < float(ready_in.group(1)) <= time.monotonic() - launched + 0.05
    # that re-execution came first thing (`python -m app` itself), and was the only one: the full preflight after
    # it found every library it wants preloaded mapped (README's set-up installs jemalloc)
    environ = open(f"/proc/{app.process.pid}/environ", "rb").read().split(b"\0")
    assert b"APPLIANCE_PRELOAD_EARLY=1" in environ and b"APPLIANCE_PRELOAD_REEXEC=1" not in environ, environ
    assert re.search(r"preflight: LD_PRELOAD=\S*libjemalloc", app.logs()), app.logs()[-3000:]
    out: dict = {}
    worker = threading.Thread(target=_stream, args=(app, out))
    worker.start()
    while "first" not in out and worker.is_alive():
        time.sleep(0.05)
    app.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    health, late = _status(app, "GET", "/health"), _status(app, "POST", "/v1/completions")
    worker.join(120)
    code = app.stop()
    # gunicorn stops listening at once (new connections are refused); a request that still gets in is a 503
    assert health in ("refused", 503) and late in ("refused", 503), (health, late)
    assert code == 0, app.logs()[-3000:]
    assert out["status"] == 200 and out["lines"][-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in out["lines"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # every token arrived
    assert "draining" in app.logs() and "stopped" in app.logs()


def test_answers_still_running_when_the_grace_runs_out_end_with_an_error(tmp_path):
    """SIGTERM with server.shutdown_grace 2: a stream that would run far longer gets a "shutting_down" error event and
    [DONE] (not a connection cut when gunicorn kills its worker), a JSON request a 503 of that code; exit 0."""
    app = Appliance(tmp_path, sets=("server.shutdown_grace=2",)).wait_ready()
    out, answer = {}, {}
    streaming = threading.Thread(target=_stream, args=(app, out, 6000))

    def whole() -> None:
        body = {"prompt": "Count:", "max_tokens": 6000, "ignore_eos": True}
        response = httpx.post(app.url + "/v1/completions", json=body, timeout=120)
        answer.update(status=response.status_code, body=response.json())

    waiting = threading.Thread(target=whole)
    streaming.start(), waiting.start()
    while "first" not in out and streaming.is_alive():
        time.sleep(0.05)
    time.sleep(0.3)
    signalled = time.monotonic()
    app.process.send_signal(signal.SIGTERM)
    streaming.join(60), waiting.join(60)
    code = app.stop()
    assert code == 0 and time.monotonic() - signalled < 15, app.logs()[-3000:]
    assert out["status"] == 200 and "error" not in out and out["lines"][-1] == "data: [DONE]", out.get("error")
    last = json.loads(out["lines"][-2][6:])
    assert last["error"]["code"] == "shutting_down" and "server.shutdown_grace (2 s)" in last["error"]["message"]
    assert answer["status"] == 503 and answer["body"]["error"]["code"] == "shutting_down", answer


def test_killing_the_engine_fails_health_and_requests_and_exits_non_zero(tmp_path):
    app = Appliance(tmp_path).wait_ready()
    out: dict = {}
    worker = threading.Thread(target=_stream, args=(app, out, 400))
    worker.start()
    while "first" not in out and worker.is_alive():
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(app.engine_pid(), signal.SIGKILL)
    unhealthy = None
    while time.monotonic() - killed < 15:
        try:
            if httpx.get(app.url + "/health", timeout=1).status_code == 503:
                unhealthy = time.monotonic() - killed
                break
        except httpx.HTTPError:
            unhealthy = time.monotonic() - killed  # already gone counts as unhealthy too
            break
        time.sleep(0.2)
    assert unhealthy is not None and unhealthy < 10
    app.process.wait(30)
    assert app.process.returncode != 0 and time.monotonic() - killed < 30
    worker.join(30)
    tail = " ".join(out.get("lines", [])[-3:]) + out.get("error", "")
    assert "engine" in tail or "error" in tail.lower(), tail  # the stream was failed, not left hanging
    assert "the engine process exited" in app.logs()
    app.stop()


def test_the_model_is_listed_only_once_the_engine_can_serve(tmp_path):
    """Clients (vLLM's benchmark among them) poll /v1/models until it answers, then send their requests: while
    the engine starts it answers 503, as the completions do, so the first request after a listing is served."""
    app = Appliance(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and app.process.poll() is None, app.logs()[-3000:]
            try:
                listing = httpx.get(app.url + "/v1/models", timeout=5)
            except httpx.ConnectError:  # the frontend is not listening yet
                time.sleep(0.05)
                continue
            if listing.status_code == 200:
                break
            assert listing.status_code == 503, listing.text
            assert listing.json()["error"]["code"] == "engine_unavailable", listing.text
            time.sleep(0.05)
        model = listing.json()["data"][0]["id"]
        done = httpx.post(app.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1},
                          timeout=60)
        assert done.status_code == 200, done.text
    finally:
        app.stop()


def test_json_logs_are_one_object_a_line_from_every_process(tmp_path):
    """runtime.log_format: json holds for every line a run writes: the bootstrap's, the engine's, and gunicorn's and
    uvicorn's own (their master's and workers'), from start to a drained stop."""
    app = Appliance(tmp_path, spec=BASE_SPEC + "runtime:\n  log_format: json\n").wait_ready()
    assert app.stop() == 0, app.logs()[-3000:]
    lines = app.logs().splitlines()
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    loggers = {e["logger"] for e in entries}
    assert {"gunicorn.error", "uvicorn.error"} <= loggers, loggers
    assert any(e["message"].startswith("Starting gunicorn") and e["process"] == "http" for e in entries)
    assert {e["level"] for e in entries} <= {"debug", "info", "warning", "error", "critical"}
