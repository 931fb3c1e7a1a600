"""The KV cache made resident ahead of use: which pages the touch maps (mincore), that no value changes even
beside a step writing the cache, and when the thread stops."""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from app import kernels
from app.engine import resident

PAGE = os.sysconf("SC_PAGE_SIZE")
HEADS, DIM, BLOCK = 3, 64, 16  # SmolLM2's KV heads and head size


def fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor on pages of its own that nothing has touched yet (an anonymous mapping, not the allocator's)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_NOHUGEPAGE)  # a touch maps one page, where transparent huge pages are "always" too
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # (the tensor keeps the mapping alive)


def fresh_caches(layers: int, blocks: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, ...]]:
    return [(fresh((blocks, HEADS, DIM, BLOCK), dtype), fresh((blocks, HEADS, BLOCK, DIM), dtype))
            for _ in range(layers)]


def resident_pages(t: torch.Tensor) -> list[bool]:
    """Per page of `t`'s memory, whether it is mapped (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // PAGE * PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(end - start) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, os.strerror(ctypes.get_errno())
    return [bool(b & 1) for b in vec]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_touch_maps_exactly_the_pages_of_the_blocks_asked(dtype):
    caches = fresh_caches(2, 40, dtype)
    assert not any(p for k, v in caches for t in (k, v) for p in resident_pages(t))
    kernels.touch_kv_blocks(caches, 7, 19)
    for k, v in caches:
        for t in (k, v):
            row = t.stride(0) * t.element_size()  # bytes a block
            first_page, end_page = 7 * row // PAGE, -(-19 * row // PAGE)
            expected = [first_page <= p < end_page for p in range(len(resident_pages(t)))]
            assert resident_pages(t) == expected


def test_a_write_after_the_touch_takes_no_page_fault():
    # mincore counts a page mapped to the shared zero page (a read's fault) as resident; only a write maps its own
    k, v = fresh_caches(1, 1000)[0]
    per_page = PAGE // k.element_size()

    def faults_writing(t: torch.Tensor) -> int:
        flat = t.view(-1)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for i in range(0, flat.numel(), per_page * 8):  # one element in every 8th page, from this thread alone
            flat[i] = 1.0
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    faults_writing(torch.zeros_like(k))  # the indexing path's own first faults (21 here), not the cache's
    pages = k[:500].numel() // per_page // 8  # written in each half
    kernels.touch_kv_blocks([(k, v)], 0, 500)
    assert faults_writing(k[:500]) < pages // 10  # touched: (next to) none
    assert faults_writing(k[500:]) > pages // 2  # untouched: one a page written


def test_touch_changes_no_value():
    k = torch.randn(12, HEADS, DIM, BLOCK).bfloat16()
    v = torch.randn(12, HEADS, BLOCK, DIM).bfloat16()
    k0, v0 = k.clone(), v.clone()
    kernels.touch_kv_blocks([(k, v)], 0, 12)
    assert torch.equal(k, k0) and torch.equal(v, v0)


def test_touch_rejects_blocks_outside_the_cache_and_a_mismatched_pair():
    k, v = torch.empty(4, HEADS, DIM, BLOCK), torch.empty(4, HEADS, BLOCK, DIM)
    with pytest.raises(ValueError, match=r"blocks \[2, 5\) are outside \[0, 4\)"):
        kernels.touch_kv_blocks([(k, v)], 2, 5)
    with pytest.raises(ValueError, match="key_cache: must be"):
        kernels.touch_kv_blocks([(torch.empty(4, HEADS, BLOCK, DIM + 2), v)], 0, 1)
    with pytest.raises(TypeError, match="key_cache: dtype"):
        kernels.touch_kv_blocks([(k.to(torch.int32), v)], 0, 1)


def test_the_thread_maps_the_whole_cache_and_keeps_what_a_step_writes_meanwhile(monkeypatch, caplog):
    monkeypatch.setattr(resident, "CHUNK_BYTES", 1 << 20)  # many calls, so the writes below land between and during
    monkeypatch.setattr(resident, "_spare", lambda root, nodes, group: 1 << 50)
    layers, blocks = 4, 600
    caches = fresh_caches(layers, blocks)
    tokens = 64
    slots = torch.randperm(blocks * BLOCK)[:tokens]
    key, value = torch.randn(tokens, HEADS, DIM), torch.randn(tokens, HEADS, DIM)
    writes = 0
    with caplog.at_level(logging.INFO, logger="app.engine"):
        thread = resident.make_resident(caches)
        while thread.is_alive() or writes == 0:  # as steps do, while the thread runs (it drops the GIL as it touches)
            for k, v in caches:
                kernels.write_kv_cache(key, value, k, v, slots)
            writes += 1
        thread.join(60)
    assert all(all(resident_pages(t)) for k, v in caches for t in (k, v))
    for k, v in caches:
        kb, vb = kernels.kv_cache_blocks(k, v)
        for t, slot in enumerate(slots.tolist()):
            assert torch.equal(kb[slot // BLOCK, :, slot % BLOCK], key[t].bfloat16())
            assert torch.equal(vb[slot // BLOCK, :, slot % BLOCK], value[t].bfloat16())
    assert "KV cache: all 28.12 MiB mapped" in caplog.text  # 4 layers x 600 blocks x 2 x 6 KiB


def test_the_thread_stops_where_memory_runs_short(monkeypatch, caplog):
    monkeypatch.setattr(resident, "CHUNK_BYTES", 1 << 20)
    caches = fresh_caches(2, 400)
    block_bytes = sum(k.stride(0) * k.element_size() * 2 for k, _ in caches)
    step = (1 << 20) // block_bytes
    spare = iter([resident.SPARE_BYTES + (1 << 30), resident.SPARE_BYTES])  # one chunk's worth, then nothing
    monkeypatch.setattr(resident, "_spare", lambda root, nodes, group: next(spare))
    with caplog.at_level(logging.INFO, logger="app.engine"):
        resident.make_resident(caches).join(60)
    k = caches[0][0]
    pages = resident_pages(k)
    row = k.stride(0) * k.element_size()
    assert all(pages[:step * row // PAGE]) and not any(pages[-(-step * row // PAGE):])
    assert "stopped there" in caplog.text


def test_the_thread_stops_once_the_cache_is_gone(monkeypatch):
    monkeypatch.setattr(resident, "CHUNK_BYTES", 1 << 20)
    asked, failures = [], []
    monkeypatch.setattr(threading, "excepthook", failures.append)

    def spare(root, nodes, group):  # before the second chunk the runner, and so its cache, is dropped
        if len(asked) == 1:
            caches.clear()
            gc.collect()
        asked.append(1)
        return 1 << 50

    monkeypatch.setattr(resident, "_spare", spare)
    caches = fresh_caches(2, 400)
    thread = resident.make_resident(caches)
    thread.join(60)
    # it had taken the second chunk's tensors before the drop: it touches them, then finds no cache for the third
    assert not thread.is_alive() and len(asked) == 2 and not failures


def test_the_thread_stops_at_exit(monkeypatch):
    monkeypatch.setattr(resident, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(resident, "_spare", lambda root, nodes, group: 1 << 50)
    monkeypatch.setattr(resident, "_stop", threading.Event())
    resident._stop.set()  # what the exit hook sets before it waits for the thread
    caches = fresh_caches(2, 400)
    resident.make_resident(caches).join(60)
    assert not any(p for k, v in caches for t in (k, v) for p in resident_pages(t))


def test_an_exit_while_the_thread_touches_is_clean(tmp_path):
    # a daemon thread inside a native call at finalization aborts the process (the GIL's release cannot unwind)
    script = tmp_path / "exit.py"
    script.write_text("import time\nimport torch\nfrom app.engine import resident\n"  # 1 GiB of fresh pages
                      "caches = [(torch.empty(2048, 8, 128, 16, dtype=torch.bfloat16), "
                      "torch.empty(2048, 8, 16, 128, dtype=torch.bfloat16)) for _ in range(4)]\n"
                      "resident.make_resident(caches)\ntime.sleep(0.1)\n")  # (here: mid-way through, ~1 s in all)
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parents[2])
    assert child.returncode == 0, child.stderr


def test_no_thread_for_an_empty_cache():
    assert resident.make_resident([]) is None
    assert resident.make_resident([(torch.empty(0, HEADS, DIM, BLOCK), torch.empty(0, HEADS, BLOCK, DIM))]) is None
