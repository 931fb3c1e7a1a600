"""gunicorn's settings for the frontend (the bootstrap passes bind, workers and timeouts on top)."""

import os

from app.logs import gunicorn_logging

worker_class = "app.server.worker.ApplianceWorker"
logconfig_dict = gunicorn_logging(os.environ.get("APPLIANCE_LOG_LEVEL", "info"),
                                  os.environ.get("APPLIANCE_LOG_FORMAT", "text"))
# Workers load a tokenizer at start; give them time before gunicorn declares them dead.
timeout = 120
keepalive = 5
accesslog = None  # request logs come from our own handlers, not one line per HTTP hit
proc_name = "appliance-http"
control_socket_disable = True  # gunicorn 27's runtime-control socket: nothing here uses it


def child_exit(server, worker):
    """Let prometheus-client drop the live gauges of a worker that exited."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def post_fork(server, worker):
    """Record the worker's pid so that the supervisor can remove what it leaves in /dev/shm."""
    import os
    from pathlib import Path

    from app.bootstrap.runtime import RUNTIME_VARIABLE, record_pid

    if os.environ.get(RUNTIME_VARIABLE):
        record_pid(Path(os.environ[RUNTIME_VARIABLE]), worker.pid)
