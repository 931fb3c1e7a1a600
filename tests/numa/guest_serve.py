"""Runs inside the NUMA guest (see test_numa_serve.py): `serve` a small model with tp=2 and dp=2, and report the
plan and where every rank's process actually runs and keeps its pages.

    python tests/numa/guest_serve.py MODEL.gguf [--set KEY=VALUE ...]   # one JSON line, prefixed REPORT

The guest is emulated (20-30x slower than the host), so the model is tiny and each rank imports torch
once; the host-side test asserts on the report.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SPEC = """
model: {{path: {model}, dtype: float32, max_model_len: 256}}
parallel: {{tp: {tp}, dp: {dp}}}
kv_cache: {{memory: 32MiB}}
server: {{port: 8321, host: 127.0.0.1, workers: 1}}
"""
READY_TIMEOUT = 900  # seconds: four ranks import torch, and the frontend transformers, under software emulation


def main(model: str, *sets: str) -> int:
    if _in_guest():
        _loopback_up()  # the guest boots without any network, not even 127.0.0.1
    print("REPORT", json.dumps(serve_and_inspect(model, 2, 2, list(sets))), flush=True)
    return 0


def serve_and_inspect(model: str, tp: int, dp: int, sets: list[str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"numa-tp{tp}-dp{dp}-"))
    spec = work / "spec.yaml"
    spec.write_text(SPEC.format(model=model, tp=tp, dp=dp))
    plan = json.loads(subprocess.run([sys.executable, "-m", "app", "plan", "-c", str(spec), *sets, "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    log_path = work / "serve.log"
    # The guest's /tmp is the host's, over 9p, where a unix socket cannot be connected to: the runtime
    # directory (the engines' IPC sockets) goes to the guest's own /run instead.
    env = {**os.environ, "TMPDIR": "/run"} if os.access("/run", os.W_OK) and _in_guest() else None
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "app", "serve", "-c", str(spec), *sets], stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
    report: dict = {"tp": tp, "dp": dp, "plan": plan["ranks"], "frontend": plan["frontend_cpulist"]}
    try:
        started = time.monotonic()
        _wait_ready(server, log_path)
        report["ready_seconds"] = round(time.monotonic() - started, 1)
        report["completion"] = _complete("The capital of France is")
        report["ranks"] = [{"replica": replica, "rank": rank, **inspect(pid)}
                           for (replica, rank), pid in sorted(_rank_pids(log_path.read_text()).items())]
    finally:
        server.send_signal(signal.SIGTERM)
        report["exit_code"] = server.wait(timeout=120)
        report["log_tail"] = log_path.read_text()[-3000:]
    return report


def _loopback_up() -> None:
    """`ip link set lo up`, without needing iproute2: the kernel gives lo 127.0.0.1 as it comes up."""
    import fcntl
    import socket
    import struct

    get_flags, set_flags, up = 0x8913, 0x8914, 0x1  # SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, get_flags, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(sock, set_flags, struct.pack("16sH14s", b"lo", flags | up, b""))


def _in_guest() -> bool:
    return any(" 9p " in line for line in Path("/proc/mounts").read_text().splitlines())


def _wait_ready(server: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"serve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen("http://127.0.0.1:8321/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"not ready in {READY_TIMEOUT} s:\n{log_path.read_text()[-4000:]}")


def _complete(prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request("http://127.0.0.1:8321/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["usage"]


def _rank_pids(log: str) -> dict[tuple[int, int], int]:
    """(replica, rank) -> pid, from the supervisor's and the engines' start-up lines (a TP rank is started by its
    replica's rank 0, whose lines are "engine-REPLICA.0")."""
    pids = {(int(r), 0): int(p) for p, r in re.findall(r"engine process started \(pid (\d+)\) for replica (\d+)", log)}
    for replica, rank, pid in re.findall(r" engine-(\d+)\.0 INFO \S+: TP rank (\d+) started \(pid (\d+)\)", log):
        pids[(int(replica), int(rank))] = int(pid)
    return pids


def inspect(pid: int) -> dict:
    """Where a process may run and allocate, each thread's CPUs, and its anonymous pages per NUMA node."""
    status = _status(f"/proc/{pid}/status")
    threads = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        task = _status(f"/proc/{pid}/task/{tid}/status")
        threads.append({"name": task["Name"], "cpus": task["Cpus_allowed_list"]})
    pages: dict[str, int] = {}
    policies: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        fields = line.split()
        if not any(f.startswith("anon=") for f in fields):
            continue
        policies[fields[1]] = policies.get(fields[1], 0) + 1
        for node, count in re.findall(r"\bN(\d+)=(\d+)", line):
            pages[node] = pages.get(node, 0) + int(count)
    return {"pid": pid, "cpus_allowed": status["Cpus_allowed_list"], "mems_allowed": status["Mems_allowed_list"],
            "threads": threads, "anon_pages_by_node": pages, "anon_policies": policies}


def _status(path: str) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(path).read_text().strip().splitlines() if ":\t" in line)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
