"""The scheduler: which requests run in the next step, and how many of their tokens.

One rule for prefill and decode: each request's computed tokens catch up with its tokens. A step
gives every running request what it still lacks (one token when decoding, the rest of a prompt
chunk by chunk), then admits waiting requests while the token budget and sequence limit allow.
When blocks run out, the most recently started running request is preempted: its blocks are freed
and it is recomputed later. The only output is a frozen SchedulerOutput for the model runner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from app.engine.kv_cache import KVCacheManager
from app.engine.request import FinishReason, Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill: bool = True


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]  # the tokens to compute this step
    num_computed: int  # tokens already in the cache: the first new token's position
    block_ids: tuple[int, ...]  # the request's whole block table
    sample: bool  # True when this step reaches the request's last token, so a new token is sampled


@dataclass(frozen=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager):
        self.cfg, self.kv = cfg, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they started
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- requests in and out ---

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (finished or aborted) and free its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status, request.finish_reason = Status.FINISHED, reason
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ---

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted: list[str] = []
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if count <= 0 or not self._make_room(request, count, preempted):
                continue
            chosen.append((request, count))
            budget -= count
        if not preempted:  # do not admit new work in a step that had to take blocks away
            budget = self._admit(chosen, budget)
        return SchedulerOutput(tuple(self._scheduled(r, n) for r, n in chosen), tuple(preempted))

    def _make_room(self, request: Request, count: int, preempted: list[str]) -> bool:
        """Allocate for `count` more tokens, preempting the latest started requests while needed."""
        while not self.kv.allocate(request, count):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens, request.status = 0, Status.PREEMPTED
        self.waiting.appendleft(request)

    def _admit(self, chosen: list[tuple[Request, int]], budget: int) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting.popleft()
            if request.wait_for in self.requests and self._prompt_pending(self.requests[request.wait_for]):
                skipped.append(request)  # n > 1: let the first sibling cache the prompt first
                continue
            hit = self.kv.find_prefix(request)
            count = request.num_tokens - hit.num_tokens
            if not self.cfg.chunked_prefill and count > budget:
                self.waiting.appendleft(request)
                break
            count = min(count, budget)
            if not self.kv.allocate(request, count, hit):
                self.waiting.appendleft(request)
                break
            self.kv.count_prefix(request, hit)
            request.num_computed_tokens, request.status = hit.num_tokens, Status.RUNNING
            self.running.append(request)
            chosen.append((request, count))
            budget -= count
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _prompt_pending(self, sibling: Request) -> bool:
        return sibling.status != Status.FINISHED and sibling.num_computed_tokens < len(sibling.prompt_ids)

    def _scheduled(self, request: Request, count: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request.request_id, tuple(request.token_ids(start, start + count)), start,
                                self.kv.block_ids(request.request_id), start + count == request.num_tokens)

    # --- after the step ---

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record computed tokens and sampled ones; returns the requests that finished."""
        finished = []
        for scheduled in output.requests:
            request = self.requests.get(scheduled.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += len(scheduled.token_ids)
            self.kv.cache_full_blocks(request)
            token = sampled.get(scheduled.request_id)
            if token is None:
                continue
            request.output_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                finished.append(self.finish(request.request_id, reason))
        return finished

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params, produced = request.params, len(request.output_ids)
        if produced >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and produced >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.cfg.max_model_len:
            return FinishReason.LENGTH
        return None
