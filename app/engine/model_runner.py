"""The model runner: turns a SchedulerOutput into the tensors the kernels need, runs the model, samples.

It owns the KV cache tensors and each running request's sampling state; the scheduler never sees
either. Input staging buffers are allocated once at the largest step size and reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.params import SamplingParams
from app.engine.sampler import Sampler, SamplingState, new_state
from app.engine.scheduler import ScheduledRequest, SchedulerOutput
from app.model.batch import ForwardBatch
from app.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, TokenLogprobs]  # for requests that asked


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, max_num_tokens: int,
                 max_num_seqs: int, kv_dtype: torch.dtype | None = None, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.kv_cache = model.new_kv_cache(num_blocks, block_size, kv_dtype)
        self.sampler = Sampler(model.cfg.vocab_size, seed)
        self.states: dict[str, SamplingState] = {}
        max_blocks = -(-model.cfg.max_position // block_size)
        self._ids = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._positions = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._slots = torch.zeros(max_num_tokens, dtype=torch.int64)
        self._tables = torch.full((max_num_seqs * max_blocks,), -1, dtype=torch.int32)  # viewed [seqs, width]
        self._lens = torch.zeros(max_num_seqs, dtype=torch.int32)
        self._starts = torch.zeros(max_num_seqs + 1, dtype=torch.int64)

    # --- sampling state follows the requests ---

    def add_request(self, request_id: str, params: SamplingParams, prompt_ids: list[int], eos: int | None) -> None:
        self.states[request_id] = new_state(params, prompt_ids, eos)

    def remove_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    # --- one step ---

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        batch, ids, wanted = self._prepare(output)
        hidden = self.model.forward(ids, batch, self.kv_cache)
        rows = [i for i, r in enumerate(output.requests) if r.sample]
        if not rows:
            return RunnerOutput({}, {})
        logits = self.model.logits(hidden[batch.logit_indices[rows]])
        states = [self.states[output.requests[i].request_id] for i in rows]
        result = self.sampler(logits, states)
        return self._collect([output.requests[i].request_id for i in rows], states, result)

    def time_forward(self, count: int, num_computed: int) -> None:
        """A forward pass of `count` dummy tokens after `num_computed` (for calibration, on free blocks)."""
        blocks = tuple(range(-(-(num_computed + count) // self.block_size)))
        step = ScheduledRequest("calibration", (0,) * count, num_computed, blocks, sample=False)
        self.execute(SchedulerOutput((step,)))

    def _prepare(self, output: SchedulerOutput) -> tuple[ForwardBatch, torch.Tensor, int]:
        # Fill the staging buffers: token ids, positions, cache slots, block tables, lengths, offsets.
        t = s = 0
        width = max(len(r.block_ids) for r in output.requests)
        tables = self._tables[: len(output.requests) * width].view(len(output.requests), width)
        tables.fill_(-1)
        for s, r in enumerate(output.requests):
            n = len(r.token_ids)
            positions = torch.arange(r.num_computed, r.num_computed + n)
            blocks = torch.tensor(r.block_ids, dtype=torch.int64)
            self._ids[t:t + n] = torch.tensor(r.token_ids)
            self._positions[t:t + n] = positions
            self._slots[t:t + n] = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
            tables[s, : len(r.block_ids)] = blocks.to(torch.int32)
            self._lens[s] = r.num_computed + n
            t += n
            self._starts[s + 1] = t
        seqs = len(output.requests)
        starts = self._starts[: seqs + 1]
        batch = ForwardBatch(self._positions[:t], self._slots[:t], tables, self._lens[:seqs], starts, starts[1:] - 1)
        return batch, self._ids[:t], t

    def _collect(self, request_ids: list[str], states: list[SamplingState], result) -> RunnerOutput:
        tokens = result.tokens.tolist()
        sampled = dict(zip(request_ids, tokens, strict=True))
        logprobs = {}
        for row, (request_id, state) in enumerate(zip(request_ids, states, strict=True)):
            state.output_ids.append(tokens[row])
            k = state.params.logprobs
            if k is not None:
                top = tuple(zip(result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist())) if k else ()
                logprobs[request_id] = TokenLogprobs(float(result.logprobs[row]), top)
        return RunnerOutput(sampled, logprobs)
