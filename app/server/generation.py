"""One HTTP generation request: its sequences through the engine, and their text.

A request with several prompts and n choices becomes prompts x n engine requests, run concurrently;
siblings of one prompt wait for the first to cache the prompt so they share its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from app.engine.ipc import Delta
from app.engine.output import SequenceText, TokenLogprobs
from app.engine.params import SamplingParams
from app.engine.request import FinishReason
from app.server.engine_client import ACCEPTED, EngineClient, EngineUnavailable
from app.server.metrics import Finished, Metrics
from app.server.reasoning import thinking_tokens
from app.server.router import EngineRouter

# The generations whose answers are under way (started, events not all read): server.shutdown_grace ends them
LIVE: weakref.WeakSet[Generation] = weakref.WeakSet()


@dataclass
class Sequence:
    index: int  # the choice index in the response
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: SequenceText
    engine: EngineClient  # the replica serving it (all choices of a prompt share one, and its prompt blocks)
    wait_for: str | None = None
    first_of_prompt: bool = True  # its prompt's first choice: the one that counts the prompt's tokens in the metrics
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    accepted: bool = False  # the engine queued it
    counted: bool = False  # in the metrics' finished requests
    timings: tuple[float, float] | None = None  # the engine's, with its first token (metrics.Finished.timings)


@dataclass
class Event:
    """New text (and tokens) of one choice, or its end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # with finish_reason: SequenceText.stop_reason


class ShuttingDown(EngineUnavailable):
    """server.shutdown_grace ran out while the request was still running."""


@dataclass(eq=False)  # (compared and hashed as itself: LIVE holds it)
class Generation:
    engine: EngineRouter
    metrics: Metrics
    tokenizer: object
    params: SamplingParams  # stop strings and skip_special_tokens included: the frontend applies those
    eos_token_id: int | None
    prefix: str = "cmpl"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    prompt_only: bool = False  # echo with max_tokens 0: the one token generated is not shown (nor counted)
    client_id: str | None = None  # the client's request id (vLLM's request_id, X-Request-Id): the response's id
    thinking: bool | None = None  # chat's: the prompt opened a thinking block (None: no block is split from answers)
    _interrupted: Exception | None = field(default=None, init=False, repr=False)

    def add_prompt(self, prompt_ids: list[int], n: int, max_tokens: int | None) -> None:
        """n sequences for this prompt, generating at most `max_tokens` each (ValueError if params clash)."""
        params = dataclasses.replace(self.params, max_tokens=max_tokens)
        engine = self.engine.pick(prompt_ids)
        for j in range(n):
            index = len(self.sequences)
            request_id = f"{self.prefix}-{self.id}-{index}"
            # (only the first scores the prompt, computing it whole: SamplingParams.for_choice)
            wait_for = self.sequences[index - j].request_id if j else None
            text = SequenceText.of(self.tokenizer, prompt_ids, params, self.eos_token_id)
            self.sequences.append(Sequence(index, request_id, prompt_ids, params.for_choice(j), text, engine, wait_for,
                                           first_of_prompt=j == 0))

    @property
    def response_id(self) -> str:
        return f"{self.prefix}-{self.client_id or self.id}"

    async def start(self) -> None:
        """Submit every sequence; returns once the engine queued them all (raises if one was refused)."""
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        LIVE.add(self)
        accepted = [loop.create_future() for _ in self.sequences]
        self._tasks = [asyncio.create_task(self._run(seq, fut)) for seq, fut in zip(self.sequences, accepted)]
        outcomes = await asyncio.gather(*accepted, return_exceptions=True)
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None:
            for seq in self.sequences:  # (the client sees the request refused: no abort of it in the metrics)
                seq.counted = True
            await self.cancel()
            raise failure

    async def cancel(self) -> None:
        """Stop every sequence (each aborts its engine request); those the engine had queued and not finished count
        as finished with reason "abort" in the metrics (vLLM's request_success_total{finished_reason="abort"})."""
        now = time.monotonic()  # (counted first: a cancelled caller's await below may not return)
        for seq in self.sequences:
            if seq.accepted:
                self._count(seq, "abort", now)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def events(self) -> AsyncIterator[Event]:
        """Events of all sequences as they come; leaving early cancels (and aborts) every sequence."""
        try:
            finished = 0
            while finished < len(self.sequences):
                item = self._interrupted or await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                finished += item.finish_reason is not None
        finally:
            LIVE.discard(self)
            await self.cancel()

    def interrupt(self, exc: Exception) -> None:
        """End the answer with `exc` (a stream's error event, a JSON answer's error) where events() is at; its
        sequences are then aborted as a client's that went away. It comes next, ahead of events a slow reader has not
        taken yet."""
        self._interrupted = exc
        self._queue.put_nowait(exc)  # (wakes events() if it waits)

    async def _run(self, seq: Sequence, accepted: asyncio.Future) -> None:
        failed: set[int] = set()
        while True:
            try:
                await self._stream(seq, accepted)
                return
            except EngineUnavailable as exc:
                # a replica that died before this sequence produced a token: another replica runs it from scratch
                if seq.tokens == 0 and exc.replica is not None:
                    failed.add(exc.replica)
                    try:
                        seq.engine, seq.wait_for = self.engine.pick(seq.prompt_ids, frozenset(failed)), None
                        # on its own now (its first choice may run elsewhere): it scores its prompt itself
                        seq.params = dataclasses.replace(seq.params, prompt_logprobs=self.params.prompt_logprobs)
                        continue
                    except EngineUnavailable:
                        pass
                self._fail(accepted, exc)
                return
            except Exception as exc:  # surfaced to the HTTP handler: through start() or the event queue
                self._fail(accepted, exc)
                return

    async def _stream(self, seq: Sequence, accepted: asyncio.Future) -> None:
        stream = seq.engine.generate(seq.request_id, seq.prompt_ids, seq.params, self.eos_token_id, seq.wait_for)
        async with contextlib.aclosing(stream):  # leaving early aborts the engine request right away
            async for delta in stream:
                if delta is ACCEPTED:
                    seq.accepted = True
                    if not accepted.done():
                        accepted.set_result(True)
                    continue
                event = self._event(seq, delta)
                self._queue.put_nowait(event)
                if event.finish_reason is not None:
                    return

    def _fail(self, accepted: asyncio.Future, exc: BaseException) -> None:
        if accepted.done():
            self._queue.put_nowait(exc)
        else:
            accepted.set_exception(exc)

    def _event(self, seq: Sequence, delta: Delta) -> Event:
        now = time.monotonic()
        if delta.token_id is not None:
            self._timing(seq, now)
        if delta.timings is not None:
            seq.timings = delta.timings
        text = seq.text
        if delta.prompt_logprobs is not None:  # the first choice's, every choice's (SamplingParams.for_choice)
            scored = [None if p is None else TokenLogprobs(p[0], tuple(map(tuple, p[1])), p[2])
                      for p in delta.prompt_logprobs]
            for choice in self._choices_of(seq):
                choice.text.prompt_logprobs = scored
        if delta.embedding is not None:
            text.embedding = delta.embedding
        if delta.cached_tokens is not None:
            text.cached_tokens = delta.cached_tokens
        lp = TokenLogprobs(delta.logprob, tuple(delta.top or ())) if delta.logprob is not None else None
        before_tokens, before_lp = len(text.token_ids), len(text.logprobs)
        finished = text.take(delta.token_id, lp, FinishReason(delta.finish_reason) if delta.finish_reason else None)
        reason = finished.value if finished is not None else None
        if reason is not None:
            self._count(seq, reason, now)
        return Event(seq.index, text.take_new_text(), text.token_ids[before_tokens:], text.logprobs[before_lp:],
                     reason, text.stop_reason if reason is not None else None)

    @property
    def _generates(self) -> bool:
        """Whether its tokens are output a client sees: not an embedding's one token, nor an echoed prompt's alone
        (both computed and never shown): those count no generation tokens and no token latencies."""
        return not (self.params.embed or self.prompt_only)

    def _count(self, seq: Sequence, reason: str, now: float) -> None:
        """`seq` in the metrics' finished requests, once (its prompt counted with its first choice only); an
        embedding that was not aborted as "stop" (as vLLM's pooling requests), whatever ended its hidden token."""
        if not seq.counted:
            seq.counted = True
            engine = seq.engine.replica
            if seq is self.sequences[0] and not self.params.embed:  # (vLLM's pooling requests have no such params)
                asked = 0 if self.prompt_only else seq.params.max_tokens
                self.metrics.request(engine, len(self._choices_of(seq)), asked)
            self.metrics.finished(Finished(
                "stop" if self.params.embed and reason != "abort" else reason, engine, now - self.started,
                len(seq.prompt_ids) if seq.first_of_prompt else 0, seq.tokens if self._generates else 0,
                not self.params.embed, seq.first_token_at, seq.last_token_at, seq.timings))

    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, over the request's prompts (each counted with its first choice, as
        its prompt tokens are: later choices share its blocks)."""
        return sum(s.text.cached_tokens for s in self.sequences if s.first_of_prompt)

    def reasoning_tokens(self) -> int | None:
        """Output tokens that wrote the answers' thinking blocks, every choice's (None: no block is split from them;
        reasoning.thinking_tokens)."""
        if self.thinking is None:
            return None
        return sum(thinking_tokens(s.text.text, s.text.text_ends, self.thinking) for s in self.sequences)

    def _choices_of(self, first: Sequence) -> list[Sequence]:
        """The n choices of `first`'s prompt (itself the first)."""
        choices = [first]
        for seq in self.sequences[first.index + 1:]:
            if seq.first_of_prompt:
                break
            choices.append(seq)
        return choices

    def _timing(self, seq: Sequence, now: float) -> None:
        seq.tokens += 1
        if not self._generates:
            return
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.first_token(seq.engine.replica, now - self.started)
        else:
            self.metrics.next_token(seq.engine.replica, now - seq.last_token_at)
        seq.last_token_at = now
