"""`serve` with dp=2: both replicas serve, shared prefixes stay together, a killed replica is restarted."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest

from app import LLM, SamplingParams
from tests.server.conftest import BASE_SPEC, Appliance

PROMPTS = [f"Write the number {i} in words, then name a fruit that starts with the letter {chr(65 + i % 26)}:"
           for i in range(16)]


def _per_engine(app: Appliance, name: str) -> dict[str, float]:
    text = httpx.get(app.url + "/metrics", timeout=5).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}{{[^}}]*engine="(\d+)"[^}}]*}} (\S+)$', text, re.M)}


def _engine_pids(app: Appliance) -> dict[int, int]:
    found = re.findall(r"engine process started \(pid (\d+)\) for replica (\d+)", app.logs())
    return {int(replica): int(pid) for pid, replica in found}  # the latest start of each replica


@pytest.fixture(scope="module")
def offline():
    with LLM(model={"dtype": "float32"}, kv_cache={"memory": "512MiB"}, bind_threads=False) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    app = Appliance(tmp_path_factory.mktemp("dp2"), BASE_SPEC,
                    sets=("parallel.dp=2", "cores.reserve_frontend=0", "server.workers=2")).wait_ready(180)
    yield app
    assert app.stop() == 0, app.logs()[-3000:]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(("appliance-tp-", "sem.mp-"))]


def _complete_all(app: Appliance, prompts: list[str], max_tokens: int = 16) -> list:
    client = openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def one(prompt: str):
        try:
            out = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0)
            return out.choices[0].text
        except openai.APIStatusError as exc:
            return exc

    async def run():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


def _grew(now: dict[str, float], before: dict[str, float]) -> list[str]:
    """The engines whose counter went up. A series not there yet counts as 0: a worker that has no heartbeat
    from a replica yet has none, and one appearing at 0 is no change. Only increases count: the gunicorn
    workers each keep their own heartbeat view, and the one that answers may be a heartbeat behind."""
    return sorted(e for e in now if now[e] > before.get(e, 0.0))


def _counter_settles(app: Appliance, name: str, changed_from: dict[str, float]) -> dict[str, float]:
    """The per-engine counter once some engine's went up from `changed_from` (heartbeats carry it, twice a
    second)."""
    deadline = time.monotonic() + 10
    while True:
        now = _per_engine(app, name)
        if _grew(now, changed_from) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_requests_sharing_a_long_prefix_land_on_one_replica(dp2):
    # first in the module: right after start-up, when every replica must already be ready (it was not)
    prefix = "The lighthouse keeper climbed the spiral stairs at dusk, counting every step. " * 60
    tokens = httpx.post(dp2.url + "/tokenize", json={"prompt": prefix}, timeout=30).json()["count"]
    assert tokens >= 512
    shared = (tokens // 16 - 1) * 16  # whole blocks of the prefix every follower finds cached
    hits_before = _per_engine(dp2, "vllm:prefix_cache_hits_total")
    queries = _per_engine(dp2, "vllm:prefix_cache_queries_total")
    served_by, cached = [], []
    for i in range(6):  # one after another, through whichever gunicorn worker takes each
        answer = httpx.post(dp2.url + "/v1/completions", json={"prompt": prefix + f" Question {i}: who?",
                                                                "max_tokens": 2}, timeout=120)
        cached.append(answer.raise_for_status().json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        after = _counter_settles(dp2, "vllm:prefix_cache_queries_total", queries)
        served_by.append(_grew(after, queries))  # the replica that looked its prompt up
        queries = {e: max(after.get(e, 0.0), queries.get(e, 0.0)) for e in after.keys() | queries.keys()}
    hits = _counter_settles(dp2, "vllm:prefix_cache_hits_total", hits_before)
    gained = {e: hits[e] - hits_before.get(e, 0) for e in hits}
    assert len({tuple(s) for s in served_by}) == 1 and len(served_by[0]) == 1, (served_by, gained)
    assert gained[served_by[0][0]] >= 5 * shared, (served_by, gained)  # the 5 followers hit the first one's blocks
    assert min(cached[1:]) >= shared and cached[0] < shared, cached  # each request's own count says the same
    assert httpx.get(dp2.url + "/props").json()["total_slots"] == 2 * 64  # (llama.cpp's: both replicas' sequences)


def test_both_replicas_serve_concurrent_load_with_offline_outputs(dp2, offline):
    before = _per_engine(dp2, "vllm:prefix_cache_queries_total")
    assert _complete_all(dp2, PROMPTS) == offline
    # heartbeats carry the counters twice a second, and 16 short requests can be done sooner (Zen 5: 0.35 s)
    deadline = time.monotonic() + 10
    while True:
        queries = _per_engine(dp2, "vllm:prefix_cache_queries_total")
        grew = set(_grew(queries, before))
        if grew == {"0", "1"} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert grew == {"0", "1"}, (before, queries)  # both replicas took some of the load
    health = httpx.get(dp2.url + "/health", timeout=5).json()
    assert health == {"status": "ok", "replicas": [{"replica": 0, "state": "ready"}, {"replica": 1, "state": "ready"}]}


def test_a_killed_replica_fails_only_started_requests_and_is_restarted(dp2, offline):
    victim = _engine_pids(dp2)[1]
    results = {}

    def load():
        results["out"] = _complete_all(dp2, PROMPTS * 2, max_tokens=48)

    import threading

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(2.0)
    os.kill(victim, signal.SIGKILL)
    degraded = None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and degraded is None:
        body = httpx.get(dp2.url + "/health", timeout=5)
        if body.status_code == 200 and body.json()["status"] == "degraded":
            degraded = body.json()
        time.sleep(0.2)
    thread.join(300)
    assert not thread.is_alive(), "a client hung"
    assert degraded is not None and degraded["replicas"][1]["state"] != "ready"
    failures = [r for r in results["out"] if isinstance(r, Exception)]
    assert all(r.status_code == 503 for r in failures), failures  # only requests that had started on it
    assert len(failures) < len(results["out"])
    # the supervisor restarts it and it serves again
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if httpx.get(dp2.url + "/health", timeout=5).json().get("status") == "ok":
            break
        time.sleep(0.5)
    assert httpx.get(dp2.url + "/health", timeout=5).json()["status"] == "ok"
    assert _engine_pids(dp2)[1] != victim and "restarts in" in dp2.logs()
    # /health answered from one gunicorn worker; the other may get the new engine's first heartbeat up to a
    # second later and until then routes everything to replica 0
    time.sleep(2)
    before = _per_engine(dp2, "vllm:prefix_cache_queries_total")
    assert _complete_all(dp2, PROMPTS) == offline
    deadline = time.monotonic() + 30  # the counter arrives with the next heartbeat
    while _per_engine(dp2, "vllm:prefix_cache_queries_total")["1"] == before["1"]:
        assert time.monotonic() < deadline, f"the restarted replica served none of the requests: {before}"
        assert _complete_all(dp2, PROMPTS[:4]) == offline[:4]
        time.sleep(0.5)
