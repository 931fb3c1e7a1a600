"""The KV cache made resident ahead of use, in CPU time nothing else wants.

The cache is allocated empty (`new_kv_cache`: torch.empty, so a start maps none of it), and the first write to
each block's pages used to fault inside a step's `write_kv_cache`. The pool hands out never-used blocks before
reusing freed ones (those keep their cached prefixes), so a fresh server faults on every block it writes until
the whole pool has been used once: in a Firecracker VM, where the host backs each new page too, ~1.5-3 s of one
core a GB, ~5% of a fresh server's CPU time under 32 streams. vLLM and llama.cpp pay for their whole cache while
they start (they zero it). Here a thread at the lowest priority there is (SCHED_IDLE, on any CPU of the rank: it
runs where a CPU would otherwise idle) write-faults every page once, block by block in the order the pool hands
blocks out, so start is not delayed, and once idle time has mapped the cache no step faults on it.

It stops, with a log line, where memory runs short (MemAvailable, or that of the NUMA nodes its memory policy binds
it to, within the cgroup's limit): the plan only warns when the cache over-commits the machine, and pages left
untouched are mapped as they are first written, as before. It stops too once the runner that owns the cache is gone
(it holds the tensors only while it touches them), and at exit, which waits for its native call to return.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

from app.model.layers import KVCache
from app.topology.cgroup import MemoryGroup, memory_group, memory_headroom
from app.topology.nodes import memory_available
from app.topology.root import Root
from app.units import format_size

log = logging.getLogger("app.engine")

CHUNK_BYTES = 64 << 20  # touched per native call (between calls the thread checks memory, its owner and `_stop`)
SPARE_BYTES = 512 << 20  # memory left to the rest of the machine, beyond which the thread stops
EXIT_WAIT_SECONDS = 30  # at exit, for a thread inside a native call to return (a chunk takes well under a second)

_stop = threading.Event()  # set at exit: a daemon thread still inside a native call at finalization aborts the process
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def make_resident(caches: list[KVCache]) -> threading.Thread | None:
    """Start the thread (a daemon) for these caches: every layer's (key, value) blocks; None without blocks."""
    if not caches or caches[0][0].shape[0] == 0:
        return None
    refs = [(weakref.ref(k), weakref.ref(v)) for k, v in caches]
    block_bytes = sum(k.stride(0) * k.element_size() + v.stride(0) * v.element_size() for k, v in caches)
    thread = threading.Thread(target=_touch_all, args=(refs, caches[0][0].shape[0], block_bytes),
                              name="kv-resident", daemon=True)
    _threads.add(thread)
    thread.start()
    return thread


@atexit.register
def _stop_threads() -> None:
    _stop.set()
    for thread in list(_threads):
        thread.join(EXIT_WAIT_SECONDS)


def _touch_all(refs: list[tuple[weakref.ref, weakref.ref]], num_blocks: int, block_bytes: int) -> None:
    from app import kernels

    _lowest_priority()
    root, started, step = Root(), time.monotonic(), max(1, CHUNK_BYTES // block_bytes)
    nodes, group = kernels.memory_nodes(), memory_group(root)  # (this thread's policy: bind_threads sets the pool's)
    for first in range(0, num_blocks, step):
        caches = [(k(), v()) for k, v in refs]
        if _stop.is_set() or any(k is None or v is None for k, v in caches):
            return  # the process is exiting, or the runner is gone and its cache with it
        last = min(num_blocks, first + step)
        spare = _spare(root, nodes, group)
        if spare < (last - first) * block_bytes + SPARE_BYTES:
            log.info("KV cache: %s of %s mapped ahead of use; stopped there with %s of memory free%s (the rest is "
                     "mapped as it is first written)", format_size(first * block_bytes),
                     format_size(num_blocks * block_bytes), format_size(spare),
                     "" if nodes is None else f" on NUMA node(s) {', '.join(map(str, nodes))}")
            return
        kernels.touch_kv_blocks(caches, first, last)
        del caches
    log.info("KV cache: all %s mapped, %.1f s after the engine made it (at idle priority)",
             format_size(num_blocks * block_bytes), time.monotonic() - started)


def _spare(root: Root, nodes: tuple[int, ...] | None, group: MemoryGroup | None) -> int:
    """What the thread may still map: the machine's (or its bound nodes') available memory, within the cgroup's."""
    available, headroom = memory_available(root, nodes), None if group is None else memory_headroom(root, group)
    return available if headroom is None else min(available, headroom)


def _lowest_priority() -> None:
    """This thread only (Linux schedules threads): SCHED_IDLE, else the highest nice value; on every CPU of the rank
    (the thread that started it is pinned to the rank's first, the one busiest with the engine's own Python); named
    as `top -H` shows it."""
    try:
        with open("/proc/thread-self/comm", "w") as comm:
            comm.write("kv-resident")
    except OSError:
        pass
    try:
        cpus = set()
        for task in os.listdir("/proc/self/task"):  # the rank's OpenMP threads are pinned to its other CPUs
            try:
                cpus |= os.sched_getaffinity(int(task))
            except OSError:
                pass  # a thread that has just exited
        if cpus:
            os.sched_setaffinity(0, cpus)
    except OSError:
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
