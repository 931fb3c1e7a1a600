"""Logging for every process of the appliance: readable text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str):
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "process": self.process_name, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def formatter(fmt: str, process_name: str) -> logging.Formatter:
    """runtime.log_format's lines: "json", one object each, or "text"."""
    if fmt == "json":
        return JsonFormatter(process_name)
    return logging.Formatter(f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s", "%H:%M:%S")


def gunicorn_logging(level: str, fmt: str) -> dict:
    """gunicorn's logconfig_dict: its own lines (its master's, and its workers' "gunicorn.error" and "uvicorn.error")
    in the appliance's format, not gunicorn's."""
    handler = {"class": "logging.StreamHandler", "formatter": "appliance", "stream": "ext://sys.stderr"}
    return {"formatters": {"appliance": {"()": "app.logs.formatter", "fmt": fmt, "process_name": "http"}},
            "handlers": {"console": handler}, "root": {"level": level.upper(), "handlers": ["console"]},
            "loggers": {"gunicorn.error": {"level": level.upper(), "handlers": ["console"], "propagate": False}}}


def configure_logging(level: str = "info", fmt: str = "text", process_name: str = "appliance") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt, process_name))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def thread_lock_for_progress_bars() -> None:
    """tqdm's default lock is a multiprocessing one: a named semaphore in /dev/shm that a killed process leaks."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
