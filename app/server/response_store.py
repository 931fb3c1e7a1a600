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
import hashlib
import json
import os
from pathlib import Path


class ResponseStore:
    def __init__(self, directory: str | None, capacity: int):
        self.directory = Path(directory) if directory and capacity > 0 else None
        self.capacity = capacity

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    async def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep `response` and the input items that led to it (a predecessor's input and output, then its own)."""
        record = json.dumps({"response": response, "conversation": conversation})
        await asyncio.to_thread(self._write, response["id"], record)

    async def get(self, response_id: str) -> dict | None:
        """{"response": ..., "conversation": [...]}, or None: never stored, deleted or dropped as the oldest."""
        return await asyncio.to_thread(self._read, response_id)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, response_id)

    def _path(self, response_id: str) -> Path:
        return self.directory / (hashlib.sha256(response_id.encode()).hexdigest()[:40] + ".json")

    def _write(self, response_id: str, record: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(response_id)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(record)
        os.replace(temporary, path)
        self._drop_oldest()

    def _read(self, response_id: str) -> dict | None:
        try:
            record = json.loads(self._path(response_id).read_text())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        return record if record["response"]["id"] == response_id else None  # (a hash collision: none)

    def _delete(self, response_id: str) -> bool:
        if self._read(response_id) is None:
            return False
        self._path(response_id).unlink(missing_ok=True)
        return True

    def _drop_oldest(self) -> None:
        entries = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".json"):
                try:
                    entries.append((entry.stat().st_mtime_ns, entry.path))
                except FileNotFoundError:  # (another worker dropped it meanwhile)
                    pass
        for _, path in sorted(entries)[:max(0, len(entries) - self.capacity)]:
            Path(path).unlink(missing_ok=True)
