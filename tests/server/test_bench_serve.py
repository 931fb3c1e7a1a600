"""`python -m app bench serve` against the running appliance: its counts agree with the server's own metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx

from tests.conftest import REPO


def _counter(appliance, name: str) -> float:
    """A labelled counter is absent from /metrics until its first increment."""
    text = httpx.get(appliance.url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_bench_serve_counts_what_the_server_counted(appliance, tmp_path):
    out, png = tmp_path / "results.json", tmp_path / "latency.png"
    generated = _counter(appliance, "vllm:generation_tokens_total")
    prompted = _counter(appliance, "vllm:prompt_tokens_total")
    result = subprocess.run([sys.executable, "-m", "app", "bench", "serve", "--base-url", appliance.url,
                             "--input-len", "40", "--output-len", "6", "--num-prompts", "5", "--concurrency", "1", "3",
                             "--warmup", "1", "--label", "ours", "--json", str(out), "--plot", str(png),
                             "--temperature", "1"],  # sampled, not greedy: the lengths are exact all the same
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert [(r["label"], r["concurrency"], r["completed"], r["failed"]) for r in runs] == [("ours", 1, 5, 0),
                                                                                        ("ours", 3, 5, 0)]
    for r in runs:
        assert r["temperature"] == 1.0
        assert (r["total_input_tokens"], r["total_output_tokens"]) == (5 * 40, 5 * 6)  # ignore_eos, exact lengths
        assert 0 < r["median_ttft_ms"] <= r["median_e2el_ms"] and r["median_tpot_ms"] > 0 and r["median_itl_ms"] > 0
        assert r["output_throughput"] == r["total_output_tokens"] / r["duration_s"]
    # the server's counters: both levels plus one warm-up request each (6 tokens, 40-token prompt)
    assert _counter(appliance, "vllm:generation_tokens_total") - generated == 2 * (5 * 6 + 6)
    assert _counter(appliance, "vllm:prompt_tokens_total") - prompted == 2 * (5 * 40 + 40)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
