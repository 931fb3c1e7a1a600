"""The model runner: turns a SchedulerOutput into the tensors the kernels need, runs the model, samples.

It owns the KV cache tensors and each running request's sampling state; the scheduler never sees
either. The SchedulerOutput is its only input: new requests arrive in it, finished ones leave in
it. Input staging buffers are allocated once at the largest step size and reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import accumulate, chain

import numpy as np
import torch

from app.engine.kv_cache import KVCacheConfig
from app.engine.resident import make_resident
from app.engine.output import TokenLogprobs
from app.engine.sampler import Sampler, SamplingState, new_state
from app.engine.scheduler import ScheduledRequest, SchedulerOutput
from app.engine.structured import Grammars
from app.model.batch import ForwardBatch
from app.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, TokenLogprobs]  # for requests that asked
    # request id -> its prompt's logprobs (SamplingState.prompt_logprobs), with its first sampled token
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    # request id -> its prompt's embedding (SamplingParams.embed), with its first sampled token
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # speculative decoding: request id -> the drafts the sampler took (its token in `sampled` comes after them),
    # and their logprobs where the request asked
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> the CPU seconds its grammar took in this step (its masks, and advancing past its tokens): the
    # scheduler holds back a client request whose grammar outlasts its share of the step (Scheduler.charge_grammars)
    grammar_seconds: dict[str, float] = field(default_factory=dict)


# Prompt rows whose logits are taken at once for prompt logprobs: [rows, vocab] float32 twice (logits, log-softmax),
# ~50 MB for a 49,152-token vocabulary
PROMPT_LOGPROB_ROWS = 128


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCacheConfig, max_num_tokens: int, max_num_seqs: int,
                 seed: int = 0, tokenizer_json: Callable[[], str] | None = None):
        """`tokenizer_json`: the model's tokenizer.json text, asked for on the first request with a grammar."""
        self.model, self.block_size = model, kv.block_size
        self.grammars = Grammars(tokenizer_json, model.cfg.vocab_size)
        self.kv_cache = model.new_kv_cache(kv.num_blocks, kv.block_size, getattr(torch, kv.dtype) if kv.dtype else None)
        make_resident(self.kv_cache)  # its pages, in idle CPU time, rather than in steps' first writes
        self.sampler = Sampler(model.cfg.vocab_size, seed)
        self.states: dict[str, SamplingState] = {}
        max_blocks = -(-model.cfg.max_position // kv.block_size)
        self._ids = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._positions = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._slots = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._tables = torch.full((max_num_seqs * max_blocks,), -1, dtype=torch.int32)  # viewed [seqs, width]
        self._lens = torch.zeros(max_num_seqs, dtype=torch.int32)
        self._starts = torch.zeros(max_num_seqs + 1, dtype=torch.int64)
        self._prompt_rows = torch.zeros(max_num_seqs, dtype=torch.int64)
        self._last_rows = torch.zeros(max_num_seqs, dtype=torch.int64)
        self._hidden_rows = torch.zeros(max_num_seqs, dtype=torch.int64)
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}  # (seqs, tokens, width) -> the batch's

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        for request_id in output.finished_ids:  # first: a finished id may come back as a new request
            self.states.pop(request_id, None)
        for new in output.new_requests:
            matcher = None if new.params.grammar is None else self.grammars.matcher(new.params.grammar,
                                                                                     new.eos_token_id, new.compiled)
            self.states[new.request_id] = new_state(new.params, list(new.prompt_ids), new.eos_token_id, matcher)
        batch, hidden = self.forward(output)
        if any(r.prompt_rows and self.states[r.request_id].prompt_logprobs is not None for r in output.requests):
            self._prompt_logprobs(output, hidden)
        if any(r.prompt_rows and self.states[r.request_id].params.whole_prompt for r in output.requests):
            self._pool(output, hidden)
        rows = [i for i, r in enumerate(output.requests) if r.sample]
        if not rows:
            return RunnerOutput({}, {})
        drafted = any(output.requests[i].draft_ids for i in rows)
        if drafted:  # a drafted request's rows: its real token's and each draft's (app/engine/speculative.py)
            spans = [len(output.requests[i].draft_ids) + 1 for i in rows]
            ends = batch.logit_indices[rows].tolist()
            last = hidden[[e - span + 1 + j for e, span in zip(ends, spans, strict=True) for j in range(span)]]
            firsts = [0, *accumulate(spans)][:-1]  # each request's real token's row of `last`
        else:
            # every scheduled request has at least one token, so as many sampled rows as tokens means a step of
            # decodes only, each sampled: hidden's rows in order, no gather (two torch ops) needed
            last = hidden if len(rows) == hidden.shape[0] else hidden[batch.logit_indices[rows]]
            firsts = range(len(rows))
        # A hidden row that is not finite (a broken model) gives NaN logits on every head, the quantized ones too
        # (native/src/act_quant.cpp: such a block's scale is NaN), and the sampler gives that row no token.
        logits = self.model.logits(last)
        states = [self.states[output.requests[i].request_id] for i in rows]
        if drafted:
            collected = self._verify([output.requests[i] for i in rows], states, logits, firsts)
        else:
            result = self.sampler(logits, states)
            collected = self._collect([output.requests[i].request_id for i in rows], states, result)
        # the prompt is whole, its first token out just now: its embedding goes with it (SamplingParams.embed), of
        # its last row here, or of what _pool kept
        embed = [k for k, state in enumerate(states) if state.params.embed and len(state.output_ids) == 1]
        if embed:
            pooled = torch.stack([_pooled(states[k], last[firsts[k]]) for k in embed])
            vectors = torch.nn.functional.normalize(pooled, dim=-1).tolist()
            for k, vector in zip(embed, vectors, strict=True):
                collected.embeddings[output.requests[rows[k]].request_id] = vector
        for i, state in zip(rows, states, strict=True):
            if state.matcher is not None and (seconds := state.mask_clock.step_seconds()) > 0:
                collected.grammar_seconds[output.requests[i].request_id] = seconds
        return collected

    def _verify(self, requests: list[ScheduledRequest], states: list[SamplingState], logits: torch.Tensor,
                firsts: list[int]) -> RunnerOutput:
        """Sample a step with drafts: each drafted request's rows as if the drafts before each were its output (its
        penalties, min_tokens and logprobs see them), then its drafts taken while each is what its row sampled, and
        the first row that differs (or the one after the last draft) gives its token. A seeded request's generator
        ends as far on as without drafts: one draw a token it keeps. A request without drafts is one row, sampled as
        in any step (drafted ones are decoding requests: never a prompt's logprobs or embedding). firsts: each
        request's first row (its real token's) of `logits`."""
        rows: list[SamplingState] = []
        for r, state in zip(requests, states, strict=True):
            rows.append(state)
            rows.extend(_ahead(state, r.draft_ids))
        # the generators of seeded, drafted requests, to be rewound to the draws of the tokens kept
        seeded = {r.request_id: s.generator.get_state() for r, s in zip(requests, states, strict=True)
                  if s.generator is not None and r.draft_ids}
        result = self.sampler(logits, rows)
        tokens = result.tokens.tolist()
        ids, token_rows = [], []
        accepted: dict[str, list[int]] = {}
        for r, state, start in zip(requests, states, firsts, strict=True):
            taken = 0
            while taken < len(r.draft_ids) and tokens[start + taken] == r.draft_ids[taken]:
                taken += 1
            if taken:
                accepted[r.request_id] = list(r.draft_ids[:taken])
            if r.request_id in seeded and not state.params.greedy:
                state.generator.set_state(seeded[r.request_id])  # one draw a token kept, as without drafts
                for _ in range(taken + 1):
                    torch.rand(1, generator=state.generator, dtype=torch.float64)
            ids.append(r.request_id)
            token_rows.append(start + taken)  # the row of the token after the drafts it kept
        last = _rows_of(result, token_rows)
        collected = self._collect(ids, states, last, accepted)
        for r, state, first in zip(requests, states, firsts, strict=True):  # the kept drafts' logprobs
            k = state.params.logprobs
            if r.request_id in accepted and k is not None:
                collected.accepted_logprobs[r.request_id] = [
                    _token_logprobs(result, first + j, k) for j in range(len(accepted[r.request_id]))]
        return collected

    def _prompt_logprobs(self, output: SchedulerOutput, hidden: torch.Tensor) -> None:
        """For the requests that asked: the logprob of each prompt token after this step's prompt rows (row j of a
        request holds position num_computed + j, whose logits are those of the next prompt token), kept in its
        state. The model's own (raw) log-probabilities, as the sampled tokens' logprobs."""
        start = 0
        for r in output.requests:
            row, start = start, start + len(r.token_ids)
            state = self.states[r.request_id]
            if state.prompt_logprobs is None:
                continue
            first = max(state.prompt_done - r.num_computed, 0)  # positions read before a preemption
            end = min(r.prompt_rows, len(state.prompt_ids) - 1 - r.num_computed)  # the last position has no next
            k = state.params.prompt_logprobs
            for a in range(first, end, PROMPT_LOGPROB_ROWS):
                b = min(a + PROMPT_LOGPROB_ROWS, end)
                logprobs = self.model.logits(hidden[row + a: row + b]).log_softmax(dim=-1)
                targets = torch.tensor(state.prompt_ids[r.num_computed + a + 1: r.num_computed + b + 1])
                chosen = logprobs.gather(1, targets.unsqueeze(1))
                ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
                if k:
                    values, ids = logprobs.topk(k, dim=-1)
                    tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
                else:
                    tops = [()] * len(ranks)
                state.prompt_logprobs.extend(map(TokenLogprobs, chosen.squeeze(1).tolist(), tops, ranks))
            state.prompt_done = max(state.prompt_done, r.num_computed + end)

    def _pool(self, output: SchedulerOutput, hidden: torch.Tensor) -> None:
        """For embeddings pooled over the prompt ("mean", "cls"): this step's prompt rows added to the request's
        float32 sum (its first row kept, for "cls"), each prompt position once, through chunks and preemptions."""
        start = 0
        for r in output.requests:
            row, start = start, start + len(r.token_ids)
            state = self.states[r.request_id]
            if not (state.params.embed and state.params.pooling != "last"):
                continue
            first = max(state.pooled_done - r.num_computed, 0)  # positions read before a preemption
            if first >= r.prompt_rows:
                continue
            rows = hidden[row + first: row + r.prompt_rows].float()
            if state.params.pooling == "mean":
                state.pooled = rows.sum(dim=0) if state.pooled is None else state.pooled.add_(rows.sum(dim=0))
            elif r.num_computed + first == 0:  # "cls": the first position's
                state.pooled = rows[0].clone()
            state.pooled_done = r.num_computed + r.prompt_rows

    @torch.inference_mode()
    def forward(self, output: SchedulerOutput) -> tuple[ForwardBatch, torch.Tensor]:
        """The forward pass alone (what TP ranks other than 0 run): writes K/V, returns the hidden states."""
        batch, ids = self._prepare(output)
        return batch, self.model.forward(ids, batch, self.kv_cache)

    @torch.inference_mode()
    def time_forward(self, count: int, num_computed: int, decodes: bool = False) -> None:
        """A forward pass of `count` dummy tokens after `num_computed` (for calibration, on free blocks); or
        with `decodes`, of `count` sequences of one token each, sequence i after i cached tokens, and their
        logits: a decode's time includes the head's row (a fifth to a third of it for the default model)."""
        batch, hidden = self.forward(calibration_step(count, num_computed, self.block_size, decodes))
        if decodes:
            self.model.logits(hidden[batch.logit_indices])

    def _prepare(self, output: SchedulerOutput) -> tuple[ForwardBatch, torch.Tensor]:
        # Fill the staging buffers (token ids, positions, cache slots, block tables, lengths, offsets) in one
        # vectorised pass through numpy views of them: per request, a handful of small torch ops had cost
        # ~0.8 ms of a 32-sequence decode step (Zen 5; 42 us now).
        requests, seqs = output.requests, len(output.requests)
        counts = np.fromiter((len(r.token_ids) for r in requests), np.int64, seqs)  # [S] new tokens
        computed = np.fromiter((r.num_computed for r in requests), np.int64, seqs)  # [S] tokens cached before
        widths = np.fromiter((len(r.block_ids) for r in requests), np.int64, seqs)  # [S] blocks
        if (widths * self.block_size < computed + counts).any():  # else a token would find a padding -1 as its block
            raise ValueError("a scheduled request's block table does not cover its tokens")
        t, width = int(counts.sum()), int(widths.max())
        starts = self._starts.numpy()[: seqs + 1]
        starts[0] = 0
        np.cumsum(counts, out=starts[1:])
        tables = self._tables.numpy()[: seqs * width].reshape(seqs, width)
        tables.fill(-1)
        tables[np.arange(width) < widths[:, None]] = np.fromiter(chain.from_iterable(r.block_ids for r in requests),
                                                                  np.int32, int(widths.sum()))
        positions = self._positions.numpy()[:t]
        positions[:] = np.arange(t) - np.repeat(starts[:-1] - computed, counts)  # [T]
        owner = np.repeat(np.arange(seqs), counts)  # [T] each token's row of the step
        blocks = tables[owner, positions // self.block_size].astype(np.int64)
        self._slots.numpy()[:t] = blocks * self.block_size + positions % self.block_size
        self._ids.numpy()[:t] = np.fromiter(chain.from_iterable(r.token_ids for r in requests), np.int64, t)
        self._lens.numpy()[:seqs] = computed + counts
        self._prompt_rows.numpy()[:seqs] = np.fromiter((r.prompt_rows for r in requests), np.int64, seqs)
        np.subtract(starts[1:], 1, out=self._last_rows.numpy()[:seqs])
        self._hidden_rows.numpy()[:seqs] = np.fromiter((len(r.token_ids) if r.hidden_rows is None else r.hidden_rows
                                                        for r in requests), np.int64, seqs)
        # The buffers' views for this shape, made once (up to 512 shapes): seven slices and a subtraction in torch
        # were ~0.05 ms of a batch-1 decode step's ~0.25 ms here (Zen 4).
        views = self._views.get((seqs, t, width))
        if views is None:
            if len(self._views) >= 512:
                self._views.clear()
            views = self._views[(seqs, t, width)] = (
                self._positions[:t], self._slots[:t], self._tables[: seqs * width].view(seqs, width), self._lens[:seqs],
                self._starts[: seqs + 1], self._last_rows[:seqs], self._prompt_rows[:seqs], self._hidden_rows[:seqs],
                self._ids[:t])
        return ForwardBatch(*views[:-1]), views[-1]

    def _collect(self, request_ids: list[str], states: list[SamplingState], result,
                 accepted: dict[str, list[int]] | None = None) -> RunnerOutput:
        tokens = result.tokens.tolist()
        sampled = dict(zip(request_ids, tokens, strict=True))
        logprobs, prompt_logprobs = {}, {}
        for row, (request_id, state) in enumerate(zip(request_ids, states, strict=True)):
            if tokens[row] < 0:  # NO_TOKEN: the engine aborts the request
                continue
            if state.prompt_logprobs is not None:  # the prompt is whole: its logprobs go out with this token
                prompt_logprobs[request_id], state.prompt_logprobs = state.prompt_logprobs, None
            for token in (*(accepted or {}).get(request_id, ()), tokens[row]):  # drafts it kept, then its token
                state.output_ids.append(token)
                if state.matcher is not None and token not in state.params.stop_token_ids:
                    # (a token the mask allowed; else the next step fails it). A stop token ends the sequence as EOS
                    # does; the grammar, which allowed it only where it allows EOS, never sees it.
                    started = time.thread_time()
                    state.matcher.consume_token(token)
                    state.mask_clock.spent(time.thread_time() - started)
            k = state.params.logprobs
            if k is not None:
                logprobs[request_id] = _token_logprobs(result, row, k)
        return RunnerOutput(sampled, logprobs, prompt_logprobs, accepted=accepted or {})


def _token_logprobs(result, row: int, k: int) -> TokenLogprobs:
    """Row `row`'s sampled token's logprob and its k most likely tokens' (a SampleOutput with logprobs)."""
    top = tuple(zip(result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist())) if k else ()
    return TokenLogprobs(float(result.logprobs[row]), top)


def _rows_of(result, rows: list[int]):
    """A SampleOutput of these rows of `result`."""
    pick = (lambda x: None if x is None else x[rows])
    return replace(result, tokens=result.tokens[rows], logprobs=pick(result.logprobs), top_ids=pick(result.top_ids),
                   top_logprobs=pick(result.top_logprobs))


def _ahead(state: SamplingState, drafts: tuple[int, ...]) -> list[SamplingState]:
    """`state` as it would be with drafts[:j] sampled after its output, for j = 1 .. len(drafts): what draft j's row
    is sampled with. Penalty counts are each row's own copy; the generator is the request's (the runner rewinds it
    to the draws kept); a grammar's matcher a copy advanced by the drafts before the row. Where a draft is one the
    grammar does not allow (or a stop token, which it never sees), the rows after it keep the matcher before it:
    the row before it cannot sample it, so none of them is ever kept."""
    rows, matcher = [], state.matcher
    for j in range(1, len(drafts) + 1):
        token = drafts[j - 1]
        if matcher is not None and token not in state.params.stop_token_ids and not matcher.is_error() and \
                matcher.validate_tokens([token]) == 1:
            matcher = matcher.deep_copy()
            matcher.consume_token(token)
        rows.append(replace(state, output_ids=state.output_ids + list(drafts[:j]),
                            output_counts=dict(state.output_counts), matcher=matcher))
    return rows


def _pooled(state: SamplingState, last: torch.Tensor) -> torch.Tensor:
    """A finished prompt's embedding before its norm: its last row (`last`), or the mean or first row _pool kept."""
    if state.params.pooling == "mean":
        return state.pooled / len(state.prompt_ids)
    if state.params.pooling == "cls":
        return state.pooled
    return last.float()


def calibration_step(count: int, num_computed: int, block_size: int, decodes: bool = False) -> SchedulerOutput:
    """A step of `count` dummy tokens after `num_computed`, on the first free blocks (before any request); with
    `decodes`, `count` sequences of one token, sequence i after i cached tokens (the same blocks: token i of
    each sequence lands in slot i, as a prompt's would)."""
    if decodes:
        return SchedulerOutput(tuple(ScheduledRequest(f"calibration-{i}", (0,), i, tuple(range(i // block_size + 1)),
                                                      sample=False) for i in range(count)))
    blocks = tuple(range(-(-(num_computed + count) // block_size)))
    return SchedulerOutput((ScheduledRequest("calibration", (0,) * count, num_computed, blocks, sample=False,
                                             prompt_rows=count, hidden_rows=1),))  # (a served prompt's last chunk)
