"""`bench serve` arithmetic on synthetic traces: what vllm bench serve would report for them."""

from __future__ import annotations

import math

import pytest

from app.benchmark.serve import Trace, Workload, level_prompts, percentiles, random_prompts, read_results, summarize


def _trace(start: float, tokens: list[float], prompt: int = 10, output: int | None = None) -> Trace:
    return Trace(prompt, start, tokens, len(tokens) if output is None else output, tokens[-1])


def test_summary_of_a_synthetic_trace():
    traces = [
        _trace(0.0, [0.5, 0.6, 0.7, 0.8]),  # TTFT 500 ms, TPOT 100 ms, ITL 100 ms x3, E2EL 800 ms
        _trace(1.0, [1.2, 1.5, 1.8], prompt=20),  # TTFT 200, TPOT 300, ITL 300 x2, E2EL 800
        _trace(2.0, [2.1, 2.5], output=5),  # 5 tokens in 2 chunks (the server batched them): TPOT (0.4 / 4)
        Trace(30, 3.0, [], 0, 3.2, error="HTTP 503"),  # failed: counted, never measured
    ]
    s = summarize(traces, duration=4.0)
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (3, 1, 40, 12)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert s["mean_ttft_ms"] == pytest.approx((500 + 200 + 100) / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx((100 + 300 + 100) / 3)
    assert s["median_itl_ms"] == pytest.approx(200)  # 100, 100, 100 | 300, 300, 400
    assert s["mean_itl_ms"] == pytest.approx(1300 / 6)
    assert s["median_e2el_ms"] == pytest.approx(800)


def test_percentiles_interpolate_like_numpy():
    values = [float(v) for v in range(1, 11)]  # 1..10 s
    p = percentiles(values, "x")
    assert p["median_x_ms"] == pytest.approx(5500)
    assert p["p90_x_ms"] == pytest.approx(9100)  # numpy.percentile(range(1, 11), 90) = 9.1
    assert p["p99_x_ms"] == pytest.approx(9910)
    assert percentiles([], "x") == {"mean_x_ms": 0.0, "median_x_ms": 0.0, "p90_x_ms": 0.0, "p99_x_ms": 0.0}


def test_random_prompts_are_reproducible_and_of_the_asked_length():
    a, b = random_prompts(4, 128, seed=3), random_prompts(4, 128, seed=3)
    assert a == b and [len(p) for p in a] == [128] * 4 and a[0] != a[1]
    assert all(1000 <= t < 30000 for p in a for t in p)
    assert not math.isclose(sum(a[0]), sum(random_prompts(1, 128, seed=4)[0]))


def test_each_level_sends_new_prompts_the_same_on_every_server(tmp_path):
    # one level's prompts must not be an earlier level's: the prefix cache would serve them and flatter TTFT
    w = Workload(input_len=64, num_prompts=8, warmup=2, seed=5)
    levels = [level_prompts(w, level) for level in range(3)]
    seen = [tuple(p) for prompts in levels for p in prompts]
    assert len(seen) == 30 and len(set(seen)) == 30
    assert level_prompts(w, 1) == levels[1]  # reproducible: another server gets the same requests
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(25)))
    from_file = [level_prompts(w, level, lines) for level in range(2)]
    assert from_file[0] == [f"p{i}" for i in range(10)] and from_file[1] == [f"p{i}" for i in range(10, 20)]


def test_plot_reads_our_results_and_vllm_bench_serve_results(tmp_path):
    import json

    ours = [{"label": "appliance", "concurrency": 8, "request_rate": math.inf, "output_throughput": 300.0,
             "median_ttft_ms": 100.0, "median_tpot_ms": 20.0}]
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    vllm = {"max_concurrency": 32, "request_rate": "inf", "output_throughput": 221.5, "median_ttft_ms": 4391.0,
            "median_tpot_ms": 120.7, "completed": 96}
    (tmp_path / "vllm-bf16-c32.json").write_text(json.dumps(vllm))
    assert read_results(tmp_path / "ours.json") == ours
    [got] = read_results(tmp_path / "vllm-bf16-c32.json")
    assert (got["label"], got["concurrency"], got["request_rate"], got["output_throughput"]) == \
        ("vllm-bf16", 32, math.inf, 221.5)
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="neither"):
        read_results(tmp_path / "other.json")


class _Chunks:
    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    async def aiter_bytes(self):
        for chunk in self.chunks:
            yield chunk


def test_sse_lines_break_at_line_ends_only():
    """U+2028 and U+0085 inside a JSON string are not line ends (httpx's aiter_lines took them for some), and a
    line or a UTF-8 character cut between network chunks is whole again."""
    import asyncio

    from app.benchmark.serve import sse_lines

    stream = 'data: {"text": "a\u2028b\x85c"}\r\n\r\ndata: {"text": "é"}\n\ndata: [DONE]\r'.encode()
    cut = stream.index("é".encode()) + 1  # inside the two bytes of é
    chunks = [stream[:7], stream[7:cut], stream[cut:]]

    async def collect():
        return [line async for line in sse_lines(_Chunks(chunks))]

    lines = [line for line in asyncio.run(collect()) if line]
    assert lines == ['data: {"text": "a\u2028b\x85c"}', 'data: {"text": "é"}', "data: [DONE]"]
