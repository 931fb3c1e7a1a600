"""The Responses API's store (app/server/response_store.py): the newest N kept, the one just written never dropped,
a write that fails answered with False (and nothing left behind), its trims a scan each 1% of its writes."""

from __future__ import annotations

import asyncio
import os

from app.server.response_store import ResponseStore


def _put(store: ResponseStore, response_id: str, text: str = "x") -> bool:
    return asyncio.run(store.put({"id": response_id, "output": text}, [{"role": "user", "content": text}]))


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def test_the_newest_n_are_kept_and_read_back(tmp_path):
    store = ResponseStore(str(tmp_path / "store"), 3)
    for i in range(5):
        assert _put(store, f"resp_{i}", f"answer {i}")
    kept = [i for i in range(5) if asyncio.run(store.get(f"resp_{i}")) is not None]
    assert kept == [2, 3, 4] and len(_files(tmp_path / "store")) == 3
    assert asyncio.run(store.get("resp_4"))["response"]["output"] == "answer 4"
    assert asyncio.run(store.delete("resp_4")) and asyncio.run(store.get("resp_4")) is None
    assert not asyncio.run(store.delete("resp_4"))


def test_the_response_just_written_is_never_the_one_dropped(tmp_path):
    """Written within one clock tick, files may share a time; the one just written stays whatever its name."""
    store = ResponseStore(str(tmp_path), 1)
    for i in range(50):
        assert _put(store, f"r{i}")
        assert asyncio.run(store.get(f"r{i}")) is not None, i


def test_a_store_that_cannot_be_written_says_so_and_leaves_nothing(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    store = ResponseStore(str(blocked / "store"), 4)
    assert not _put(store, "resp_1")
    assert "could not store response resp_1" in caplog.text
    assert asyncio.run(store.get("resp_1")) is None
    full = tmp_path / "full"
    full.mkdir()
    store = ResponseStore(str(full), 4)
    os.chmod(full, 0o500)  # (as root, the write still works: then it must have been kept)
    try:
        written = _put(store, "resp_2")
    finally:
        os.chmod(full, 0o700)
    assert written == (asyncio.run(store.get("resp_2")) is not None)
    assert all(name.endswith(".json") for name in _files(full))  # no temporary file left behind


def test_a_big_store_scans_its_files_once_in_each_1_percent_of_writes(tmp_path, monkeypatch):
    store = ResponseStore(str(tmp_path), 200)
    scans = []
    real = store._drop_oldest
    monkeypatch.setattr(store, "_drop_oldest", lambda newest: (scans.append(newest), real(newest)))
    for i in range(260):
        _put(store, f"r{i}")
    assert len(_files(tmp_path)) <= 202  # capacity + 1% at most
    assert 20 <= len(scans) <= 40  # the first write's, then one each 3 writes past 202 (not each of the 260)
    assert asyncio.run(store.get("r259")) is not None and asyncio.run(store.get("r0")) is None
