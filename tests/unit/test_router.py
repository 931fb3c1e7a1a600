"""Replica choice (app/server/router.py) on clients whose heartbeats the test sets, no engine behind them."""

from __future__ import annotations

import time

from app.engine.ipc import Heartbeat
from app.server.router import AFFINITY_TOKENS, EngineRouter


def _router(n: int, **stats) -> EngineRouter:
    router = EngineRouter([f"ipc:///nonexistent-{i}" for i in range(n)])
    for replica in router.replicas:
        replica.stats, replica.last_beat = Heartbeat(ready=True, **stats), time.monotonic()
    return router


def test_a_burst_picked_before_any_request_is_queued_spreads_over_the_replicas():
    # every pick sees the same load (no engine queue registered yet): ties alternate, not all on replica 0
    router = _router(2)
    picked = [router.pick([1, 2, 3]).replica for _ in range(16)]
    assert picked.count(0) == picked.count(1) == 8


def test_the_least_loaded_replica_still_wins_over_the_tie_break():
    router = _router(3)
    router.replicas[0].stats = Heartbeat(ready=True, running=5)
    router.replicas[2].stats = Heartbeat(ready=True, running=1)
    assert {router.pick([7]).replica for _ in range(4)} == {1}  # 0 and 1 running: replica 1, every time
    router.replicas[1].stats = Heartbeat(ready=True, running=9)
    assert router.pick([7]).replica == 2


def test_a_long_shared_prefix_keeps_its_replica():
    router = _router(2)
    prompt = list(range(AFFINITY_TOKENS + 10))
    assert len({router.pick(prompt + [i]).replica for i in range(6)}) == 1


def test_a_draining_replica_serves_when_the_others_are_gone():
    """During a spec reload, the replica still draining takes requests when the others died meanwhile: it is what
    `pick` routes to, and so what /health and /v1/models count as serving ("degraded", not a 503 "draining")."""
    router = _router(2)
    router.replicas[0].stats = Heartbeat(ready=False, draining=True)
    router.replicas[1].was_ready, router.replicas[1].last_beat = True, time.monotonic() - 3600  # its engine died
    assert [r.state() for r in router.replicas] == ["draining", "unavailable"] and not router.ready()
    assert router.serving() == [router.replicas[0]] and router.pick([5]).replica == 0
    assert router.serving(frozenset({0})) == []
    router.replicas[1].last_beat = time.monotonic()  # back, ready: it alone serves again
    assert router.serving() == [router.replicas[1]]


def test_a_burst_that_just_ended_does_not_make_its_replica_look_busy():
    """The last heartbeat (up to 0.5 s old) counted this worker's 8 requests there, since finished: not load now.
    Other workers' requests it counted still are."""
    router = _router(2)
    router.replicas[0].stats, router.replicas[0].ours_at_beat = Heartbeat(ready=True, running=8), 8
    picked = [router.pick([1, 2, 3]).replica for _ in range(8)]
    assert picked.count(0) == picked.count(1) == 4
    router.replicas[0].stats, router.replicas[0].ours_at_beat = Heartbeat(ready=True, running=8, waiting=3), 2
    assert router.pick([4]).replica == 1  # 9 of other workers' there


def test_a_replica_that_stopped_answering_shows_nothing_running():
    """/metrics: its last heartbeat's running, waiting and KV figures are not what it holds now (its requests were
    failed, its cache went with it); its counters stay as they were."""
    from app.server.metrics import EngineCollector

    router = _router(2, running=7, waiting=2, kv_usage=0.5, prefix_hits=40)
    router.replicas[1].was_ready, router.replicas[1].last_beat = True, time.monotonic() - 3600
    samples = {(s.name, s.labels["engine"]): s.value for m in EngineCollector("m", router).collect() for s in m.samples}
    assert samples[("vllm:num_requests_running", "0")] == 7 and samples[("vllm:num_requests_running", "1")] == 0
    assert samples[("vllm:num_requests_waiting", "1")] == 0 and samples[("vllm:kv_cache_usage_perc", "1")] == 0
    assert samples[("vllm:prefix_cache_hits_total", "1")] == 40
