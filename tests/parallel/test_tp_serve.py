"""`serve` with tp=2: the engine process is rank 0 and starts rank 1; answers equal the offline tp=1 ones."""

from __future__ import annotations

import os
import re
from pathlib import Path

import openai

from app import LLM, SamplingParams
from tests.server.conftest import BASE_SPEC, Appliance

PROMPTS = ["The capital of France is", "def add(a, b):", "List three primary colors:", "Once upon a time",
           "Water boils at", "Translate to French: good night", "1 2 3 4 5", "Why is the sky blue?"]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_served_tp2_answers_equal_offline_tp1_and_leave_nothing(tmp_path):
    with LLM(model={"dtype": "float32"}, kv_cache={"memory": "512MiB"}, bind_threads=False) as llm:
        offline = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    app = Appliance(tmp_path, BASE_SPEC, sets=("parallel.tp=2", "cores.reserve_frontend=0")).wait_ready()
    try:
        engine = app.engine_pid()
        workers = _children(engine)
        rank1 = int(re.search(r"TP rank 1 started \(pid (\d+)\)", app.logs()).group(1))
        assert rank1 in workers  # a child of the engine process, so it dies with it
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0)
        served = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=12, temperature=0)
        assert [c.text for c in sorted(served.choices, key=lambda c: c.index)] == offline
        assert "TP group of 2 ranks ready" in app.logs()
    finally:
        code = app.stop()
    assert code == 0, app.logs()[-3000:]
    for pid in [engine, *workers]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("appliance-tp-")]
