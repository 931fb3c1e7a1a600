"""The scheduler: which requests run in the next step, and how many of their tokens.

One rule for prefill and decode: each request's computed tokens catch up with its tokens. A step
gives every running request what it still lacks (one token when decoding, the rest of a prompt
chunk by chunk), then admits waiting requests while the token budget and sequence limit allow.
When blocks run out, the most recently started running request is preempted: its blocks are freed
and it is recomputed later. The only output is a frozen SchedulerOutput for the model runner.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.engine.kv_cache import KVCacheManager, PrefixHit
from app.engine.params import SamplingParams
from app.engine.request import FinishReason, Request, Status
from app.engine.speculative import SpeculativeConfig
from app.engine.step_cost import MIN_CHUNK, StepCost, StepShape

# Prompt chunks get what the decodes leave of the step-time budget, and never less than this many times the
# decodes' own time. Where a step of decodes alone takes half the budget (32 streams on a 2-core Zen 1: ~0.26 s
# of 0.5), prompts had got less of the machine than 256-token prompts with 128-token answers need (~55%), so
# requests queued for their first token until the decode batch shrank: median TTFT 15.4 s under 32 streams.
# With 3x (a step at most 4x a decode step) it was 3.3 s, TPOT 347 -> 404 ms, throughput the same. Nothing
# changes where decodes are fast (on Zen 4/5, or with few streams), and a step whose decodes alone exceed the
# budget still takes new prompts.
PREFILL_PER_DECODE = 3.0
# A client request's grammar (structured outputs, forced tool calls: masks and advances, on the step's path) may
# take up to this share of the time of the steps it is in, beside other client requests; what it takes beyond that
# it waits out, twice over, while the others run on (Scheduler.charge_grammars): each other stream then keeps at
# least 1 / (1 + GRAMMAR_SHARE) of its speed, where a grammar just under the engine's limits (0.05 s a token) had
# held it to a seventh. Grammars of 0.1-20 ms a token are within their share wherever a step takes longer.
GRAMMAR_SHARE = 0.5
GRAMMAR_CREDIT = 1.0  # seconds: the most a client's waits can be shortened by time it sat out past their ends


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill: bool = True
    step_time_budget: float = 0.0  # seconds; 0: steps are bounded by tokens only
    speculative: SpeculativeConfig | None = None  # n-gram drafts for decoding sequences (None: none)


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]  # the tokens to compute this step
    num_computed: int  # tokens already in the cache: the first new token's position
    block_ids: tuple[int, ...]  # the request's whole block table
    sample: bool  # True when this step reaches the request's last token, so a new token is sampled
    prompt_rows: int = 0  # of token_ids, the leading ones that are prompt tokens (the rest: generated ones)
    draft_ids: tuple[int, ...] = ()  # of token_ids, the trailing ones that are drafts (app/engine/speculative.py)
    # of token_ids, how many trailing ones need their final hidden state: the rows sampled (the token's and the
    # drafts'), every row of a prompt whose request scores or pools it (SamplingParams.whole_prompt), none of a
    # chunk that samples nothing; None: all (ForwardBatch.hidden_rows)
    hidden_rows: int | None = None


@dataclass(frozen=True)
class NewRequest:
    """A request the model runner has not seen yet: what it needs to sample for it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_id: int | None
    compiled: Any = None  # its grammar as compiled for it (Request.compiling's result): its matcher is a copy


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything one step executes, and the only input to execution: the runner keeps no other channel."""

    requests: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    new_requests: tuple[NewRequest, ...] = ()  # scheduled for the first time in this step
    finished_ids: tuple[str, ...] = ()  # finished or aborted since the last step: the runner forgets them

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests

    def shape(self) -> StepShape:
        shape = StepShape()
        for r in self.requests:
            shape.add(r.num_computed, len(r.token_ids))
        return shape


class StepBudget:
    """What one step may still take: tokens, and time as the cost model predicts it (when there is one).

    Decodes are scheduled first and always fit. Prompt chunks then share what is left of the time
    budget, and never less than PREFILL_PER_DECODE times the decodes' time, so that new requests get in
    as fast as they come also when the decodes take much of the budget, or all of it.
    """

    def __init__(self, max_tokens: int, cost: StepCost | None):
        self.tokens_left, self.cost, self.shape = max_tokens, cost, StepShape()
        self.prefill_from: float | None = None  # predicted time of the decodes, once prompts start
        self.prefill_window = 0.0

    def fit(self, num_computed: int, wanted: int, share: float = 1.0) -> int:
        """How many of `wanted` tokens go in, using at most `share` of the time left for prompts."""
        count = min(wanted, self.tokens_left)
        if self.cost is None or count <= 1:  # a decode always fits: it is what the budget protects
            return max(count, 0)
        if self.prefill_from is None:
            self.prefill_from = self.cost.predict(self.shape)
            self.prefill_window = max(self.cost.budget - self.prefill_from, self.prefill_from * PREFILL_PER_DECODE)
        limit = self.prefill_from + share * self.prefill_window
        fits = self.cost.max_chunk(self.shape, num_computed, count, limit)
        if fits < count and fits < MIN_CHUNK:
            fits = 0 if self.shape.tokens else min(count, MIN_CHUNK)  # an empty step always makes progress
        return fits

    def take(self, num_computed: int, count: int) -> None:
        self.tokens_left -= count
        self.shape.add(num_computed, count)

    @property
    def exhausted(self) -> bool:
        if self.tokens_left <= 0:
            return True
        return self.prefill_from is not None and \
            self.cost.predict(self.shape) >= self.prefill_from + self.prefill_window


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, cost: StepCost | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg, self.kv, self.clock = cfg, kv, clock
        self.cost = cost if cfg.chunked_prefill else None  # a time budget works by chunking prompts
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they started
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding: drafts computed, and taken
        self.peak_running = 0  # the most requests running at once so far (benchmarks reset it)
        self._runner_knows: set[str] = set()  # request ids sent in a step's new_requests
        self._finished_ids: list[str] = []  # ...of those, the ones that ended since the last step
        self.held_until: dict[str, float] = {}  # client request -> when its slow grammar's wait ends (clock's time)
        self._due: dict[str, float] = {}  # ... -> when its last wait ended, until it runs again
        self.grammar_credit: dict[str, float] = {}  # ... -> seconds it sat out past its waits' ends (charge_grammars)

    # --- requests in and out ---

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
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
        if request_id in self._runner_knows:
            self._runner_knows.discard(request_id)
            self._finished_ids.append(request_id)
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ---

    def schedule(self) -> SchedulerOutput:
        """Decodes first, then prompts still being prefilled, then waiting requests, while the budget lasts.

        A prompt in progress takes at most half the step's time while others wait, so a long prompt
        cannot hold a short one back for more than a step or two.
        """
        budget = StepBudget(self.cfg.max_num_batched_tokens, self.cost)
        chosen: list[tuple[Request, int]] = []  # (request, its real tokens this step)
        preempted: list[str] = []
        held = self._held()
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if request not in self.running or request in held:  # preempted earlier in this loop, or held back
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            count = budget.fit(request.num_computed_tokens, remaining, 0.5 if self.waiting else 1.0)
            if count <= 0 or not self._make_room(request, count, preempted, chosen):
                continue
            chosen.append((request, count))
            budget.take(request.num_computed_tokens, count)
        if not preempted:  # do not admit new work in a step that had to take blocks away
            self._admit(chosen, budget)
        if not chosen:  # nothing runs: the runner hears about finished requests with the next step
            return SchedulerOutput((), tuple(preempted))
        drafts = self._drafts(chosen, budget.tokens_left) if self._speculating() else {}
        new = tuple(NewRequest(r.request_id, tuple(r.prompt_ids), r.params, r.eos_token_id, r.take_compiled())
                    for r, _ in chosen if r.request_id not in self._runner_knows)
        self._runner_knows.update(n.request_id for n in new)
        finished, self._finished_ids = tuple(self._finished_ids), []
        scheduled = tuple(self._scheduled(r, n, drafts.get(r.request_id, ())) for r, n in chosen)
        return SchedulerOutput(scheduled, tuple(preempted), new, finished)

    def _held(self) -> list[Request]:
        """The running requests whose client request waits out its grammar's time (charge_grammars), unless they are
        all that runs: a wait is for the others' sake."""
        now = self.clock()
        for client in [c for c, until in self.held_until.items() if until <= now]:
            self._due[client] = self.held_until.pop(client)  # (when its wait ended: charge_grammars credits the rest)
        if not self.held_until:
            return []
        held = [r for r in self.running if client_of(r.request_id) in self.held_until]
        return held if len(held) < len(self.running) else []

    def charge_grammars(self, output: SchedulerOutput, step_seconds: float, grammar_seconds: dict[str, float]) -> None:
        """After a step (`step_seconds` long, wall time, the grammars' time included) whose requests' grammars took
        `grammar_seconds` (request id -> CPU seconds, RunnerOutput.grammar_seconds): a client request (its prompts
        and n choices together) whose grammars took more than GRAMMAR_SHARE of the step's other time, in a step
        with other client requests, is held back for twice the excess (its sequences keep their blocks and
        state). Alone in its steps it waits for nobody; the engine's own limits (structured.py's MaskClock) still
        end a grammar that is slow outright.

        A wait lasts whole steps (a client sits out the steps that start before its wait ends): what it sat out past
        its wait's end is credit (at most GRAMMAR_CREDIT seconds), taken off its next waits, so a grammar a little
        over its share runs most steps rather than every other one."""
        now = self.clock()
        clients = {client_of(r.request_id) for r in output.requests}
        for client in clients & self._due.keys():
            late = now - step_seconds - self._due.pop(client)  # its first step after the wait started this late
            self.grammar_credit[client] = min(self.grammar_credit.get(client, 0.0) + max(late, 0.0), GRAMMAR_CREDIT)
        if not grammar_seconds or len(clients) < 2:
            return
        taken: dict[str, float] = {}
        for request_id, seconds in grammar_seconds.items():
            taken[client_of(request_id)] = taken.get(client_of(request_id), 0.0) + seconds
        allowed = GRAMMAR_SHARE * max(step_seconds - sum(grammar_seconds.values()), 0.0)
        for client, seconds in taken.items():
            if seconds > allowed:
                wait, have = (seconds - allowed) / GRAMMAR_SHARE, self.grammar_credit.get(client, 0.0)
                credit = min(wait, have)
                self.grammar_credit[client] = have - credit
                if wait > credit:
                    self.held_until[client] = now + wait - credit
        if len(self.grammar_credit) + len(self._due) > 2 * self.cfg.max_num_seqs:  # (clients gone: forgotten)
            live = {client_of(request_id) for request_id in self.requests}
            self.grammar_credit = {c: t for c, t in self.grammar_credit.items() if c in live}
            self._due = {c: t for c, t in self._due.items() if c in live}

    def _speculating(self) -> bool:
        return self.cfg.speculative is not None and len(self.running) <= self.cfg.speculative.max_batch

    def _drafts(self, chosen: list[tuple[Request, int]], tokens_left: int) -> dict[str, tuple[int, ...]]:
        """Draft tokens (app/engine/speculative.py) for the step's decoding requests (a grammar's too), once every
        real token and admission is scheduled: from the tokens the step has left and the blocks nobody holds, so
        drafts never keep another request's token out of a step nor take a block from it. Each request's within
        what it may still produce (max_tokens, the context). Their rows run as a prompt chunk's would (the step's
        time budget does not count them: drafts are few, and only where few sequences run).

        A request whose drafts all missed pauses before its next ones, 1, 2, 4 ... max_backoff steps as misses
        follow misses, and then drafts one token (a taken draft ends the pauses, and its next drafts are whole
        again): where its text stops repeating what came before, each missed draft costs a row's compute for
        nothing (on an AVX2 Zen 3, a quarter of a one-stream step of the default model, and the sampler's row)."""
        drafts = {}
        for request, count in chosen:
            params = request.params
            if tokens_left <= 0:
                break
            if count != 1 or request.num_computed_tokens + 1 != request.num_tokens or not request.output_ids:
                continue  # a prompt's chunk
            if request.draft_pause > 0:  # its last drafts all missed: it drafts again after a pause
                request.draft_pause -= 1
                continue
            # it produces the drafts it keeps and one token more, all computed in blocks it holds or free ones
            limit = min(tokens_left, self.cfg.max_model_len - request.num_tokens - 1,
                        self.kv.tokens_free(request) - 1)
            if params.max_tokens is not None:
                limit = min(limit, params.max_tokens - len(request.output_ids) - 1)
            if request.draft_backoff:  # after a pause, one draft: a probe of whether its text repeats again
                limit = min(limit, 1)
            lookup = self.cfg.speculative
            draft = lookup.propose(request.token_ids(max(request.num_tokens - lookup.max_context, 0)), limit) \
                if limit > 0 else ()
            if draft and self.kv.allocate(request, 1 + len(draft)):
                drafts[request.request_id] = draft
                tokens_left -= len(draft)
        return drafts

    def _make_room(self, request: Request, count: int, preempted: list[str],
                   chosen: list[tuple[Request, int]]) -> bool:
        """Allocate for `count` more tokens, preempting the latest started requests not already in this step (else a
        request in it would be left without its blocks) while needed."""
        while not self.kv.allocate(request, count):
            scheduled = {r.request_id for r, _ in chosen}
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)  # (request at worst)
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

    def _admit(self, chosen: list[tuple[Request, int]], budget: StepBudget) -> None:
        if len(self.waiting) > 1 and not budget.exhausted and len(self.running) < self.cfg.max_num_seqs:
            self.waiting = deque(fair_order(self.waiting))  # (only where some can be admitted: a sort a step)
        skipped: list[Request] = []
        while self.waiting and not budget.exhausted and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting.popleft()
            if request.wait_for in self.requests and self._prompt_pending(self.requests[request.wait_for]):
                skipped.append(request)  # n > 1: let the first sibling cache the prompt first
                continue
            if self.running and client_of(request.request_id) in self.held_until:
                skipped.append(request)  # its client request waits out its grammar's time (charge_grammars)
                continue
            if request.grammar_state() != "ready":
                # its grammar is still being compiled (the others go on meanwhile), or failed: the engine aborts it
                # before the next step, without computing its prompt (EngineCore._failed_grammars)
                skipped.append(request)
                continue
            # prompt logprobs need every prompt token's logits, mean pooling every one's hidden state: such a request
            # computes its prompt whole
            looked_up = not request.params.whole_prompt
            hit = self.kv.find_prefix(request) if looked_up else PrefixHit((), 0)
            wanted = request.num_tokens - hit.num_tokens
            if not self.cfg.chunked_prefill and wanted > budget.tokens_left:
                self.waiting.appendleft(request)
                break
            count = budget.fit(hit.num_tokens, wanted)
            if count <= 0 or not self.kv.allocate(request, count, hit):
                self.waiting.appendleft(request)
                break
            if looked_up:
                self.kv.count_prefix(request, hit)
            request.num_computed_tokens, request.status = hit.num_tokens, Status.RUNNING
            if request.scheduled is None:
                request.scheduled, request.num_cached_tokens = time.monotonic(), hit.num_tokens
            self.running.append(request)
            self.peak_running = max(self.peak_running, len(self.running))
            chosen.append((request, count))
            budget.take(hit.num_tokens, count)
        self.waiting.extendleft(reversed(skipped))

    def _prompt_pending(self, sibling: Request) -> bool:
        return sibling.status != Status.FINISHED and sibling.num_computed_tokens < len(sibling.prompt_ids)

    def _scheduled(self, request: Request, count: int, draft: tuple[int, ...] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        sample, prompt_rows = start + count == request.num_tokens, min(count, max(0, len(request.prompt_ids) - start))
        if prompt_rows and request.params.whole_prompt:
            hidden = count + len(draft)
        else:
            hidden = 1 + len(draft) if sample else 0
        return ScheduledRequest(request.request_id, (*request.token_ids(start, start + count), *draft), start,
                                self.kv.block_ids(request.request_id), sample, prompt_rows, draft, hidden)

    # --- after the step ---

    def update(self, output: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Record computed tokens and sampled ones (`accepted`: a drafted request's drafts the sampler took, its
        token in `sampled` coming after them); returns the requests that finished."""
        finished = []
        for scheduled in output.requests:
            request = self.requests.get(scheduled.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += len(scheduled.token_ids) - len(scheduled.draft_ids)
            token, reason = sampled.get(scheduled.request_id), None
            if scheduled.draft_ids and token is not None:
                self.num_draft_tokens += len(scheduled.draft_ids)
                # the drafts the sampler took are outputs, their K/V computed (the others' are written over later);
                # a stop among them ends the request there, the rest and the token after them dropped
                taken = accepted.get(scheduled.request_id, []) if accepted else []
                for draft in taken:
                    request.output_ids.append(draft)
                    request.num_computed_tokens += 1
                    self.num_accepted_tokens += 1
                    if (reason := self._stop_reason(request, draft)) is not None:
                        break
                backoff = 0 if taken else min(max(2 * request.draft_backoff, 1), self.cfg.speculative.max_backoff)
                request.draft_backoff = request.draft_pause = backoff
            self.kv.cache_full_blocks(request)
            if token is None:
                continue
            if reason is None:
                request.output_ids.append(token)
                reason = self._stop_reason(request, token)
            if reason is not None:
                finished.append(self.finish(request.request_id, reason))
            elif scheduled.draft_ids:
                self.kv.trim(request)  # the blocks only its rejected drafts took
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


def fair_order(waiting) -> list[Request]:
    """The waiting requests in the order they are admitted: preempted ones first (they resume), then the others
    round by round, each client request's first waiting sequence (in the order they came), then each one's second,
    and so on. A client request's sequences (its prompts, its n choices) are the engine requests whose ids differ
    only after their last "-" (the frontend's `cmpl-<id>-<index>`): one of 64 prompts of 600 tokens queued ahead of
    a short request had kept it from its first token for 32 s (2 cores); now it waits for one of them."""
    rounds: dict[str, int] = {}
    keys = []
    for position, request in enumerate(waiting):
        if request.status == Status.PREEMPTED:
            keys.append((0, 0, position))
            continue
        group = client_of(request.request_id)
        keys.append((1, rounds.get(group, 0), position))
        rounds[group] = rounds.get(group, 0) + 1
    return [request for _, request in sorted(zip(keys, waiting, strict=True), key=lambda pair: pair[0])]


def client_of(request_id: str) -> str:
    """The client request an engine request is a sequence of (one of its prompts or n choices): its id up to its
    last "-" (the frontend's `cmpl-<id>-<index>`)."""
    return request_id.rsplit("-", 1)[0]
