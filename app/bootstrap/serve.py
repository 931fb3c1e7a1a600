"""`app serve`: spec -> preflight -> topology -> plan -> engine processes -> HTTP frontend, then supervise.

The start sequence is here; the process tree it starts, and how it is kept alive, drained and reloaded on
SIGHUP, is the Supervisor's (supervisor.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from app.bootstrap.runtime import RuntimeDir
from app.bootstrap.supervisor import Layout, Supervisor
from app.server.config import FrontendConfig

log = logging.getLogger("app.bootstrap")


def serve(config: str | None, overrides: list[str]) -> int:
    """The whole start sequence; returns the exit code. A SpecError stops it before any process starts."""
    from app.bootstrap.startup import api_key, check_listen, prepare
    from app.spec.errors import SpecError

    _check_temporary_directory()
    deployment = prepare(config, overrides, openmp=_preflight)
    try:
        key = api_key(deployment.spec.server.api_key)
        check_listen(deployment.spec.server.host, deployment.spec.server.port)  # before the model loads, not after
    except SpecError as error:
        raise deployment.doc.locate(error) from None
    plan = deployment.plan
    _log_plan(deployment)
    runtime = RuntimeDir.create()
    os.environ["APPLIANCE_LOG_LEVEL"], os.environ["APPLIANCE_LOG_FORMAT"] = \
        deployment.spec.runtime.log_level, deployment.spec.runtime.log_format

    def reload() -> Layout:
        # the same file and --set overrides; "auto" OpenMP stays what the preflight found (runtime edits need a restart)
        again = prepare(config, overrides, openmp=lambda spec, topo: plan.openmp_runtime)
        try:
            key = api_key(again.spec.server.api_key)
        except SpecError as error:
            raise again.doc.locate(error) from None
        return _layout(again, key, runtime.path)

    return Supervisor(_layout(deployment, key, runtime.path), runtime, reload).run()


def _check_temporary_directory() -> None:
    """The runtime directory, the tokenizer's export and the metrics' files need a writable temporary directory: on a
    read-only root without one, say how to give it one rather than fail later with a traceback."""
    from app.spec.errors import Described, Problem, SpecError

    try:
        tempfile.gettempdir()
    except FileNotFoundError:
        raise SpecError([Problem("(filesystem)", "a writable temporary directory ($TMPDIR, /tmp or /var/tmp): on a "
                                 "read-only root, mount one there (docker run --tmpfs /tmp; compose.yaml's tmpfs; "
                                 "a Kubernetes emptyDir, as the chart mounts)",
                                 Described("no writable $TMPDIR, /tmp, /var/tmp or /usr/tmp"))]) from None


def _log_plan(deployment) -> None:
    from app.placement.render import plan_table

    plan = deployment.plan
    for line in plan_table(plan, deployment.source, deployment.footprint, deployment.topology,
                           warnings=False).splitlines():
        log.info("plan: %s", line)
    for warning in plan.warnings:
        log.warning("plan: %s", warning)
    if deployment.pooling() != "last":  # the others compute each input whole: worth a line
        said = "model.pooling" if deployment.spec.model.pooling != "auto" else "the model file"
        log.info("embeddings: %s pooling (%s)", deployment.pooling(), said)
    defaults, where = deployment.sampling_defaults
    if defaults:  # (vLLM says as much: a request that leaves these out is answered differently than OpenAI's)
        log.info("sampling: requests that leave them out get %s (%s; model.generation_config: none turns the "
                 "model's off)", ", ".join(f"{k} {v:g}" for k, v in defaults.items()), where)


def _preflight(spec, topo) -> str:
    """Logging, the ISA check and the preloaded libraries, before anything heavy: the preflight may
    re-execute this process with LD_PRELOAD set. Returns the OpenMP runtime found."""
    from app.bootstrap.isa import check_isa, check_native_build
    from app.bootstrap.preflight import run_preflight
    from app.logs import configure_logging

    configure_logging(spec.runtime.log_level, spec.runtime.log_format, "bootstrap")
    check_isa(topo)
    check_native_build()
    report = run_preflight(spec.runtime, topo.arch)  # may re-execute this process with LD_PRELOAD
    for warning in report.warnings:
        log.warning("preflight: %s", warning)
    log.info("preflight: LD_PRELOAD=%s; OpenMP runtime %s", report.ld_preload or "(none)", report.openmp_runtime)
    return report.openmp_runtime


def _layout(deployment, api_key: str | None, path: Path) -> Layout:
    spec, plan = deployment.spec, deployment.plan
    launches = deployment.launches(path)
    replicas = [[l for l in launches if l.replica == r] for r in sorted({l.replica for l in launches})]
    s, model = spec.server, launches[0].model
    frontend = FrontendConfig(
        served_name=model.served_name, model_path=model.path, model_format=model.format,
        max_model_len=plan.max_model_len, engine_addresses=[l.address for l in launches if l.rank == 0],
        chat_template=deployment.chat_template(), reasoning=spec.model.reasoning,
        pooling=deployment.pooling(), sampling_defaults=deployment.sampling_defaults[0],
        api_key=api_key, max_body_size=s.max_body_size, cors_origins=list(s.cors_origins),
        metrics_auth=s.metrics_auth, header_timeout=s.header_timeout, body_timeout=s.body_timeout,
        max_connections=s.max_connections, tokenizer_dir=str(path / "tokenizer"), draining_marker=str(path / "draining"),
        shutdown_grace=s.shutdown_grace,
        started_marker=str(path / "started"),
        metrics_dir=str(path / "metrics"), responses_store=s.responses_store, responses_dir=str(path / "responses"))
    return Layout(replicas, frontend, plan.frontend_cpus, s.host, s.port, s.workers, s.shutdown_grace, spec.runtime)
