"""The gunicorn entry point of a frontend worker: `app.server.main:create_app_from_env()`.

The bootstrap hands the workers their settings as JSON in APPLIANCE_FRONTEND_CONFIG, an environment
variable rather than a file, so the API key never touches a disk; this is where the frontend reads
the environment (and gunicorn_conf.py, for the log level and format of gunicorn's own lines).
"""

from __future__ import annotations

import os

from app.logs import configure_logging
from app.server.app import create_app
from app.server.config import CONFIG_VARIABLE, FrontendConfig


def config_from_env() -> FrontendConfig:
    return FrontendConfig.loads(os.environ[CONFIG_VARIABLE])


def create_app_from_env():
    cfg = config_from_env()
    configure_logging(os.environ.get("APPLIANCE_LOG_LEVEL", "info"), os.environ.get("APPLIANCE_LOG_FORMAT", "text"),
                      f"http-{os.getpid()}")
    return create_app(cfg)
