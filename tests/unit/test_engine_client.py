"""A frontend worker's view of one engine (app/server/engine_client.py) against a stand-in engine: two zmq
sockets the test drives, so a process that dies and comes back within DEAD_AFTER can be staged exactly."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import zmq
import zmq.asyncio

from app.engine.ipc import Heartbeat, encoder, heartbeat_address
from app.engine.params import SamplingParams
from app.server.engine_client import DEAD_AFTER, EngineClient, EngineRejected, EngineUnavailable


async def _until(condition, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _stand_in(address: str):
    """The stand-in engine's request and heartbeat sockets, and a started client of it."""
    context = zmq.asyncio.Context.instance()
    engine = context.socket(zmq.ROUTER)
    engine.bind(address)
    beats = context.socket(zmq.PUB)
    beats.bind(heartbeat_address(address))
    client = EngineClient(address, replica=1)
    await client.start()
    return engine, beats, client


async def _lost(client: EngineClient, pending: asyncio.Future) -> None:
    """The engine counts as gone, and the request in flight failed for it."""
    assert client.state() == "unavailable"
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(pending, 1)


async def _close(engine, beats, client: EngineClient) -> None:
    await client.close()
    beats.close(0)
    engine.close(0)


def test_an_engine_restarted_faster_than_dead_after_fails_its_requests_and_shows(tmp_path):
    address = f"ipc://{tmp_path}/engine"

    async def scenario():
        engine, beats, client = await _stand_in(address)
        try:
            async def beat(incarnation: int) -> None:  # until the client has taken one (a SUB joins late)
                seen = client.stats.incarnation == incarnation and client.ready()
                while not seen:
                    await beats.send(encoder.encode(Heartbeat(ready=True, incarnation=incarnation)))
                    await asyncio.sleep(0.02)
                    seen = client.stats.incarnation == incarnation and client.ready()

            await asyncio.wait_for(beat(101), 5)
            stream = client.generate("r1", [1, 2, 3], SamplingParams(max_tokens=4), None)
            pending = asyncio.ensure_future(stream.__anext__())
            await engine.recv_multipart()  # the request reached the engine, which then dies without answering
            engine.close(0)
            started = time.monotonic()
            with pytest.raises(EngineUnavailable):
                await asyncio.wait_for(pending, DEAD_AFTER)
            assert time.monotonic() - started < 1.0 and client.state() == "unavailable"  # not DEAD_AFTER later
            await beats.send(encoder.encode(Heartbeat(ready=True, incarnation=101)))  # sent before it died
            await asyncio.sleep(0.1)
            assert client.state() == "unavailable"
            await asyncio.wait_for(beat(102), 5)  # the restarted process
            assert client.state() == "ready"
        finally:
            await client.close()
            beats.close(0)

    asyncio.run(scenario())


def test_a_frontend_that_subscribes_late_hears_the_engine_at_once(tmp_path, monkeypatch):
    """The engine's heartbeat publisher answers each new subscription with its current snapshot: a frontend
    worker that connects after the engine became ready must not wait for the next beat (half a second of
    every start, before). With beats 60 s apart, only that answer can make the client ready in time."""
    from app.engine import beacon as beacons

    monkeypatch.setattr(beacons, "HEARTBEAT_SECONDS", 60.0)
    address = f"ipc://{tmp_path}/engine"
    beacon = beacons.Beacon(address)
    beacon.open()
    beacon.publish(Heartbeat(ready=True, incarnation=7))
    time.sleep(0.2)  # the first beat went out, to no one

    async def scenario():
        clients = [EngineClient(address, replica=0), EngineClient(address, replica=1)]
        try:
            for client in clients:  # the second subscription is answered too (XPUB_VERBOSE)
                await client.start()
                await _until(client.ready, 10.0)
                assert client.stats.incarnation == 7
        finally:
            for client in clients:
                await client.close()

    thread = beacon.thread
    try:
        asyncio.run(scenario())
    finally:
        beacon.close()
    assert not thread.is_alive()


def test_the_beacon_announces_a_quiet_time_at_once_and_its_end(tmp_path, monkeypatch):
    """`Beacon.quiet` returns once a beat that says so went out (beats 60 s apart here: only that one can), and the
    time it announces counts down with each beat."""
    from app.engine import beacon as beacons

    monkeypatch.setattr(beacons, "HEARTBEAT_SECONDS", 60.0)
    address = f"ipc://{tmp_path}/engine"
    beacon = beacons.Beacon(address)
    beacon.open()
    beacon.publish(Heartbeat(ready=True, incarnation=9))

    async def scenario():
        client = EngineClient(address, replica=0)
        try:
            await client.start()
            await _until(client.ready, 10.0)
            assert client.stats.quiet_for == 0
            began = time.monotonic()
            await asyncio.to_thread(beacon.quiet, 30.0)
            assert time.monotonic() - began < 1.0
            await _until(lambda: client.stats.quiet_for > 0, 2.0)
            assert 29 < client.stats.quiet_for <= 30
            await asyncio.to_thread(beacon.quiet, 0.0)
            await _until(lambda: client.stats.quiet_for == 0, 2.0)
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        beacon.close()


def test_a_step_held_up_by_a_tp_rank_silences_the_beats_until_it_goes_on(tmp_path, monkeypatch, caplog):
    """Beacon.stall (TPExecutor.stalled) over STALL_SECONDS: no beats, so the frontend finds the replica silent after
    DEAD_AFTER and fails its requests, as for a stopped rank 0; the beats come back once the rank arrives."""
    from app.engine import beacon as beacons

    monkeypatch.setattr(beacons, "HEARTBEAT_SECONDS", 0.05)
    address = f"ipc://{tmp_path}/engine"
    beacon, stall = beacons.Beacon(address), [None]
    beacon.stall = lambda: stall[0]
    beacon.open()
    beacon.publish(Heartbeat(ready=True, incarnation=3))

    async def scenario():
        client = EngineClient(address, replica=0)
        try:
            await client.start()
            await _until(client.ready, 10.0)
            stall[0] = (1, beacons.STALL_SECONDS - 1)  # a rank a little behind: beats go on
            heard = client.last_beat
            await asyncio.sleep(0.3)
            assert client.last_beat > heard
            stall[0] = (1, beacons.STALL_SECONDS + 1)
            await asyncio.sleep(0.3)
            heard = client.last_beat
            await asyncio.sleep(0.5)
            assert client.last_beat == heard  # held
            stall[0] = None
            await asyncio.sleep(0.5)
            assert client.last_beat > heard
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="app.engine"):
        try:
            asyncio.run(scenario())
        finally:
            beacon.close()
    assert "TP rank 1 has not reached this step's all-reduce in 6 s" in caplog.text
    assert "TP rank 1 answered again; heartbeats resume" in caplog.text


@pytest.mark.parametrize(("failure", "status_type", "code"), [
    (EngineUnavailable("the engine stopped"), "service_unavailable", "engine_unavailable"),
    (EngineRejected(429, "the waiting queue is full"), "rate_limit_error", "queue_full"),
    (EngineRejected(400, "bad"), "invalid_request_error", "rejected"),
    (RuntimeError("boom"), "server_error", "internal_error"),
])
def test_a_failed_stream_ends_with_the_error_a_json_answer_would_carry(failure, status_type, code):
    """What the SSE stream sends when the engine fails mid-stream: one error event, with the same string code a
    non-streamed answer carries for that failure (not the HTTP status), then [DONE]."""
    import asyncio
    import json

    from app.server.openai_api import _sse

    async def chunks():
        yield {"choices": [{"text": "a"}]}
        raise failure

    async def body() -> list[str]:
        response = _sse(chunks())
        return [part.decode() if isinstance(part, bytes) else part async for part in response.body_iterator]

    events = [part.removeprefix("data: ").strip() for part in asyncio.run(body())]
    assert events[-1] == "[DONE]" and json.loads(events[0]) == {"choices": [{"text": "a"}]}
    error = json.loads(events[1])["error"]
    assert (error["type"], error["code"]) == (status_type, code) and error["message"]


def test_an_event_loop_held_up_longer_than_dead_after_does_not_make_a_beating_engine_unavailable(tmp_path):
    """A large request body's JSON can hold a frontend worker's event loop for seconds, during which the engine's
    beats wait unread: that time is not the engine's silence. The loop blocked for DEAD_AFTER + 1 s while the
    engine beats on: the client is ready right after, and its _watch fails nothing in flight; with the engine
    then silent for DEAD_AFTER of running loop, it is unavailable."""
    address = f"ipc://{tmp_path}/engine"

    async def scenario():
        engine, beats, client = await _stand_in(address)
        try:
            async def beat_until_ready() -> None:
                while not client.ready():
                    await beats.send(encoder.encode(Heartbeat(ready=True, incarnation=5)))
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(beat_until_ready(), 5)
            stream = client.generate("r1", [1, 2, 3], SamplingParams(max_tokens=4), None)
            pending = asyncio.ensure_future(stream.__anext__())
            await engine.recv_multipart()
            time.sleep(DEAD_AFTER + 1.0)  # the loop held up (the engine is fine: its next beat comes after)
            assert client.ready() and client.state() == "ready"
            await beats.send(encoder.encode(Heartbeat(ready=True, incarnation=5)))
            await asyncio.sleep(0.6)  # _watch runs: nothing failed
            assert client.ready() and not pending.done()
            await asyncio.sleep(DEAD_AFTER + 0.6)  # then silence, the loop running: the engine is gone
            await _lost(client, pending)
        finally:
            await _close(engine, beats, client)

    asyncio.run(scenario())


def test_a_quiet_time_the_engine_announced_is_not_its_silence(tmp_path):
    """The engine builds llguidance's tokenizer right after ready, holding the GIL its heartbeat thread needs (4-8 s
    seen on a busy machine): it announces the quiet first (Heartbeat.quiet_for), and a request in flight is not
    failed for the silence; past the announced time, silence is loss again."""
    address = f"ipc://{tmp_path}/engine"

    async def scenario():
        engine, beats, client = await _stand_in(address)
        try:
            async def beat_until(quiet: float) -> None:
                while not (client.ready() and client.stats.quiet_for == quiet):
                    await beats.send(encoder.encode(Heartbeat(ready=True, incarnation=7, quiet_for=quiet)))
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(beat_until(DEAD_AFTER + 2.0), 5)
            stream = client.generate("r1", [1, 2, 3], SamplingParams(max_tokens=4), None)
            pending = asyncio.ensure_future(stream.__anext__())
            await engine.recv_multipart()
            await asyncio.sleep(DEAD_AFTER + 0.6)  # silent past DEAD_AFTER, within the quiet time
            assert client.state() == "ready" and not pending.done()
            await asyncio.sleep(2.0)  # and past it
            await _lost(client, pending)
        finally:
            await _close(engine, beats, client)

    asyncio.run(scenario())


def test_an_interruption_comes_ahead_of_events_a_slow_reader_has_not_taken():
    """server.shutdown_grace's 503 ends a stream at once, not after the tokens queued for a client that reads slowly."""
    from types import SimpleNamespace

    from app.server.generation import Event, Generation, ShuttingDown

    async def main():
        gen = Generation(engine=None, metrics=None, tokenizer=None, params=SamplingParams(), eos_token_id=None)
        gen.sequences = [SimpleNamespace(accepted=False)]
        gen._queue, gen._tasks = asyncio.Queue(), []
        for token in range(5):
            gen._queue.put_nowait(Event(0, "x", [token], []))
        taken = gen.events()
        assert (await taken.__anext__()).token_ids == [0]
        gen.interrupt(ShuttingDown("the grace ran out"))
        with pytest.raises(ShuttingDown, match="grace ran out"):
            await taken.__anext__()

    asyncio.run(main())
