"""Which data-parallel replica serves a request.

Each replica is an engine process (rank 0 of its TP group) with its own KV cache. A prompt goes to
the ready replica with the least outstanding work: this worker's requests in flight there plus the
other workers' that the replica's last heartbeat reported running and waiting. Prompts that
share a long prefix prefer one replica, chosen by rendezvous hashing of the prefix (so every
gunicorn worker prefers the same one without sharing any state), and go there so its prefix cache
keeps hitting, unless it is clearly busier than the least loaded replica.
"""

from __future__ import annotations

import hashlib

from app.server.engine_client import EngineClient, EngineUnavailable

AFFINITY_TOKENS = 256  # prompts sharing at least this many leading tokens count as one prefix
SLACK = 4  # a prefix's replica keeps it while it has at most this many requests more than the least loaded


class EngineRouter:
    def __init__(self, addresses: list[str]):
        self.replicas = [EngineClient(address, index) for index, address in enumerate(addresses)]
        # times this worker picked each replica: breaks ties in load. A burst of requests can all be picked
        # before the first one's engine queue exists (it is registered when its task first runs), so their
        # loads tie; without this every one of them went to replica 0 (a flaky DP test saw 16 of 16)
        self.picks = [0] * len(self.replicas)

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.close()

    # --- health ---

    def ready(self) -> bool:
        return any(r.ready() for r in self.replicas)

    def serving(self, exclude: frozenset[int] = frozenset()) -> list[EngineClient]:
        """The replicas requests go to (but those in `exclude`): the ready ones, or where none is (the others died
        during a spec reload) with several replicas, the one still draining, which takes requests until its
        restart."""
        ready = [r for r in self.replicas if r.ready() and r.replica not in exclude]
        if not ready and len(self.replicas) > 1:
            ready = [r for r in self.replicas if r.state() == "draining" and r.replica not in exclude]
        return ready

    def state(self) -> str:
        states = {r.state() for r in self.replicas}
        if states == {"ready"}:
            return "ready"
        if "ready" in states:
            return "degraded"
        for state in ("draining", "unavailable"):
            if state in states:
                return state
        return "starting"

    def states(self) -> list[dict]:
        return [{"replica": r.replica, "state": r.state()} for r in self.replicas]

    # --- routing ---

    def pick(self, prompt_ids: list[int], exclude: frozenset[int] = frozenset()) -> EngineClient:
        """The replica for this prompt; EngineUnavailable when none is ready."""
        ready = self.serving(exclude)
        if not ready:
            raise EngineUnavailable(f"the engine is {self.state()}")
        if len(self.replicas) == 1:
            return ready[0]
        least = min(ready, key=lambda r: (_load(r), self.picks[r.replica]))
        chosen = least
        if len(prompt_ids) >= AFFINITY_TOKENS:
            head = ",".join(map(str, prompt_ids[:AFFINITY_TOKENS])).encode()
            preferred = max(ready, key=lambda r: _score(head, r.replica))
            chosen = preferred if _load(preferred) <= _load(least) + SLACK else least
        self.picks[chosen.replica] += 1
        return chosen


def _load(replica: EngineClient) -> int:
    """This worker's requests in flight there now, and the other workers' as its last heartbeat counted them (what
    it ran and queued then, less this worker's then). The heartbeat is up to half a second old: counted whole, the
    requests of a burst that had just ended there made it look busy, and the next burst all went elsewhere (8 of 8
    on one of two idle replicas, in an outside attack)."""
    stats = replica.stats
    return len(replica.queues) + max(0, stats.running + stats.waiting - replica.ours_at_beat)


def _score(head: bytes, replica: int) -> bytes:
    """Rendezvous hashing: each (prefix, replica) pair gets a pseudo-random rank; the highest wins."""
    return hashlib.blake2b(head + b"|" + str(replica).encode(), digest_size=8).digest()
