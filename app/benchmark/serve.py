"""A load generator for any OpenAI-compatible server: `python -m app bench serve`.

It streams `/v1/completions` requests (ours, vLLM's or llama-server's) at a fixed concurrency or a
Poisson request rate, and reports what `vllm bench serve` reports: request, output and total token
throughput, and TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), in milliseconds.

Prompts are random token ids (exact input lengths without a tokenizer on the client; every server
here accepts a list of ids as `prompt`) or come from a JSONL file of `{"prompt": "..."}` lines.
Requests ask for `ignore_eos`, so each generates exactly `--output-len` tokens on servers that honour
it. The arithmetic (`summarize`) is a pure function of the recorded traces, tested on synthetic ones.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Trace:
    """One request as the client saw it: when it was sent and when each streamed token arrived."""

    prompt_tokens: int
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    output_tokens: int = 0  # from the final usage when the server reports it, else chunks with text
    end: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 32
    concurrency: int | None = 1  # None: unbounded (then request_rate paces the arrivals)
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at once
    warmup: int = 1
    seed: int = 0
    temperature: float = 0.0  # 0: greedy, as the anchors' runs; 1 is OpenAI's default


# --- the arithmetic ---

def percentiles(values: list[float], prefix: str) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds (linear interpolation between order statistics, as numpy's default)."""
    if not values:
        return {f"{kind}_{prefix}_ms": 0.0 for kind in ("mean", "median", "p90", "p99")}
    ordered = sorted(values)

    def pct(q: float) -> float:
        position = (len(ordered) - 1) * q / 100
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {f"mean_{prefix}_ms": 1e3 * statistics.fmean(ordered), f"median_{prefix}_ms": 1e3 * pct(50),
            f"p90_{prefix}_ms": 1e3 * pct(90), f"p99_{prefix}_ms": 1e3 * pct(99)}


def summarize(traces: list[Trace], duration: float) -> dict[str, float]:
    """vLLM's definitions: TTFT = first token - send; TPOT = (end - first token) / (output tokens - 1) per
    request with more than one token; ITL = every gap between consecutive chunks; E2EL = end - send."""
    done = [t for t in traces if t.error is None]
    ttft = [t.token_times[0] - t.start for t in done if t.token_times]
    tpot = [(t.end - t.token_times[0]) / (t.output_tokens - 1) for t in done if t.token_times and t.output_tokens > 1]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    e2el = [t.end - t.start for t in done]
    output = sum(t.output_tokens for t in done)
    prompt = sum(t.prompt_tokens for t in done)
    return {"completed": len(done), "failed": len(traces) - len(done), "duration_s": duration,
            "total_input_tokens": prompt, "total_output_tokens": output,
            "request_throughput": len(done) / duration if duration > 0 else 0.0,
            "output_throughput": output / duration if duration > 0 else 0.0,
            "total_token_throughput": (prompt + output) / duration if duration > 0 else 0.0,
            **percentiles(ttft, "ttft"), **percentiles(tpot, "tpot"), **percentiles(itl, "itl"),
            **percentiles(e2el, "e2el")}


# --- the prompts ---

def random_prompts(count: int, length: int, seed: int | str, low: int = 1000,
                   high: int = 30000) -> list[list[int]]:
    """Token ids drawn uniformly from [low, high): ordinary vocabulary of any tokenizer with 30k+ entries,
    clear of special tokens (which sit at the start or end of the vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


def file_prompts(path: Path, count: int, start: int = 0) -> list[str]:
    lines = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no {{\"prompt\": ...}} lines")
    return [lines[(start + i) % len(lines)] for i in range(count)]


def level_prompts(w: Workload, level: int, prompts_file: Path | None = None) -> list:
    """The prompts of the `level`-th workload of a run: warm-up ones first, then the measured ones. Each
    level gets its own (an earlier level's prompts would hit the server's prefix cache and flatter TTFT),
    the same on every server given the same seed, so two servers are compared on the same requests."""
    count = w.num_prompts + w.warmup
    if prompts_file:
        return file_prompts(prompts_file, count, start=level * count)
    return random_prompts(count, w.input_len, f"{w.seed}:{level}")


# --- the client ---

async def sse_lines(response):
    """The lines of a server-sent event stream: ended by LF, CRLF or CR only, as the SSE spec says (httpx's
    aiter_lines also breaks at U+2028, U+0085 and others, which a server may send raw inside a JSON string)."""
    pending = b""
    async for data in response.aiter_bytes():
        lines = (pending + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line.decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


async def _one(client, url: str, model: str, prompt, output_len: int, trace: Trace, temperature: float = 0.0) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    trace.start = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                trace.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    trace.error = str(event["error"])[:200]
                    return
                if any(c.get("text") for c in event.get("choices") or []):
                    trace.token_times.append(time.perf_counter())
                    chunks += 1
                usage = event.get("usage")
                if usage and usage.get("completion_tokens"):
                    trace.output_tokens = usage["completion_tokens"]
                    trace.prompt_tokens = usage.get("prompt_tokens") or trace.prompt_tokens
        trace.end = time.perf_counter()
        trace.output_tokens = trace.output_tokens or chunks
        if not trace.token_times:
            trace.error = "no token was streamed"
    except Exception as exc:  # a refused connection or a cut stream is a failed request, not a crash
        trace.error = f"{type(exc).__name__}: {exc}"


async def _run(base_url: str, model: str, prompts: list, w: Workload, api_key: str | None, progress) -> dict:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(w.concurrency or len(prompts), 1) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits, headers=headers) as client:
        for prompt in prompts[:w.warmup]:  # warm-up: not measured (first-call allocations, caches)
            await _one(client, url, model, prompt, min(w.output_len, 16), Trace(0), w.temperature)
        measured = prompts[w.warmup:]
        traces = [Trace(len(p) if isinstance(p, list) else 0) for p in measured]
        gate = asyncio.Semaphore(w.concurrency) if w.concurrency else None
        rng = random.Random(w.seed + 1)

        async def send(prompt, trace: Trace) -> None:
            if gate is None:
                await _one(client, url, model, prompt, w.output_len, trace, w.temperature)
            else:
                async with gate:
                    await _one(client, url, model, prompt, w.output_len, trace, w.temperature)
            progress.update(1)

        started = time.perf_counter()
        tasks = []
        for prompt, trace in zip(measured, traces):
            tasks.append(asyncio.create_task(send(prompt, trace)))
            if math.isfinite(w.request_rate):
                await asyncio.sleep(rng.expovariate(w.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return {**summarize(traces, duration), "errors": sorted({t.error for t in traces if t.error})[:5]}


def run(base_url: str, model: str, workloads: list[Workload], label: str, api_key: str | None = None,
        prompts_file: Path | None = None) -> list[dict]:
    from tqdm import tqdm

    results = []
    for level, w in enumerate(workloads):
        prompts = level_prompts(w, level, prompts_file)
        what = f"{label}: concurrency {w.concurrency or 'unbounded'}" + \
               (f", {w.request_rate:g} req/s" if math.isfinite(w.request_rate) else "")
        with tqdm(total=w.num_prompts, desc=what, unit="req", file=sys.stderr) as progress:
            summary = asyncio.run(_run(base_url, model, prompts, w, api_key, progress))
        result = {"label": label, "base_url": base_url, "model": model,
                  **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(w).items()},
                  **summary}
        results.append(result)
        print(_line(result), file=sys.stderr)
    return results


def _line(r: dict) -> str:
    return (f"  {r['completed']}/{r['completed'] + r['failed']} ok in {r['duration_s']:.1f} s: "
            f"{r['output_throughput']:.1f} output tok/s, {r['total_token_throughput']:.1f} total tok/s; "
            f"TTFT median {r['median_ttft_ms']:.0f} ms, TPOT median {r['median_tpot_ms']:.1f} ms, "
            f"ITL median {r['median_itl_ms']:.1f} ms, E2EL median {r['median_e2el_ms']:.0f} ms")


# --- the picture ---

def read_results(path: Path) -> list[dict]:
    """Results from a `bench serve --json` file (a list), or from one `vllm bench serve --save-result` file (an
    object: labelled by its file name up to the last "-", as ../shared/anchors/serve_bench.py names them)."""
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return data
    if "output_throughput" not in data or "median_ttft_ms" not in data:
        raise ValueError(f"{path}: neither a bench serve result list nor a vllm bench serve result")
    rate = data.get("request_rate", "inf")
    return [{**data, "label": path.stem.rsplit("-", 1)[0], "concurrency": data.get("max_concurrency") or 0,
             "request_rate": float(rate) if rate not in (None, "inf") else float("inf")}]


def require_matplotlib() -> None:
    """A clear exit where the plots' library is missing (checked before a benchmark runs, not after)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("a plot needs matplotlib: pip install 'llm-appliance[bench]' (from the repository: "
                         "pip install -e '.[bench]')") from None


def plot(results: list[dict], path: Path, title: str = "") -> None:
    """Median TPOT and TTFT against output throughput, one line per server (label), one point per
    concurrency level: down and to the right is better."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    labels = list(dict.fromkeys(r["label"] for r in results))
    for label in labels:
        runs = sorted((r for r in results if r["label"] == label), key=lambda r: r["output_throughput"])
        x = [r["output_throughput"] for r in runs]
        for ax, key in zip(axes, ("median_tpot_ms", "median_ttft_ms")):
            ax.plot(x, [r[key] for r in runs], marker="o", label=label)
            for r in runs:
                ax.annotate(f"c{r['concurrency']}" if r["concurrency"] else f"{r['request_rate']} r/s",
                            (r["output_throughput"], r[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for ax, name in zip(axes, ("median time per output token (ms)", "median time to first token (ms)")):
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
