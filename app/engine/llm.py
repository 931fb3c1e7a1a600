"""The offline API: `LLM(spec or section overrides).generate(...)` / `.chat(...)`, in this process.

    from app import LLM, SamplingParams
    llm = LLM(model={"dtype": "float32"}, kv_cache={"memory": "1GiB"})
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from app.engine.core import EngineCore
from app.engine.model_runner import ModelRunner, TokenLogprobs
from app.engine.output import Detokenizer, SequenceText
from app.engine.params import SamplingParams
from app.engine.request import FinishReason
from app.engine.scheduler import SchedulerConfig


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


Prompt = str | Sequence[int]


class LLM:
    """One rank of the appliance in this process.

    `spec` is a YAML spec path; keyword sections override it (`model={"dtype": "float32"}`). With
    `bind_threads` (the default, as the server does) the calling thread and the OpenMP pool are pinned
    to the plan's CPUs and memory to its NUMA node; this process then sees only those CPUs.
    """

    def __init__(self, spec: str | Path | None = None, *, bind_threads: bool = True, **sections: dict):
        from app import kernels
        from app.bootstrap.preflight import check, default_search_dirs
        from app.model.footprint import read_footprint
        from app.model.loader import load_model
        from app.model.source import resolve_source, source_key
        from app.placement.plan import make_plan
        from app.spec.load import read_spec
        from app.topology.machine import read_topology

        overrides = [] if "cores" in sections else ["cores.reserve_frontend=0"]  # no HTTP frontend in-process
        overrides += [f"{key}={json.dumps(value)}" for key, value in _flatten(sections)]
        self.spec = read_spec(spec, overrides).spec
        if self.spec.parallel.tp * self.spec.parallel.dp != 1:
            raise ValueError("the offline LLM runs a single rank; tp x dp > 1 needs the server (`app serve`)")
        topo, source = read_topology("/"), resolve_source(self.spec.model)
        runtime = check(self.spec.runtime, topo.arch, {}, default_search_dirs(), "").openmp_runtime
        plan = make_plan(self.spec, topo, read_footprint(source, source_key(self.spec.model)), runtime)
        rank = plan.ranks[0]
        if bind_threads:
            kernels.bind_threads(rank.cpus, rank.memory_nodes, rank.memory_policy == "interleave")
        loaded = load_model(source, plan.dtype)
        self.tokenizer, self.chat_template = loaded.tokenizer, self._chat_template(loaded.chat_template)
        self.eos_token_id = self.tokenizer.eos_token_id
        sched = self.spec.scheduler
        runner = ModelRunner(loaded.model, rank.kv_blocks, plan.block_size, sched.max_num_batched_tokens,
                             sched.max_num_seqs, getattr(torch, plan.kv_dtype))
        cfg = SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, plan.max_model_len,
                              sched.chunked_prefill, sched.step_time_budget)
        self.core = EngineCore(runner, cfg, rank.kv_blocks, plan.block_size, sched.prefix_caching,
                               f"{source.path}:{plan.dtype}")
        self._next_id = 0

    def _chat_template(self, from_model: str | None) -> str | None:
        override = self.spec.model.chat_template
        if override and Path(override).is_file():
            return Path(override).read_text()
        return override or from_model

    # --- public API ---

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt (text or token ids) with continuous batching; outputs in input order."""
        batch = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        texts = [p if isinstance(p, str) else None for p in batch]
        ids = [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in batch]
        return self._run(texts, ids, self._params_for(params, len(batch)))

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True,
                                                    chat_template=self.chat_template) for c in conversations]
        ids = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        return self._run(texts, ids, self._params_for(params, len(texts)))

    # --- the loop ---

    def _params_for(self, params, count: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * count
        if len(params) != count:
            raise ValueError(f"{len(params)} SamplingParams for {count} prompts")
        return list(params)

    def _run(self, texts: list[str | None], ids: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        sequences: dict[str, SequenceText] = {}
        outputs = []
        try:
            for text, prompt_ids, p in zip(texts, ids, params, strict=True):
                request_id = str(self._next_id)
                self._next_id += 1
                for i in range(p.n):
                    child = f"{request_id}-{i}"
                    sequences[child] = self._add(child, prompt_ids, p, i, f"{request_id}-0" if i else None)
                outputs.append(RequestOutput(request_id, text, prompt_ids, []))
            self._loop(sequences)
        finally:  # a rejected prompt or an interrupt leaves nothing behind in the engine
            for request_id, seq in sequences.items():
                if seq.finish_reason is None:
                    self.core.abort(request_id)
        for output, p in zip(outputs, params, strict=True):
            for i in range(p.n):
                seq = sequences[f"{output.request_id}-{i}"]
                reason = seq.finish_reason.value if seq.finish_reason else None
                output.outputs.append(CompletionOutput(i, seq.text, seq.token_ids, reason, seq.logprobs or None))
        return outputs

    def _loop(self, sequences: dict[str, SequenceText]) -> None:
        while self.core.has_work():
            for delta in self.core.step():
                seq = sequences.get(delta.request_id)
                if seq is None:
                    continue
                if seq.add(delta.token_id, delta.logprobs, hidden=self._is_stop_token(delta, seq)):
                    self.core.abort(delta.request_id, FinishReason.STOP)  # a stop string matched
                elif delta.finish_reason is not None:
                    seq.finish_reason = delta.finish_reason

    def _add(self, child_id: str, prompt_ids: list[int], params: SamplingParams, index: int,
             wait_for: str | None) -> SequenceText:
        if params.seed is not None and index:
            params = replace(params, seed=params.seed + index)  # siblings sample differently, reproducibly
        self.core.add_request(child_id, prompt_ids, params, self.eos_token_id, wait_for)
        return SequenceText(Detokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens), params.stop,
                            stop_token_ids=params.stop_token_ids)

    def _is_stop_token(self, delta, seq: SequenceText) -> bool:
        """The EOS or stop token that ended a sequence stays in its token ids but not in its text."""
        return delta.finish_reason == FinishReason.STOP and (
            delta.token_id == self.eos_token_id or delta.token_id in seq.stop_token_ids)


def _flatten(sections: dict, prefix: str = "") -> list[tuple[str, object]]:
    items = []
    for key, value in sections.items():
        if isinstance(value, dict):
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _is_ids(prompt) -> bool:
    return isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(t, int) for t in prompt)
