"""Many clients at once: no cross-talk, nothing lost, disconnects free their KV blocks, overload is refused."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from app import LLM, SamplingParams
from tests.server.conftest import BASE_SPEC, Appliance

PROMPTS = [f"Write the number {i} in words, then name a fruit that starts with the letter {chr(65 + i % 26)}:"
           for i in range(32)]


@pytest.fixture(scope="module")
def llm():
    return LLM(model={"dtype": "float32"}, kv_cache={"memory": "512MiB"}, bind_threads=False)


@pytest.fixture(scope="module")
def offline(llm):
    """Each prompt alone, through the offline engine."""
    greedy = SamplingParams(temperature=0, max_tokens=16)
    return [llm.generate(p, greedy)[0].outputs[0].text for p in PROMPTS]


def test_32_concurrent_streams_each_get_their_offline_greedy_text(appliance, offline):
    client = openai.AsyncOpenAI(base_url=appliance.url + "/v1", api_key="x", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(run()) == offline


def test_seeded_choices_are_the_same_offline_and_served(appliance, llm):
    """n choices of several prompts: choice i of every prompt samples with seed + i, in both APIs."""
    prompts = PROMPTS[:2]
    params = SamplingParams(n=3, temperature=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    offline = [[c.text for c in out.outputs] for out in llm.generate(prompts, params)]
    client = openai.OpenAI(base_url=appliance.url + "/v1", api_key="x", max_retries=0)
    served = client.completions.create(model="smollm2", prompt=prompts, n=3, temperature=0.9, seed=1234, max_tokens=8,
                                       extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(served.choices, key=lambda c: c.index)]
    assert [texts[:3], texts[3:]] == offline
    assert len(set(offline[0])) > 1  # the choices differ


def _settled(appliance, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if appliance.metric("appliance:kv_cache_blocks_in_use") == 0 and \
                appliance.metric("vllm:num_requests_running") == 0:
            return
        time.sleep(0.3)
    raise AssertionError("KV blocks still in use after every client left")


def test_100_clients_that_disconnect_leave_no_blocks_behind(appliance):
    rng = random.Random(0)

    async def leave_early(i: int) -> None:
        body = {"model": "smollm2", "prompt": PROMPTS[i % 32] * (1 + i % 3), "max_tokens": 200,
                "ignore_eos": True, "stream": i % 4 != 0}
        async with httpx.AsyncClient(timeout=60) as http:
            try:
                if body["stream"]:
                    async with http.stream("POST", appliance.url + "/v1/completions", json=body) as response:
                        wanted = rng.randint(0, 6)
                        async for _ in response.aiter_lines():
                            wanted -= 1
                            if wanted < 0:
                                break  # hang up mid-stream
                else:
                    await asyncio.wait_for(http.post(appliance.url + "/v1/completions", json=body),
                                           timeout=rng.uniform(0.05, 1.5))
            except (asyncio.TimeoutError, httpx.HTTPError):
                pass

    async def run():
        await asyncio.gather(*(leave_early(i) for i in range(100)))

    asyncio.run(run())
    _settled(appliance)
    assert httpx.get(appliance.url + "/health").status_code == 200
    ok = httpx.post(appliance.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_overload_past_the_queue_gets_429_not_a_crash(tmp_path):
    app = Appliance(tmp_path, BASE_SPEC, ("scheduler.max_num_seqs=2", "scheduler.max_num_batched_tokens=64",
                                          "scheduler.max_waiting_requests=2")).wait_ready()
    try:
        async def one(http: httpx.AsyncClient, stream: bool) -> tuple[int, dict, bytes]:
            body = {"prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True, "stream": stream}
            async with http.stream("POST", app.url + "/v1/completions", json=body) as response:
                return response.status_code, dict(response.headers), await response.aread()

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(one(http, i % 2 == 1) for i in range(20)))

        responses = asyncio.run(run())
        codes = [code for code, _, _ in responses]
        # two fit the waiting queue at once; what arrives while it is full is refused
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        refused = [(h, b) for code, h, b in responses if code == 429]
        assert all(h["retry-after"] == "1" and b'"rate_limit_error"' in b for h, b in refused)
        streamed_refusals = [i for i, (code, _, _) in enumerate(responses) if code == 429 and i % 2 == 1]
        assert streamed_refusals, "a streaming request must get the 429 status too, not a 200 with an error event"
        assert httpx.get(app.url + "/health").status_code == 200
    finally:
        assert app.stop() == 0
