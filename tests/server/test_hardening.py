"""What an attack from outside found, each against the real appliance on loopback, bounded in time:
slow clients, tokenization on the event loop, a long prompt holding everyone back, files left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import BASE_SPEC, Appliance

KEY = "sk-hardening-0123456789"


# --- slow clients ---


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    sets = ("server.header_timeout=2", "server.body_timeout=2", "server.max_connections=8")
    app = Appliance(tmp_path_factory.mktemp("guarded"), BASE_SPEC, sets).wait_ready()
    yield app
    assert app.stop() == 0, app.logs()[-3000:]


def _connect(app: Appliance) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", app.port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        sock.settimeout(0.05)
        return sock.recv(4096) == b""  # end of stream
    except TimeoutError:
        return False
    except OSError:
        return True  # reset


def test_slowloris_headers_are_cut_off_and_the_server_keeps_answering(guarded):
    # 12 connections (the cap is 8) trickle a request line and headers, a byte every 0.3 s
    socks = [_connect(guarded) for _ in range(12)]
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    start, closed, health = time.monotonic(), {}, []
    for i in range(len(request)):
        for n, sock in enumerate(socks):
            if n in closed:
                continue
            if _closed_by_server(sock):
                closed[n] = time.monotonic() - start
                continue
            try:
                sock.send(request[i:i + 1])
            except OSError:
                closed[n] = time.monotonic() - start
        began = time.monotonic()
        health.append((httpx.get(guarded.url + "/health", timeout=5).status_code, time.monotonic() - began))
        if len(closed) == len(socks) or time.monotonic() - start > 8:
            break
        time.sleep(0.3)
    for sock in socks:
        sock.close()
    assert len(closed) == len(socks), f"still open after 8 s: {len(socks) - len(closed)}"
    assert max(closed.values()) < 2 + 1.5  # header_timeout plus a poll or two
    assert sorted(closed.values())[3] < 1.0  # the 4 beyond the cap went at once
    assert all(status == 200 for status, _ in health) and max(t for _, t in health) < 1.0, health


def test_a_body_that_never_ends_gets_a_408(guarded):
    sock = _connect(guarded)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    start, answer = time.monotonic(), b""
    sock.settimeout(0.3)
    while time.monotonic() - start < 6 and b"\r\n\r\n" not in answer:
        try:
            sock.sendall(b"1\r\n \r\n")
            answer += sock.recv(4096)
        except TimeoutError:
            pass
        except OSError:
            break
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - start < 2 + 1.5


def test_idle_connections_cannot_lock_out_a_new_client(guarded):
    socks = [_connect(guarded) for _ in range(8)]  # the whole cap, never sending a byte
    try:
        time.sleep(0.2)
        assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
    finally:
        for sock in socks:
            sock.close()


# --- tokenization off the event loop ---


def test_health_stays_fast_while_large_texts_are_tokenized(guarded):
    text = "The quick brown fox jumps over the lazy dog; sphinx of black quartz, judge my vow 12345. " * 7000
    results = []

    def tokenize():
        began = time.monotonic()
        response = httpx.post(guarded.url + "/tokenize", json={"prompt": text}, timeout=60)
        results.append((response.status_code, time.monotonic() - began))

    workers = [threading.Thread(target=tokenize) for _ in range(3)]
    for w in workers:
        w.start()
    latencies = []
    while any(w.is_alive() for w in workers):
        began = time.monotonic()
        assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - began)
        time.sleep(0.05)
    for w in workers:
        w.join()
    assert [status for status, _ in results] == [200] * 3
    slowest = max(t for _, t in results)
    assert slowest > 0.5, f"the texts tokenized too fast ({slowest:.2f} s) for this test to mean anything"
    assert max(latencies) < 0.4, (latencies, results)


# --- a long prompt does not hold everyone back ---


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    sets = ("kv_cache.memory=1GiB", "scheduler.step_time_budget=0.5")
    app = Appliance(tmp_path_factory.mktemp("long"), BASE_SPEC, sets).wait_ready()
    yield app
    assert app.stop() == 0, app.logs()[-3000:]


def _kv_usage(app: Appliance) -> float:
    return app.metric("vllm:kv_cache_usage_perc")


def test_a_short_request_is_answered_while_an_8k_prompt_prefills(long_context):
    # The bound, from docs/API.md: the step in flight (0.5 s budget), one step that holds the
    # short prompt (the long prompt takes at most half of it while others wait), then IPC and
    # HTTP; 3 budgets leave room for the budget's estimate to be off on a noisy machine.
    app, budget = long_context, 0.5
    body = json.dumps({"prompt": [1930] * 8000, "max_tokens": 1, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", app.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        deadline = time.monotonic() + 20
        while _kv_usage(app) < 0.05 and time.monotonic() < deadline:  # the long prompt is being prefilled
            time.sleep(0.1)
        holding = _kv_usage(app)
        assert holding >= 0.05
        sent, arrivals = time.monotonic(), []
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", app.url + "/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if re.search(r'"content": "[^"]', line):
                    arrivals.append(time.monotonic() - sent)
        assert arrivals and arrivals[0] < 3 * budget + 1.0, arrivals  # time to first token
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert max(gaps) < 2 * budget + 0.5, arrivals  # and its tokens keep coming, one step apart
        assert _kv_usage(app) >= holding  # the long prompt still holds its blocks: it was not finished first
    finally:
        sock.close()  # the client hangs up: the engine aborts the long prompt and frees its blocks
    aborted = time.monotonic()
    while _kv_usage(app) > 0.01 and time.monotonic() - aborted < 10:
        time.sleep(0.05)
    freed = time.monotonic() - aborted
    # the step in flight, the heartbeat that carries the new usage (0.5 s), and the disconnect poll
    assert freed < budget + 0.5 + 1.0, freed


# --- nothing left behind ---


def _ours(before: set[str], where: Path) -> set[str]:
    return {name for name in set(os.listdir(where)) - before
            if name.startswith(("appliance-", "__KMP_", "sem.", "mp-")) or where == Path("/dev/shm")}


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "engine killed"])
def test_no_file_is_left_behind_and_none_holds_the_key(tmp_path, how):
    tmp, shm = Path("/tmp"), Path("/dev/shm")
    before_tmp, before_shm = set(os.listdir(tmp)), set(os.listdir(shm))
    app = Appliance(tmp_path, BASE_SPEC, ("server.api_key.env=HARDENING_KEY",),
                    env={"HARDENING_KEY": KEY}).wait_ready()
    created = _ours(before_tmp, tmp)
    assert created, "no runtime directory found"  # the test must see what the appliance makes
    for folder in created:
        for path in Path(tmp, folder).rglob("*"):
            if path.is_file():
                assert KEY.encode() not in path.read_bytes(), path
    if how == "engine killed":
        os.kill(app.engine_pid(), signal.SIGKILL)
        app.process.wait(60)
    else:
        app.process.send_signal(getattr(signal, how))
        assert app.process.wait(60) == 0
    app.stop()
    assert not _ours(before_tmp, tmp) and not _ours(before_shm, shm), app.logs()[-2000:]
    assert KEY not in app.logs()
