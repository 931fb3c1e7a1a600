"""The HTTP frontend only tokenizes and talks to engines: its workers never load torch or our kernels."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from app.model.source import resolve_source
from app.spec.schema import ModelSpec
from tests.conftest import REPO

IMPORT_AND_BUILD = """
import json, sys
from app.server.app import FrontendConfig, create_app
from app.server.main import create_app_from_env
from app.model.tokenizer import load_exported
tokenizer = load_exported(sys.argv[1])
cfg = FrontendConfig(served_name="m", model_path="unused", model_format="gguf", max_model_len=128,
                     engine_addresses=["ipc:///nonexistent"], tokenizer_dir=sys.argv[1])
app = create_app(cfg)
assert app.state.ctx.tokenizer("Hello world").input_ids == tokenizer("Hello world").input_ids
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "app._native")))))
"""


def test_building_the_frontend_from_an_exported_tokenizer_imports_no_torch(tmp_path):
    out = tmp_path / "tokenizer"
    model = resolve_source(ModelSpec()).path
    subprocess.run([sys.executable, "-m", "app.model.tokenizer", str(model), "gguf", "m", str(out)],
                   cwd=REPO, check=True, timeout=300)
    assert (out / "tokenizer.json").is_file()
    result = subprocess.run([sys.executable, "-c", IMPORT_AND_BUILD, str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_frontend_workers_of_a_running_appliance_have_no_torch_mapped(appliance):
    frontend = int(re.search(r"HTTP frontend started \(pid (\d+)\)", appliance.logs()).group(1))
    workers = [int(p) for p in Path(f"/proc/{frontend}/task/{frontend}/children").read_text().split()]
    assert workers, "gunicorn has no worker processes"
    engine_maps = Path(f"/proc/{appliance.engine_pid()}/maps").read_text()
    assert "libtorch" in engine_maps  # the check below can tell
    for pid in [frontend, *workers]:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps and "_native" not in maps, f"process {pid} loaded torch or the kernels"
        rss = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)
        print(f"frontend process {pid}: RSS {int(rss) / 1024:.0f} MiB")


def test_planning_imports_no_torch():
    # `plan` and the supervisor's start sequence run where importing torch is slow (a minute in the NUMA
    # guest) or needless: the head split they need lives in the torch-free app.parallel.heads
    code = ("import sys\nfrom app.cli import main\nmain(['plan', '--set', 'parallel.tp=2', '--set', "
            "'cores.reserve_frontend=0', '--json'])\nprint('TORCH', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "TORCH False"
