"""One HTTP generation request: its sequences through the engine, and their text.

A request with several prompts and n choices becomes prompts x n engine requests, run concurrently;
siblings of one prompt wait for the first to cache the prompt so they share its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from app.engine.ipc import Delta, WireParams
from app.engine.model_runner import TokenLogprobs
from app.engine.output import Detokenizer, SequenceText
from app.engine.request import FinishReason
from app.server.engine_client import EngineClient
from app.server.metrics import Metrics


@dataclass
class Sequence:
    index: int  # the choice index in the response
    request_id: str
    prompt_ids: list[int]
    params: WireParams
    text: SequenceText
    wait_for: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0


@dataclass
class Event:
    """New text (and tokens) of one choice, or its end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None


@dataclass
class Generation:
    engine: EngineClient
    metrics: Metrics
    tokenizer: object
    params: WireParams
    stops: tuple[str, ...]
    skip_special_tokens: bool
    eos_token_id: int | None
    prefix: str = "cmpl"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)

    def add_prompt(self, prompt_ids: list[int], n: int, max_tokens: int | None) -> None:
        """n sequences for this prompt, generating at most `max_tokens` each."""
        import msgspec

        params = msgspec.structs.replace(self.params, max_tokens=max_tokens)
        for j in range(n):
            index = len(self.sequences)
            request_id = f"{self.prefix}-{self.id}-{index}"
            detok = Detokenizer(self.tokenizer, prompt_ids, self.skip_special_tokens)
            wait_for = self.sequences[index - j].request_id if j else None
            text = SequenceText(detok, self.stops, stop_token_ids=tuple(self.params.stop_token_ids))
            seed = None if params.seed is None else (params.seed + index) % 2**64  # choices differ, reproducibly
            own = msgspec.structs.replace(params, seed=seed)
            self.sequences.append(Sequence(index, request_id, prompt_ids, own, text, wait_for))

    @property
    def response_id(self) -> str:
        return f"{self.prefix}-{self.id}"

    async def events(self) -> AsyncIterator[Event]:
        """Events of all sequences as they come; cancelling this cancels (and aborts) every sequence."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run(seq, queue)) for seq in self.sequences]
        try:
            for _ in range(len(tasks)):
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finish_reason is not None:
                        break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, seq: Sequence, queue: asyncio.Queue) -> None:
        stream = self.engine.generate(seq.request_id, seq.prompt_ids, seq.params, self.eos_token_id, seq.wait_for)
        try:
            async with contextlib.aclosing(stream):  # leaving early aborts the engine request right away
                async for delta in stream:
                    event = self._event(seq, delta)
                    queue.put_nowait(event)
                    if event.finish_reason is not None:
                        return
        except Exception as exc:  # surfaced to the HTTP handler through the queue
            queue.put_nowait(exc)

    def _event(self, seq: Sequence, delta: Delta) -> Event:
        now = time.monotonic()
        if delta.token_id is not None:
            self._timing(seq, now)
        text = seq.text
        lp = TokenLogprobs(delta.logprob, tuple(delta.top or ())) if delta.logprob is not None else None
        before_tokens, before_lp = len(text.token_ids), len(text.logprobs)
        hidden = delta.finish_reason == FinishReason.STOP.value and delta.token_id is not None and (
            delta.token_id == self.eos_token_id or delta.token_id in text.stop_token_ids)
        stopped = text.add(delta.token_id, lp, hidden)
        reason = "stop" if stopped else delta.finish_reason
        if reason is not None:
            text.finish_reason = text.finish_reason or FinishReason(reason)
            self.metrics.finished(reason, now - self.started, len(seq.prompt_ids), seq.tokens)
        return Event(seq.index, text.take_new_text(), text.token_ids[before_tokens:], text.logprobs[before_lp:],
                     reason)

    def _timing(self, seq: Sequence, now: float) -> None:
        seq.tokens += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.first_token(now - self.started)
        else:
            self.metrics.next_token(now - seq.last_token_at)
        seq.last_token_at = now
