"""The engine core: receive new and aborted requests -> schedule -> execute -> update -> emit.

It speaks token ids only (no text, no JSON), so it can run in its own process behind IPC, and it
never touches the model: its executor runs each step (in this process, or across a TP group).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from app.cache import entry_name, write_text
from app.engine.executor import Executor, ExecutorFailed
from app.engine.kv_cache import KVCacheConfig, KVCacheManager
from app.engine.output import TokenLogprobs
from app.engine.params import SamplingParams
from app.engine.request import FinishReason, Request
from app.engine.sampler import GRAMMAR_FAILED, NO_TOKEN
from app.engine.scheduler import Scheduler, SchedulerConfig
from app.engine.step_cost import StepCost


log = logging.getLogger("app.engine")


class RequestRejected(ValueError):
    """A request the engine can never run (too long for the context or the cache)."""


@dataclass(frozen=True)
class TokenDelta:
    """What one step produced for one request."""

    request_id: str
    token_id: int | None
    logprobs: TokenLogprobs | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    # SamplingParams.prompt_logprobs: with the first token, None for the prompt's first token, then one each
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # SamplingParams.embed: with the first token
    # with the first token: seconds it waited to be scheduled, then until its first token (vLLM's queue and prefill
    # times, on the engine's clock)
    timings: tuple[float, float] | None = None
    cached_tokens: int | None = None  # with the first token: Request.num_cached_tokens


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float
    prefix_hit_rate: float


class EngineCore:
    def __init__(self, executor: Executor, scheduler_cfg: SchedulerConfig, kv: KVCacheConfig, model_id: str,
                 calibration_key: dict | None = None, cache: Path | None = None):
        """`calibration_key`: what the step cost's fit depends on beyond the scheduler's shapes (model file, kernels,
        CPU, threads; app.engine.process.calibration_key); with `cache` (a folder), the fit is kept there across
        starts. Either None: it is fitted anew."""
        self.executor = executor
        self.kv = KVCacheManager(kv, model_id)
        self.cost = self._calibrate(scheduler_cfg, kv.num_blocks * kv.block_size, calibration_key, cache)
        self.scheduler = Scheduler(scheduler_cfg, self.kv, self.cost)
        self.max_model_len = scheduler_cfg.max_model_len

    def _calibrate(self, cfg: SchedulerConfig, cache_tokens: int, key: dict | None,
                   cache: Path | None) -> StepCost | None:
        """Time a few forward passes (on free blocks, before any request) to predict step times; with a `cache`, an
        earlier start's fit under `key` is checked against the first of them and kept if it agrees (app.cache)."""
        if cfg.step_time_budget <= 0 or not cfg.chunked_prefill:
            return None
        max_tokens = min(cfg.max_num_batched_tokens, cache_tokens - self.kv.block_size, cfg.max_model_len)
        entry = None  # (the passes' sizes follow from max_tokens and max_seqs: the fit is theirs)
        if key is not None and cache is not None:
            name = entry_name({**key, "max_tokens": max_tokens, "max_seqs": cfg.max_num_seqs})
            entry = cache / "calibration" / f"{name}.json"
        cached = _read_fit(entry, cfg.step_time_budget)
        cost = StepCost.calibrate(self.executor.time_forward, cfg.step_time_budget, max_tokens, cfg.max_num_seqs,
                                  cached)
        if entry is not None and not cost.from_cache:
            write_text(entry, json.dumps(cost.to_json()))
        log.info("calibrated: %s", cost.describe())
        return cost

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, eos_token_id: int | None,
                    wait_for: str | None = None) -> None:
        if request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {request_id!r} is already in the engine")
        self._check(prompt_ids, params)
        request = Request(request_id, list(prompt_ids), params, eos_token_id, time.monotonic(), wait_for)
        if params.grammar is not None:  # compiled beside the steps; the scheduler admits the request after
            request.compiling = self.executor.grammars.prepare(params.grammar, eos_token_id)
        self.scheduler.add(request)

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.executor.vocab_size
        biased = (t for t, _ in params.logit_bias)
        outside = [t for t in (*prompt_ids, *params.stop_token_ids, *biased, *params.allowed_token_ids)
                   if not 0 <= t < vocab]
        if outside:
            raise RequestRejected(f"token id {outside[0]} is outside the vocabulary (0-{vocab - 1})")
        sched = self.scheduler.cfg
        if not sched.chunked_prefill and len(prompt_ids) > sched.max_num_batched_tokens:
            raise RequestRejected(f"the prompt has {len(prompt_ids)} tokens, more than one step computes "
                                  f"({sched.max_num_batched_tokens}) with chunked prefill off")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestRejected(f"the prompt has {len(prompt_ids)} tokens; this model's context holds "
                                  f"{self.max_model_len} (prompt and output together)")
        if self.kv.blocks_needed(len(prompt_ids) + 1) > self.kv.num_blocks:
            raise RequestRejected(f"the prompt needs {self.kv.blocks_needed(len(prompt_ids) + 1)} KV blocks; the "
                                  f"cache has {self.kv.num_blocks}")

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> TokenDelta | None:
        request = self.scheduler.finish(request_id, reason)
        if request is None:
            return None
        if request.compiling is not None:  # a grammar still queued for compiling: not for a request that is gone
            request.compiling.cancel()
        return TokenDelta(request_id, None, None, reason, len(request.prompt_ids), len(request.output_ids))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenDelta]:
        failed = self._failed_grammars()
        plan = self.scheduler.schedule()
        if plan.empty:
            self._wait_for_grammars()
            return failed
        started = time.perf_counter()
        try:
            result = self.executor.execute(plan)
            elapsed = time.perf_counter() - started
            if self.cost is not None and not self._scores_prompts(plan) and not self._drafted(plan):
                self.cost.observe(plan.shape(), elapsed)
            self.scheduler.charge_grammars(plan, elapsed, result.grammar_seconds)
        except ExecutorFailed:  # no step can run any more: the engine ends (its supervisor restarts it)
            raise
        except Exception:  # a bug must not take every other request down: fail this step's requests only
            log.exception("a step failed; aborting its %d request(s)", len(plan.requests))
            aborted = (self.abort(r.request_id, FinishReason.ABORT) for r in plan.requests)
            return failed + [d for d in aborted if d is not None]
        sampled = {request_id: token for request_id, token in result.sampled.items() if token >= 0}
        now = time.monotonic()
        deltas = failed
        # a broken model's requests go before the update (their blocks never cached, nor any hash they would claim
        # from a sound request of the same prompt), a failed grammar's after it (its blocks are sound: cached)
        deltas += self._abort_unusable([r for r, token in result.sampled.items() if token == NO_TOKEN], broken=True)
        requests = self.scheduler.requests
        produced = {r: len(requests[r].output_ids) for r in sampled if r in requests}  # outputs before the step
        finished = {r.request_id: r for r in self.scheduler.update(plan, sampled, result.accepted)}
        deltas += self._abort_unusable([r for r, token in result.sampled.items() if token == GRAMMAR_FAILED])
        for request_id in sampled:
            request = finished.get(request_id) or self.scheduler.requests.get(request_id)
            if request is None or request_id not in produced:
                continue
            # its new tokens: one, or (speculative decoding) the drafts it kept and one, up to where it stopped
            new, kept = request.output_ids[produced[request_id]:], result.accepted.get(request_id, ())
            logprobs = [*(result.accepted_logprobs.get(request_id) or [None] * len(kept)),
                        result.logprobs.get(request_id)]
            first = produced[request_id] == 0 and request.scheduled is not None
            timings = (request.scheduled - request.arrival, now - request.scheduled) if first else None
            for j, token in enumerate(new):
                reason = request.finish_reason if request_id in finished and j == len(new) - 1 else None
                deltas.append(TokenDelta(request_id, token, logprobs[j], reason, len(request.prompt_ids),
                                         produced[request_id] + j + 1,
                                         result.prompt_logprobs.get(request_id) if j == 0 else None,
                                         result.embeddings.get(request_id) if j == 0 else None,
                                         timings if j == 0 else None,
                                         request.num_cached_tokens if first and j == 0 else None))
        return deltas

    def _failed_grammars(self) -> list[TokenDelta]:
        """Aborts of the waiting requests whose grammar could not be compiled (rare: the frontend checks each one
        first; the tokenizer may fail to build), before their prompts are computed for a first token none can get."""
        failed = [r for r in self.scheduler.waiting if r.grammar_state() == "failed"]
        for request in failed:
            log.warning("structured output of request %s failed before it started (%s); it is aborted",
                        request.request_id, _compile_error(request.compiling))
        return [d for r in failed if (d := self.abort(r.request_id, FinishReason.ABORT)) is not None]

    def _wait_for_grammars(self, timeout: float = 0.01) -> None:
        """Where nothing could run because requests wait for their grammars: wait for the first of them (at most
        `timeout`, so that the loop still hears of new requests and aborts), rather than spin on empty steps."""
        compiling = [r.compiling for r in self.scheduler.waiting if r.compiling is not None and not r.compiling.done()]
        if compiling:
            futures.wait(compiling, timeout, return_when=futures.FIRST_COMPLETED)

    def _scores_prompts(self, plan) -> bool:
        """Whether a step has prompt rows that also take the head's logits (prompt_logprobs): ~27% more a row than
        the step cost's fit knows, so such steps do not correct it (a steady scoring load would shrink every prompt's
        chunks)."""
        requests = self.scheduler.requests
        return any(r.prompt_rows and (q := requests.get(r.request_id)) is not None and
                   q.params.scores_prompt for r in plan.requests)

    @staticmethod
    def _drafted(plan) -> bool:
        """Whether a step has drafts (speculative decoding): rows the step cost's fit does not know (each a decode's
        and a logits row), which would shrink every prompt's chunks after a stretch of drafting."""
        return any(r.draft_ids for r in plan.requests)

    def _abort_unusable(self, request_ids: list[str], broken: bool = False) -> list[TokenDelta]:
        """Requests that got no token; the others go on. `broken`: NO_TOKEN, their logits were NaN or infinite (the
        model is at fault, not the request), and their blocks leave the prefix cache, so that no later request
        reuses the keys and values they computed; else GRAMMAR_FAILED, their structured output's grammar allows no
        further token (the sampler said why), and their blocks, sound, stay."""
        if broken and request_ids:
            log.error("no token could be sampled for request(s) %s (the model's logits were not finite numbers, NaN "
                      "or infinite: check the model file); aborting them", ", ".join(request_ids))
            for request_id in request_ids:
                if (request := self.scheduler.requests.get(request_id)) is not None:
                    self.kv.forget(request)
        return [d for request_id in request_ids if (d := self.abort(request_id, FinishReason.ABORT)) is not None]

    def close(self) -> None:
        self.executor.close()

    def stats(self) -> EngineStats:
        queries = self.kv.queries
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage(),
                           self.kv.hits / queries if queries else 0.0)


def _compile_error(compiling: futures.Future) -> str:
    if compiling.cancelled():
        return "its compilation was cancelled"
    if compiling.exception() is not None:
        return f"its compilation raised {compiling.exception()!r}"
    return compiling.result().get_error()


def _read_fit(entry: Path | None, budget: float) -> StepCost | None:
    """The fit cached at `entry`, or None (none there, or unreadable: it is made anew and written over)."""
    if entry is None:
        return None
    try:
        return StepCost.from_json(json.loads(entry.read_text()), budget)
    except Exception:  # anything in the file that is not a fit (app.cache: never an error)
        return None
