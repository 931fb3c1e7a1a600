"""The gunicorn worker class: uvicorn's, with the connection guards of `app.server.connections`."""

from __future__ import annotations

from uvicorn_worker import UvicornWorker

from app.server.connections import guarded_protocol
from app.server.main import config_from_env


class ApplianceWorker(UvicornWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = config_from_env()
        self.config.http = guarded_protocol(cfg.header_timeout, cfg.max_connections)  # read when uvicorn starts
