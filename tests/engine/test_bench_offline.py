"""`python -m app bench offline`: the engine's throughput without HTTP, at a client's concurrency."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_bench_offline_counts_tokens_at_the_asked_concurrency():
    result = subprocess.run([sys.executable, "-m", "app", "bench", "offline", "-c", "config/default.yaml",
                             "--requests", "5", "--input-len", "24", "--output-len", "6", "--max-num-seqs", "2",
                             "--no-prefix-workload"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1  # no shared-prefix workload
    r = rows[0]
    assert r["dtype"] == "float32"  # the spec's, not a default of the command's own
    assert (r["requests"], r["prompt_tokens"], r["output_tokens"]) == (5, 5 * 24, 5 * 6)  # ignore_eos: exact
    assert r["max_num_seqs"] == 2 and r["peak_running"] == 2  # five requests, never more than two at once
    assert r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"]
