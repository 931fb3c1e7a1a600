"""The supervisor of `app serve`: the parent of every process the appliance starts (PID 1 in a container).

It starts each data-parallel replica's engine processes, exports the tokenizer once and starts the HTTP
frontend (gunicorn) on its CPUs, then supervises: it forwards SIGTERM/SIGINT as a graceful drain (in-flight
requests get `server.shutdown_grace` seconds), reaps orphans, restarts a dead replica while the others
serve, and exits non-zero when the frontend dies, the only engine dies, or a replica keeps dying, so that the
container runtime restarts the appliance. SIGHUP applies an edited spec (serve.py reads it) by restarting the
replicas one at a time; an invalid edit is logged and changes nothing.
"""

from __future__ import annotations

import json
import math
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from app.bootstrap.runtime import RUNTIME_VARIABLE, RuntimeDir
from app.bootstrap.startup import bind_address
from app.engine.launch import RankLaunch
from app.engine.process import run_engine
from app.model.source import ModelSource
from app.model.tokenizer import EXPORT_WAIT_SECONDS, EXPORTED_FROM_CACHE, copy_cached_export
from app.server.config import CONFIG_VARIABLE, FrontendConfig

log = logging.getLogger("app.bootstrap")


SETTLE_SECONDS = 1.5  # after a replica is ready again, every frontend worker has had its heartbeat: drain the next
RESTARTS = 3  # a replica's engine may die this many times within RESTART_WINDOW and be restarted...
RESTART_WINDOW = 300.0  # ...seconds; one more death is a crash loop: the appliance exits non-zero


@dataclass
class Layout:
    """What the supervisor runs, from one reading of the spec. A reload compares two of them."""

    replicas: list[list[RankLaunch]]  # each replica: its TP ranks' launch records
    frontend: FrontendConfig
    frontend_cpus: tuple[int, ...]
    host: str
    port: int
    workers: int
    grace: float
    runtime: object  # the spec's `runtime` section: preloads and OpenMP are set up once, in this process

    def needs_restart(self, new: Layout) -> list[str]:
        """What `new` changes that restarting engines cannot apply: the frontend, the replica count, the runtime."""
        found = []
        if len(new.replicas) != len(self.replicas):
            found.append(f"parallel.dp ({len(self.replicas)} -> {len(new.replicas)})")
        if new.frontend != self.frontend:
            changed = [f.name for f in fields(FrontendConfig) if getattr(new.frontend, f.name) != getattr(self.frontend, f.name)]
            found.append(f"the HTTP frontend's settings ({', '.join(changed)})")
        for name in ("frontend_cpus", "host", "port", "workers", "grace", "runtime"):
            if getattr(new, name) != getattr(self, name):
                found.append({"frontend_cpus": "the frontend's CPUs", "host": "server.host", "port": "server.port",
                              "workers": "server.workers", "grace": "server.shutdown_grace",
                              "runtime": "runtime"}[name])
        return found


class Supervisor:
    """Starts and watches the children: one engine process per data-parallel replica (rank 0 of its TP
    group, which starts the other ranks) and the HTTP frontend.

    With dp = 1 a dead engine stops the appliance (exit 1: the container runtime restarts it). With dp >= 2
    a dead replica is restarted while the others serve; a replica that keeps dying (a crash loop) stops it.
    On SIGHUP, `reload` reads the spec again; the replicas whose launch records changed are drained and
    restarted one at a time, each once the previous serves again.
    """

    def __init__(self, layout: Layout, runtime: RuntimeDir, reload: Callable[[], Layout] | None = None):
        self.layout, self.reload = layout, reload
        self.replicas, self.frontend_cfg = list(layout.replicas), layout.frontend
        self.frontend_cpus, self.host, self.port = layout.frontend_cpus, layout.host, layout.port
        self.workers, self.grace = layout.workers, layout.grace
        self.runtime = runtime
        self.stop_signal: int | None = None
        self.engines: list[multiprocessing.Process | None] = [None] * len(self.replicas)
        self.deaths: list[list[float]] = [[] for _ in self.replicas]
        self.frontend: subprocess.Popen | None = None
        self.reload_requested = False
        self.rolling: list[int] = []  # replicas still to restart for the reload under way
        self.reloading: int | None = None  # the replica being drained or restarted
        self.reload_phase = ""  # "draining" (until `drain_deadline`), "starting", then "settling" until `settled_at`
        self.drain_deadline = self.settled_at = 0.0
        self.next_layout: Layout | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hangup)
        try:
            for replica in range(len(self.replicas)):
                self._start_engine(replica)
            self._start_frontend()  # its workers boot while the tokenizer is exported, and wait for it
            if not self._export_tokenizer():
                return 1
            return self._supervise()
        finally:
            self._stop_all()
            self.runtime.remove(self._child_pids())

    def _child_pids(self) -> set[int]:
        return {p.pid for p in (*self.engines, self.frontend) if p is not None and p.pid is not None}

    def _stop_all(self) -> None:
        """Whatever path got here, no child outlives the supervisor."""
        if self.frontend is not None:
            self._stop_frontend(5)
        self._stop_engines()

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def _on_hangup(self, signum, frame) -> None:
        self.reload_requested = True

    # --- children ---

    def _start_engine(self, replica: int) -> None:
        # spawn, not fork: a clean interpreter whose OpenMP variables are set before torch loads
        launches = self.replicas[replica]
        openmp_env = launches[0].placement.openmp_env
        saved = {k: os.environ.get(k) for k in openmp_env}
        os.environ.update(openmp_env)
        try:
            engine = multiprocessing.get_context("spawn").Process(target=run_engine, args=(launches,),
                                                                  name=launches[0].name, daemon=False)
            engine.start()
            self.engines[replica] = engine
            self.runtime.record_pid(engine.pid)
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        log.info("engine process started (pid %d) for replica %d with %s", engine.pid, replica,
                 " ".join(f"{k}={v}" for k, v in openmp_env.items()))

    def _export_tokenizer(self) -> bool:
        """The frontend's torch-free tokenizer, copied from the cache here, or else converted by a short-lived process
        while the engine loads and the frontend's workers boot; it appears in `tokenizer_dir` in one rename, which
        the workers wait for."""
        cfg = self.frontend_cfg
        started, flags = time.monotonic(), []
        try:
            copied = copy_cached_export(ModelSource(Path(cfg.model_path), cfg.model_format, cfg.served_name),
                                        cfg.tokenizer_dir)
        except OSError as exc:  # a damaged entry: converted again, and the entry replaced
            log.warning("could not copy the cached tokenizer export (%s); converting it from the model file", exc)
            copied, flags = False, ["--convert"]
        how = EXPORTED_FROM_CACHE if copied else self._convert_tokenizer(flags)
        if how is None:
            return False
        log.info("tokenizer exported for the HTTP frontend in %.1f s (%s)", time.monotonic() - started, how)
        return True

    def _convert_tokenizer(self, flags: list[str]) -> str | None:
        """`python -m app.model.tokenizer` on the frontend's CPUs; what it says it did, or None where it failed."""
        cfg, cpus = self.frontend_cfg, self.frontend_cpus
        command = [sys.executable, "-m", "app.model.tokenizer", cfg.model_path, cfg.model_format, cfg.served_name,
                   cfg.tokenizer_dir, *flags]
        try:  # its own session: a Ctrl-C meant for the supervisor does not cut it short (the stop comes after it)
            result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                    text=True, timeout=EXPORT_WAIT_SECONDS, start_new_session=True,
                                    preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        except subprocess.TimeoutExpired:
            log.error("the tokenizer export for the HTTP frontend took more than %d s; stopping", EXPORT_WAIT_SECONDS)
            return None
        if result.returncode != 0:
            log.error("could not export the tokenizer for the HTTP frontend (exit code %d):\n%s", result.returncode,
                      result.stderr.strip()[-2000:])
            return None
        return result.stdout.strip().rpartition("\n")[2] or "done"

    def _start_frontend(self) -> None:
        # the settings (API key included) go in the environment, never in a file
        env = {**os.environ, CONFIG_VARIABLE: self.frontend_cfg.dumps(), RUNTIME_VARIABLE: str(self.runtime.path),
               "PROMETHEUS_MULTIPROC_DIR": self.frontend_cfg.metrics_dir}
        command = [sys.executable, "-m", "gunicorn", "-c", "python:app.server.gunicorn_conf",
                   "--bind", bind_address(self.host, self.port), "--workers", str(self.workers),
                   # a second past the grace at least: the workers end what still runs at the grace (503s) first
                   "--graceful-timeout", str(math.ceil(self.grace) + 2), "app.server.main:create_app_from_env()"]
        cpus = self.frontend_cpus
        self.frontend = subprocess.Popen(command, env=env, start_new_session=True,
                                         preexec_fn=lambda: _frontend_child(cpus))
        self.runtime.record_pid(self.frontend.pid)
        log.info("HTTP frontend started (pid %d): %d worker(s) on CPUs %s, http://%s:%d", self.frontend.pid,
                 self.workers, ",".join(map(str, cpus)), self.host, self.port)

    # --- supervision ---

    def _supervise(self) -> int:
        ready_logged = False
        while True:
            if self.stop_signal is not None:
                return self._drain()
            if self.reload_requested and self.reloading is None and not self.rolling:
                self.reload_requested = False
                self._reload()
            for replica, engine in enumerate(self.engines):
                if replica == self.reloading and self.reload_phase == "draining":
                    continue  # it exits when drained; _advance_reload starts its successor
                if not engine.is_alive() and not self._restart(replica):
                    return self._engine_died(replica)
            self._advance_reload()
            if self.frontend.poll() is not None:
                log.error("the HTTP frontend exited (code %s); stopping", self.frontend.returncode)
                self._stop_engines()
                return 1
            if not ready_logged and self._healthy():
                Path(self.frontend_cfg.started_marker).touch()  # from now on, a replica down is "degraded"
                took = _seconds_since_start()
                log.info("ready%s: serving %s on http://%s:%d", f" in {took:.1f} s" if took is not None else "",
                         self.frontend_cfg.served_name, self.host, self.port)
                ready_logged = True
            self._reap_orphans()
            time.sleep(0.2)

    def _healthy(self) -> bool:
        return self._health() is not None

    def _health(self) -> dict | None:
        """/health's body when it answers 200, else None."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)  # (a wildcard: here)
        try:
            with urllib.request.urlopen(f"http://{bind_address(host, self.port)}/health", timeout=1) as response:
                return json.loads(response.read()) if response.status == 200 else None
        except Exception:
            return None

    # --- reloading the spec (SIGHUP) ---

    def _reload(self) -> None:
        """Read the spec again. An invalid edit, or one that only a restart can apply, is logged and changes
        nothing; otherwise the replicas whose launch records changed are queued for a rolling restart."""
        from app.spec.errors import SpecError

        if self.reload is None:
            log.warning("SIGHUP: this appliance was not started from a spec file; nothing to reload")
            return
        log.info("SIGHUP: reading the spec again")
        try:
            new = self.reload()
        except SpecError as error:
            log.error("reload: the edited spec is not valid; still serving with the previous one\n%s", error.render())
            return
        except Exception as exc:  # e.g. a model file that cannot be read
            log.error("reload failed; still serving with the previous spec: %s: %s", type(exc).__name__, exc)
            return
        fixed = self.layout.needs_restart(new)
        if fixed:
            log.error("reload: the edit changes %s, which only a restart of the appliance applies (docker compose "
                      "restart, or the chart's rollout); still serving with the previous spec", "; ".join(fixed))
            return
        changed = [r for r, launches in enumerate(new.replicas) if launches != self.replicas[r]]
        if not changed:
            log.info("reload: nothing the engines use has changed; nothing to restart")
            return
        self.next_layout, self.rolling = new, changed
        log.info("reload: the spec is valid; restarting replica(s) %s one at a time%s", ", ".join(map(str, changed)),
                 "" if len(self.replicas) > 1 else " (dp = 1: requests get 503 until the engine is back)")

    def _advance_reload(self) -> None:
        """One step of the rolling restart: drain (SIGUSR1), start with the new launches, wait until ready."""
        if self.reloading is None:
            if not self.rolling:
                return
            self.reloading, self.reload_phase = self.rolling.pop(0), "draining"
            self.drain_deadline = time.monotonic() + self.grace
            engine = self.engines[self.reloading]
            log.info("reload: draining replica %d (pid %d)", self.reloading, engine.pid)
            os.kill(engine.pid, signal.SIGUSR1)
            return
        replica = self.reloading
        if self.reload_phase == "draining" and self.engines[replica].is_alive() and \
                time.monotonic() > self.drain_deadline:
            log.warning("reload: replica %d still has requests after server.shutdown_grace (%.0f s); stopping it "
                        "(requests without a token yet are retried on another replica, the others fail)", replica,
                        self.grace)
            self.engines[replica].terminate()
            self.drain_deadline = float("inf")
        elif self.reload_phase == "draining" and not self.engines[replica].is_alive():
            log.info("reload: replica %d drained (exit code %s); starting it with the new spec", replica,
                     self.engines[replica].exitcode)
            self.replicas[replica] = self.next_layout.replicas[replica]
            self._start_engine(replica)
            self.reload_phase = "starting"
        elif self.reload_phase == "starting" and self._replica_ready(replica):
            self.reload_phase, self.settled_at = "settling", time.monotonic() + SETTLE_SECONDS
        elif self.reload_phase == "settling" and time.monotonic() >= self.settled_at:
            log.info("reload: replica %d serves with the new spec", replica)
            self.reloading = None
            if not self.rolling:
                self.layout = self.next_layout
                log.info("reload: done")

    def _replica_ready(self, replica: int) -> bool:
        body = self._health()
        if body is None:
            return False
        if "replicas" in body:
            return body["replicas"][replica]["state"] == "ready"
        return body.get("status") == "ok"

    def _drain(self) -> int:
        log.info("%s: draining; in-flight requests have %.0f s to finish", signal.Signals(self.stop_signal).name,
                 self.grace)
        Path(self.frontend_cfg.draining_marker).touch()
        self._stop_frontend(self.grace + 5)
        self._stop_engines()
        log.info("stopped")
        return 0

    def _restart(self, replica: int) -> bool:
        """Restart a dead replica's engine while the others serve; False with dp = 1 or in a crash loop."""
        if len(self.replicas) == 1:
            return False
        now, engine = time.monotonic(), self.engines[replica]
        self.deaths[replica] = [t for t in self.deaths[replica] if now - t < RESTART_WINDOW] + [now]
        if len(self.deaths[replica]) > RESTARTS:
            log.error("replica %d's engine died %d times in %.0f s: a crash loop", replica, len(self.deaths[replica]),
                      RESTART_WINDOW)
            return False
        log.error("replica %d's engine exited (code %s); the other replicas serve while it restarts (%d of %d "
                  "restarts in %.0f s)", replica, engine.exitcode, len(self.deaths[replica]), RESTARTS, RESTART_WINDOW)
        self._start_engine(replica)
        return True

    def _engine_died(self, replica: int) -> int:
        log.error("the engine process exited (replica %d, code %s); failing in-flight requests and stopping",
                  replica, self.engines[replica].exitcode)
        Path(self.frontend_cfg.draining_marker).touch()
        time.sleep(3.5)  # the workers notice the missing heartbeats and fail their requests with an error
        self._stop_frontend(5)
        return 1

    def _stop_frontend(self, timeout: float) -> None:
        if self.frontend.poll() is None:
            self.frontend.send_signal(signal.SIGTERM)  # gunicorn: stop accepting, finish in-flight, exit
            try:
                self.frontend.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the HTTP frontend did not stop in %.0f s; killing it", timeout)
                os.killpg(self.frontend.pid, signal.SIGKILL)
                self.frontend.wait()

    def _stop_engines(self) -> None:
        running = [engine for engine in self.engines if engine is not None and engine.is_alive()]
        for engine in running:
            engine.terminate()
        for engine in running:
            engine.join(10)
            if engine.is_alive():
                engine.kill()
                engine.join()

    def _reap_orphans(self) -> None:
        """As PID 1, collect exited processes that are not our own children (those we wait for)."""
        if os.getpid() != 1:
            return
        ours = self._child_pids()
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in ours:
                return
            os.waitpid(info.si_pid, 0)


def _seconds_since_start() -> float | None:
    """Since this process was started: the command, before preflight re-executed it (the same pid). None where
    /proc cannot tell (lxcfs gives a container its own /proc/uptime, but not its own start times)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        took = float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None
    return took if took >= 0 else None


def _frontend_child(cpus: tuple[int, ...]) -> None:
    """In the forked child, before gunicorn starts: its CPUs, and a SIGTERM when the supervisor dies
    (gunicorn's workers follow their master), so a SIGKILLed supervisor leaves no frontend behind."""
    import ctypes

    os.sched_setaffinity(0, cpus)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
