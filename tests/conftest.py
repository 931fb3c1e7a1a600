from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.model.footprint import ModelFootprint, ParamCounts
from app.topology.machine import Topology, read_topology

# Nothing may come from a model hub: every model is a file on disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# What starts keep (app/cache.py: tokenizer exports, step cost fits) goes to a folder of this run's, not the
# user's: a run neither reads what an earlier one left nor leaves anything behind.
_CACHE = tempfile.TemporaryDirectory(prefix="appliance-test-cache-")
os.environ["APPLIANCE_CACHE_DIR"] = _CACHE.name


def _parse_each_gguf_once() -> None:
    """Each GGUF file's metadata is parsed once a test run, and gguf's tensor-name map built once an architecture.

    transformers (the model tests' independent reference) parses a file twice a load (its config, then its
    weights) and builds the name map again for each tensor; tests/gguf_files.py parses SmolLM2's 49,152-token
    vocabulary for every small model that borrows its tokenizer. `gguf.GGUFReader` spends seconds a parse in numpy's
    memmap indexing: about half of the ~30 s transformers took to load SmolLM2 was these repeats. Both are pure
    functions of their arguments (a file that changed is parsed again, a writable reader is never shared), so no
    result changes; only `gguf.GGUFReader` as called through the package is memoised, not the class itself.
    """
    import functools

    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.lru_cache(maxsize=8)
    def parsed(path: str, mtime_ns: int, size: int):
        return reader_class(path, "r")

    def reader(path, mode="r"):
        if mode != "r":
            return reader_class(path, mode)
        stat = os.stat(path)
        return parsed(os.path.abspath(os.fspath(path)), stat.st_mtime_ns, stat.st_size)

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)


_parse_each_gguf_once()

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = Path(__file__).resolve().parent / "topologies"
CONFIG = REPO / "config"

# SmolLM2-135M-Instruct, as its GGUF header describes it (checked against the file in test_model_info).
SMOLLM2 = ModelFootprint(architecture="llama", num_params=134_515_008, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, context_length=8192, intermediate_size=1536,
                         params=ParamCounts(embedding=28_311_552, attention_q=19_906_560, attention_kv=6_635_520,
                                            mlp=79_626_240, other=35_136))


def topology(name: str) -> Topology:
    return read_topology(TOPOLOGIES / name)


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def run_cli(*args: str) -> CliResult:
    """Run `python -m app` in this process (fast) and capture what it prints."""
    from app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse errors
            code = int(exit_.code or 0)
    return CliResult(code, out.getvalue(), err.getvalue())


def run_app(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m app` as a real child process."""
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def tmp_spec(tmp_path):
    def write(text: str, name: str = "spec.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write
