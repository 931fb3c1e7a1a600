"""The gunicorn entry point of a frontend worker: `app.server.main:create_app_from_env()`.

The bootstrap writes the worker's settings to a private file and names it in APPLIANCE_FRONTEND_CONFIG;
this is the one place the frontend reads the environment.
"""

from __future__ import annotations

import os
from pathlib import Path

from app.logs import configure_logging
from app.server.app import FrontendConfig, create_app


def create_app_from_env():
    cfg = FrontendConfig.loads(Path(os.environ["APPLIANCE_FRONTEND_CONFIG"]).read_text())
    configure_logging(os.environ.get("APPLIANCE_LOG_LEVEL", "info"), os.environ.get("APPLIANCE_LOG_FORMAT", "text"),
                      f"http-{os.getpid()}")
    return create_app(cfg)
