"""The Responses API's store (`server.responses_store`): the last N responses asked to be kept (`store: true`), with
the conversation that led to each, so that `previous_response_id` continues one and `GET /v1/responses/{id}` reads
one back.

One JSON file a response in the run directory, so that every HTTP worker of the server sees every response (a
continuation may land on another worker than its predecessor); written whole (a temporary file renamed) and named
by a hash of the id (a client's `request_id` may hold any character). Past N the oldest go. The run directory goes
with the server: nothing outlives it (as vLLM's store, which is in memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from app.cache import write_text

log = logging.getLogger(__name__)


class ResponseStore:
    def __init__(self, directory: str | None, capacity: int):
        self.directory = Path(directory) if directory and capacity > 0 else None
        self.capacity = capacity
        # the oldest are dropped once this worker's count of the files passes capacity + slack (a directory scan
        # each 1% of the capacity's writes, not each write: a big store is many files)
        self.slack = capacity // 100
        self._count: int | None = None  # the files at the last scan, plus this worker's writes since

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    async def put(self, response: dict, conversation: list[dict]) -> bool:
        """Keep `response` and the input items that led to it (a predecessor's input and output, then its own);
        False, and a warning in the log, where it cannot be written (a full disk): the answer stands."""
        record = json.dumps({"response": response, "conversation": conversation})
        if await asyncio.to_thread(self._write, response["id"], record):
            return True
        log.warning("could not store response %s in %s (a full disk or tmpfs?): it cannot be read back or continued",
                    response["id"], self.directory)
        return False

    async def get(self, response_id: str) -> dict | None:
        """{"response": ..., "conversation": [...]}, or None: never stored, deleted or dropped as the oldest."""
        return await asyncio.to_thread(self._read, response_id)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, response_id)

    def _path(self, response_id: str) -> Path:
        return self.directory / (hashlib.sha256(response_id.encode()).hexdigest()[:40] + ".json")

    def _write(self, response_id: str, record: str) -> bool:
        path = self._path(response_id)
        if not write_text(path, record):  # (a private temporary name, removed on failure)
            return False
        with contextlib.suppress(OSError):  # the age to the nanosecond: a file system's clock ticks coarser
            os.utime(path, ns=(time.time_ns(), time.time_ns()))
        self._count = self._count + 1 if self._count is not None else None
        if self._count is None or self._count > self.capacity + self.slack:
            with contextlib.suppress(OSError):
                self._drop_oldest(path)
        return True

    def _read(self, response_id: str) -> dict | None:
        try:
            record = json.loads(self._path(response_id).read_text())
        except (OSError, ValueError):  # (never stored, dropped, or unreadable: none to give)
            return None
        return record if record["response"]["id"] == response_id else None  # (a hash collision: none)

    def _delete(self, response_id: str) -> bool:
        if self._read(response_id) is None:
            return False
        try:
            self._path(response_id).unlink()
        except FileNotFoundError:  # (another request deleted it first: only one of them says it did)
            return False
        return True

    def _drop_oldest(self, newest: Path) -> None:
        """Down to `capacity` files, the oldest dropped (never `newest`, the one just written)."""
        entries = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".json") and entry.path != str(newest):
                try:
                    entries.append((entry.stat().st_mtime_ns, entry.path))
                except FileNotFoundError:  # (another worker dropped it meanwhile)
                    pass
        drop = sorted(entries)[:max(0, len(entries) + 1 - self.capacity)]
        for _, path in drop:
            Path(path).unlink(missing_ok=True)
        self._count = len(entries) + 1 - len(drop)
