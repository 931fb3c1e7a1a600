"""A request as the engine core sees it: token ids in, token ids out, and how far its KV is computed."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from app.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again: its blocks were taken, its KV is recomputed when it resumes
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context is full
    ABORT = "abort"  # the client went away, or the engine gave up on it


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    arrival: float = 0.0
    wait_for: str | None = None  # n > 1: start after this sibling's prompt is cached, to share its blocks
    compiling: Future | None = None  # its grammar's compilation (structured outputs): admitted once it is done
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # speculative decoding: steps to go without drafts, and how many the next miss sets (app/engine/scheduler.py)
    draft_pause: int = 0
    draft_backoff: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    scheduled: float | None = None  # when a step first took it in (time.monotonic(), as `arrival`)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when a step first took it in (vLLM's)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        prompt = len(self.prompt_ids)
        end = self.num_tokens if end is None else end
        if end <= prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - prompt, 0):end - prompt]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def grammar_state(self) -> str:
        """"ready" (no grammar, or it is compiled), "pending" (being compiled) or "failed" (it could not be: its
        matcher is in llguidance's error state, or the compilation was cancelled or raised)."""
        if self.compiling is None:
            return "ready"
        if not self.compiling.done():
            return "pending"
        if self.compiling.cancelled() or self.compiling.exception() is not None:
            return "failed"
        compiled = self.compiling.result()
        return "failed" if compiled is not None and compiled.is_error() else "ready"

    def take_compiled(self):
        """The grammar compiled for this request, once, for the runner (it keeps it from then on; None: none, or the
        runner is to compile it); the request no longer holds it."""
        compiled = self.compiling.result() if self.grammar_state() == "ready" and self.compiling is not None else None
        self.compiling = None
        return compiled
