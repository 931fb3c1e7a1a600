"""SIGHUP reloads the spec: a typo changes nothing; a good edit restarts the replicas one at a time (dp=2: no
request fails) or drains and restarts the only engine (dp=1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.conftest import REPO
from tests.server.conftest import BASE_SPEC, Appliance

SEQS = "scheduler:\n  max_num_seqs: {}\n"
DP2 = ("parallel.dp=2", "cores.reserve_frontend=0", "server.workers=2")


def _engine_pids(app: Appliance) -> list[int]:
    return [int(pid) for pid in re.findall(r"engine process started \(pid (\d+)\)", app.logs())]


def _wait_for_log(app: Appliance, text: str, after: int, timeout: float = 240) -> str:
    """The log after offset `after`, once it holds `text`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail = app.logs()[after:]
        if text in tail:
            return tail
        assert app.process.poll() is None, app.logs()[-4000:]
        time.sleep(0.3)
    raise AssertionError(f"no {text!r} in the log within {timeout} s:\n{app.logs()[after:][-4000:]}")


class SteadyLoad:
    """Clients that each send one completion after another until stopped; every outcome is kept."""

    def __init__(self, url: str, clients: int = 3):
        self.url, self.stop, self.outcomes = url, threading.Event(), []
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    reply = http.post(self.url + "/v1/completions", json={
                        "prompt": f"Client {i}, request {n}: name a colour.", "max_tokens": 12, "temperature": 0})
                    self.outcomes.append(reply.status_code)
                except httpx.HTTPError as exc:
                    self.outcomes.append(repr(exc))

    def __enter__(self) -> SteadyLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)


def test_dp2_reload_ignores_a_typo_and_applies_an_edit_without_failing_a_request(tmp_path):
    app = Appliance(tmp_path, BASE_SPEC + SEQS.format(8), sets=DP2).wait_ready(240)
    try:
        before = _engine_pids(app)
        assert len(before) == 2 and app.logs().count("max_num_seqs 8,") == 2
        with SteadyLoad(app.url) as load:
            time.sleep(2)
            # a typo: logged exactly as `validate` reports it, and nothing restarts
            app.spec_path.write_text(BASE_SPEC + SEQS.format(16).replace("scheduler", "schedular"))
            validate = subprocess.run([sys.executable, "-m", "app", "validate", "-c", str(app.spec_path), *[
                a for s in DP2 for a in ("--set", s)]], cwd=REPO, capture_output=True, text=True, timeout=120)
            assert validate.returncode == 2 and "schedular" in validate.stderr
            mark = len(app.logs())
            app.process.send_signal(signal.SIGHUP)
            tail = _wait_for_log(app, "still serving with the previous one", mark)
            assert validate.stderr.strip() in tail, (validate.stderr, tail)
            time.sleep(2)
            assert _engine_pids(app) == before and app.process.poll() is None
            # a good edit: both replicas drain and restart, one at a time, under the load
            app.spec_path.write_text(BASE_SPEC + SEQS.format(16))
            mark = len(app.logs())
            app.process.send_signal(signal.SIGHUP)
            tail = _wait_for_log(app, "reload: done", mark)
            served_during_reload = len(load.outcomes)
            time.sleep(2)
        after = _engine_pids(app)[2:]
        assert len(after) == 2 and not set(after) & set(before), (before, after)
        assert tail.count("max_num_seqs 16,") == 2, tail[-3000:]
        assert tail.index("replica 0 serves with the new spec") < tail.index("draining replica 1"), tail[-3000:]
        failed = [o for o in load.outcomes if o != 200]
        assert not failed and served_during_reload > 10, (failed, len(load.outcomes))
        assert httpx.get(app.url + "/health", timeout=5).json()["status"] == "ok"
    finally:
        assert app.stop() == 0, app.logs()[-3000:]


def test_dp1_reload_drains_restarts_and_serves_again(tmp_path):
    app = Appliance(tmp_path, BASE_SPEC + SEQS.format(8)).wait_ready(180)
    try:
        before = _engine_pids(app)
        # the HTTP frontend's settings need a restart: named in the log, nothing restarts
        app.spec_path.write_text(BASE_SPEC + SEQS.format(16) + "server:\n  max_connections: 50\n")
        mark = len(app.logs())
        app.process.send_signal(signal.SIGHUP)
        tail = _wait_for_log(app, "still serving with the previous spec", mark, timeout=60)
        assert "the HTTP frontend's settings (max_connections)" in tail and _engine_pids(app) == before
        # a SIGHUP sent to the whole process group (kill -HUP -PGID, a closed terminal) reaches the engine too: the
        # bootstrap's to act on, the engine goes on
        os.kill(before[0], signal.SIGHUP)
        time.sleep(1)
        assert app.process.poll() is None and httpx.get(app.url + "/health", timeout=5).status_code == 200
        assert "engine process exited" not in app.logs(), app.logs()[-3000:]
        app.spec_path.write_text(BASE_SPEC + SEQS.format(16))
        mark = len(app.logs())
        app.process.send_signal(signal.SIGHUP)
        seen = set()
        deadline = time.monotonic() + 180
        while "reload: done" not in app.logs()[mark:] and time.monotonic() < deadline:
            seen.add(httpx.get(app.url + "/health", timeout=5).status_code)
            time.sleep(0.2)
        tail = _wait_for_log(app, "reload: done", mark, timeout=5)
        assert 503 in seen  # readiness drops while the only engine restarts
        assert len(_engine_pids(app)) == 2 and _engine_pids(app)[1] != before[0] and "max_num_seqs 16," in tail
        reply = httpx.post(app.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                               "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["text"]
    finally:
        assert app.stop() == 0, app.logs()[-3000:]


def test_a_drain_that_outlasts_the_grace_is_cut_short(tmp_path):
    # a request far longer than server.shutdown_grace must not hold the rolling restart forever
    app = Appliance(tmp_path, BASE_SPEC + SEQS.format(8) + "server:\n  shutdown_grace: 3\n", sets=DP2).wait_ready(240)
    try:
        result = {}

        def long_request():
            with httpx.Client(timeout=300) as http:
                result["reply"] = http.post(app.url + "/v1/completions", json={
                    "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0})

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(2)  # it runs on replica 0 (least loaded, first), the first to be drained
        app.spec_path.write_text(BASE_SPEC + SEQS.format(16) + "server:\n  shutdown_grace: 3\n")
        mark = len(app.logs())
        app.process.send_signal(signal.SIGHUP)
        tail = _wait_for_log(app, "reload: done", mark)
        thread.join(300)
        assert "replica 0 still has requests after server.shutdown_grace (3 s)" in tail, tail[-3000:]
        assert tail.count("max_num_seqs 16,") == 2
        assert httpx.get(app.url + "/health", timeout=5).json()["status"] == "ok"
    finally:
        assert app.stop() == 0, app.logs()[-3000:]
