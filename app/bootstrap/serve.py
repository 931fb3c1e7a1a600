"""`app serve`: spec -> preflight -> topology -> plan -> engine process -> HTTP frontend, then supervise.

This process stays the parent of everything (PID 1 in a container): it forwards SIGTERM/SIGINT as a
graceful drain (in-flight requests get `server.shutdown_grace` seconds), reaps orphans, and exits
non-zero when the engine or the frontend dies so that the container runtime restarts the appliance.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from app.bootstrap.runtime import RUNTIME_VARIABLE, RuntimeDir
from app.engine.process import EngineProcessConfig, run_engine
from app.server.app import FrontendConfig
from app.server.main import CONFIG_VARIABLE

log = logging.getLogger("app.bootstrap")


class Supervisor:
    def __init__(self, engine_cfg: EngineProcessConfig, frontend_cfg: FrontendConfig, openmp_env: dict[str, str],
                 frontend_cpus: tuple[int, ...], host: str, port: int, workers: int, grace: float, runtime: RuntimeDir):
        self.engine_cfg, self.frontend_cfg, self.openmp_env = engine_cfg, frontend_cfg, openmp_env
        self.frontend_cpus, self.host, self.port, self.workers, self.grace = frontend_cpus, host, port, workers, grace
        self.runtime = runtime
        self.stop_signal: int | None = None
        self.engine: multiprocessing.Process | None = None
        self.frontend: subprocess.Popen | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            self._start_engine()
            self._start_frontend()
            return self._supervise()
        finally:
            self._stop_all()
            self.runtime.remove(self._child_pids())

    def _child_pids(self) -> set[int]:
        return {p.pid for p in (self.engine, self.frontend) if p is not None and p.pid is not None}

    def _stop_all(self) -> None:
        """Whatever path got here, no child outlives the supervisor."""
        if self.frontend is not None:
            self._stop_frontend(5)
        if self.engine is not None:
            self._stop_engine()

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    # --- children ---

    def _start_engine(self) -> None:
        # spawn, not fork: a clean interpreter whose OpenMP variables are set before torch loads
        saved = {k: os.environ.get(k) for k in self.openmp_env}
        os.environ.update(self.openmp_env)
        try:
            self.engine = multiprocessing.get_context("spawn").Process(target=run_engine, args=(self.engine_cfg,),
                                                                       name="engine-0", daemon=False)
            self.engine.start()
            self.runtime.record_pid(self.engine.pid)
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        log.info("engine process started (pid %d) with %s", self.engine.pid,
                 " ".join(f"{k}={v}" for k, v in self.openmp_env.items()))

    def _start_frontend(self) -> None:
        # the settings (API key included) go in the environment, never in a file
        env = {**os.environ, CONFIG_VARIABLE: self.frontend_cfg.dumps(), RUNTIME_VARIABLE: str(self.runtime.path),
               "PROMETHEUS_MULTIPROC_DIR": self.frontend_cfg.metrics_dir}
        command = [sys.executable, "-m", "gunicorn", "-c", "python:app.server.gunicorn_conf",
                   "--bind", f"{self.host}:{self.port}", "--workers", str(self.workers),
                   "--graceful-timeout", str(int(self.grace) + 1), "app.server.main:create_app_from_env()"]
        cpus = self.frontend_cpus
        self.frontend = subprocess.Popen(command, env=env, start_new_session=True,
                                         preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        self.runtime.record_pid(self.frontend.pid)
        log.info("HTTP frontend started (pid %d): %d worker(s) on CPUs %s, http://%s:%d", self.frontend.pid,
                 self.workers, ",".join(map(str, cpus)), self.host, self.port)

    # --- supervision ---

    def _supervise(self) -> int:
        ready_logged = False
        while True:
            if self.stop_signal is not None:
                return self._drain()
            if not self.engine.is_alive():
                return self._engine_died()
            if self.frontend.poll() is not None:
                log.error("the HTTP frontend exited (code %s); stopping", self.frontend.returncode)
                self._stop_engine()
                return 1
            if not ready_logged and self._healthy():
                log.info("ready: serving %s on http://%s:%d", self.frontend_cfg.served_name, self.host, self.port)
                ready_logged = True
            self._reap_orphans()
            time.sleep(0.2)

    def _healthy(self) -> bool:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        try:
            with urllib.request.urlopen(f"http://{host}:{self.port}/health", timeout=1) as response:
                return response.status == 200
        except Exception:
            return False

    def _drain(self) -> int:
        log.info("%s: draining; in-flight requests have %.0f s to finish", signal.Signals(self.stop_signal).name,
                 self.grace)
        Path(self.frontend_cfg.draining_marker).touch()
        self._stop_frontend(self.grace + 5)
        self._stop_engine()
        log.info("stopped")
        return 0

    def _engine_died(self) -> int:
        log.error("the engine process exited (code %s); failing in-flight requests and stopping",
                  self.engine.exitcode)
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

    def _stop_engine(self) -> None:
        if self.engine.is_alive():
            self.engine.terminate()
            self.engine.join(10)
            if self.engine.is_alive():
                self.engine.kill()
                self.engine.join()

    def _reap_orphans(self) -> None:
        """As PID 1, collect exited processes that are not our own children (those we wait for)."""
        if os.getpid() != 1:
            return
        ours = {self.engine.pid, self.frontend.pid}
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in ours:
                return
            os.waitpid(info.si_pid, 0)


def serve(config: str | None, overrides: list[str]) -> int:
    """The whole start sequence; returns the exit code. A SpecError stops it before any process starts."""
    from app.bootstrap.isa import check_isa
    from app.bootstrap.preflight import run_preflight
    from app.logs import configure_logging
    from app.model.footprint import read_footprint
    from app.model.source import resolve_source, source_key
    from app.placement.plan import make_plan
    from app.placement.render import plan_table
    from app.spec.errors import SpecError
    from app.spec.load import read_spec
    from app.topology.machine import read_topology

    doc = read_spec(config, overrides)
    spec = doc.spec
    configure_logging(spec.runtime.log_level, spec.runtime.log_format, "bootstrap")
    try:
        topo = read_topology("/")
        check_isa(topo)
        report = run_preflight(spec.runtime, topo.arch)  # may re-execute this process with LD_PRELOAD
        for warning in report.warnings:
            log.warning("preflight: %s", warning)
        log.info("preflight: LD_PRELOAD=%s; OpenMP runtime %s", report.ld_preload or "(none)", report.openmp_runtime)
        source = resolve_source(spec.model)
        plan = make_plan(spec, topo, read_footprint(source, source_key(spec.model)), report.openmp_runtime)
        _single_rank(plan)
        api_key = _api_key(spec.server.api_key)
        template = _chat_template(spec.model.chat_template)
    except SpecError as error:
        raise doc.locate(error) from None
    for line in plan_table(plan, source, read_footprint(source), topo).splitlines():
        log.info("plan: %s", line)
    for warning in plan.warnings:
        log.warning("plan: %s", warning)
    return _supervisor(spec, plan, source, api_key, template).run()


def _supervisor(spec, plan, source, api_key: str | None, template: str | None) -> Supervisor:
    rank, runtime = plan.ranks[0], RuntimeDir.create()
    path = runtime.path
    s, sched = spec.server, spec.scheduler
    engine = EngineProcessConfig(
        replica=0, address=f"ipc://{path}/engine-0.ipc", model_path=str(source.path), model_format=source.format,
        served_name=source.served_name, dtype=plan.dtype, kv_dtype=plan.kv_dtype, cpus=rank.cpus,
        memory_nodes=rank.memory_nodes, interleave=rank.memory_policy == "interleave", kv_blocks=rank.kv_blocks,
        block_size=plan.block_size, max_model_len=plan.max_model_len, max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens, chunked_prefill=sched.chunked_prefill,
        prefix_caching=sched.prefix_caching, max_waiting_requests=sched.max_waiting_requests,
        step_time_budget=sched.step_time_budget,
        log_level=spec.runtime.log_level, log_format=spec.runtime.log_format)
    frontend = FrontendConfig(
        served_name=source.served_name, model_path=str(source.path), model_format=source.format,
        max_model_len=plan.max_model_len, engine_address=engine.address, chat_template=template, api_key=api_key,
        max_body_size=s.max_body_size, cors_origins=list(s.cors_origins),
        metrics_auth=s.metrics_auth, header_timeout=s.header_timeout, body_timeout=s.body_timeout,
        max_connections=s.max_connections, draining_marker=str(path / "draining"), metrics_dir=str(path / "metrics"))
    os.environ["APPLIANCE_LOG_LEVEL"], os.environ["APPLIANCE_LOG_FORMAT"] = spec.runtime.log_level, spec.runtime.log_format
    return Supervisor(engine, frontend, rank.openmp_env, plan.frontend_cpus, s.host, s.port, s.workers,
                      s.shutdown_grace, runtime)


def _single_rank(plan) -> None:
    from app.spec.errors import Described, Problem, SpecError

    if len(plan.ranks) != 1:
        raise SpecError([Problem("parallel", "tp = 1 and dp = 1 for `serve` in this version (TP and DP replicas "
                                             "come in the next release)",
                                 Described(f"{len(plan.ranks)} ranks"))])


def _api_key(spec) -> str | None:
    """The key itself, from the spec, a file or the environment (the bootstrap reads those)."""
    from app.spec.errors import Described, Problem, SpecError

    if spec is None:
        return None
    if spec.value is not None:
        return spec.value
    if spec.file is not None:
        try:
            return Path(spec.file).read_text().strip()
        except OSError as exc:
            raise SpecError([Problem("server.api_key.file", "a readable file holding the key",
                                     Described(f"{spec.file} ({exc.strerror})"))]) from None
    value = os.environ.get(spec.env)
    if not value:
        raise SpecError([Problem("server.api_key.env", "the name of a set, non-empty environment variable",
                                 Described(f"{spec.env}, which is not set"))])
    return value


def _chat_template(override: str | None) -> str | None:
    if override and Path(override).is_file():
        return Path(override).read_text()
    return override
