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

import numpy as np

from app.engine.output import SequenceText, TokenLogprobs
from app.engine.params import SamplingParams
from app.engine.request import FinishReason
from app.model.source import ModelSource
from app.model.tokenizer import end_token_ids


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string matched, or the stop token id (not EOS) that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # SamplingParams.prompt_logprobs: None for the first prompt token, then each next one's given those before it
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # SamplingParams.embed: the prompt's embedding
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's)


Prompt = str | Sequence[int]


class LLM:
    """One rank of the appliance in this process.

    `spec` is a YAML spec path; keyword sections override it (`model={"dtype": "float32"}`). With
    `parallel={"tp": 2}` the model is split over this process (rank 0) and tp - 1 worker processes. With
    `bind_threads` (the default, as the server does) the calling thread and the OpenMP pool are pinned
    to the plan's CPUs and memory to its NUMA node; this process then sees only those CPUs.
    """

    def __init__(self, spec: str | Path | None = None, *, bind_threads: bool = True, **sections: dict):
        from app.bootstrap.startup import prepare
        from app.engine.process import build_core

        overrides = [] if "cores" in sections else ["cores.reserve_frontend=0"]  # no HTTP frontend in-process
        overrides += [f"{key}={json.dumps(value)}" for key, value in _flatten(sections)]
        deployment = prepare(spec, overrides)
        self.spec = deployment.spec
        self.dtype = deployment.plan.dtype  # the compute dtype the spec's "auto" resolved to on this machine
        self.pooling = deployment.pooling()  # how embed pools (model.pooling, "auto" resolved for the model)
        defaults = deployment.sampling_defaults[0]  # the model's (generation_config.json, GGUF) and the spec's
        self.default_params = SamplingParams(**defaults)
        if self.spec.parallel.dp != 1:
            raise ValueError("the offline LLM runs one replica; dp > 1 needs the server (`app serve`)")
        launches = deployment.launches()
        self.core, loaded = build_core(launches, bind=bind_threads, tokenizer=True)
        self.tokenizer = loaded.tokenizer
        self.chat_template = deployment.chat_template() or loaded.chat_template
        self.eos_token_id = self.tokenizer.eos_token_id
        model = launches[0].model  # its other end-of-generation tokens, as the server stops at them
        self.end_token_ids = end_token_ids(ModelSource(Path(model.path), model.format, model.served_name),
                                           self.tokenizer)
        self._next_id = 0

    def close(self) -> None:
        """Stop the TP workers (if any); the LLM cannot generate afterwards."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public API ---

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with where no params are given (vLLM's name): SamplingParams' own
        defaults with the model's sampling defaults and the spec's model.sampling_defaults over them."""
        return self.default_params

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt (text or token ids) with continuous batching; outputs in input order; no `params`:
        get_default_sampling_params()."""
        batch = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        texts = [p if isinstance(p, str) else None for p in batch]
        ids = [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in batch]
        return self._run(texts, ids, self._params_for(params, len(batch)))

    def embed(self, prompts: Prompt | Sequence[Prompt]) -> list[list[float]]:
        """Each prompt's embedding (text or token ids): its final hidden states pooled as `self.pooling` says (by
        default its last token's; vLLM's `LLM.embed` pools that way for a decoder model), L2-normalized
        (SamplingParams.embed)."""
        outputs = self.generate(prompts, SamplingParams(temperature=0, max_tokens=1, embed=True, pooling=self.pooling))
        return [output.embedding for output in outputs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[float]:
        """vLLM's `LLM.score` for an embedding model: the cosine of each pair's embeddings (`embed`), a single text
        of `data_1` paired with every one of `data_2`, else one to one. The scores themselves, as floats (vLLM's
        returns ScoringRequestOutput objects, each score at `.outputs.score`)."""
        firsts = [data_1] if isinstance(data_1, str) else list(data_1)
        seconds = [data_2] if isinstance(data_2, str) else list(data_2)
        if not firsts or not seconds or len(firsts) not in (1, len(seconds)):
            raise ValueError(f"score pairs one text with many, or as many with as many: {len(firsts)} with "
                             f"{len(seconds)}")
        texts = list(dict.fromkeys(firsts + seconds))
        vectors = dict(zip(texts, np.asarray(self.embed(texts), dtype=np.float64), strict=True))
        pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True)
        return [float(np.clip(vectors[a] @ vectors[b] / (np.linalg.norm(vectors[a]) * np.linalg.norm(vectors[b])),
                              -1, 1)) for a, b in pairs]

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
            return [params or self.default_params] * count
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
                    # (siblings wait to share the prompt's blocks; only the first scores it: SamplingParams.for_choice)
                    first = f"{request_id}-0" if i else None
                    sequences[child] = self._add(child, prompt_ids, p, i, first)
                outputs.append(RequestOutput(request_id, text, prompt_ids, []))
            self._loop(sequences)
        finally:  # a rejected prompt or an interrupt leaves nothing behind in the engine
            for request_id, seq in sequences.items():
                if seq.finish_reason is None:
                    self.core.abort(request_id)
        for output, p in zip(outputs, params, strict=True):
            output.prompt_logprobs = sequences[f"{output.request_id}-0"].prompt_logprobs
            output.embedding = sequences[f"{output.request_id}-0"].embedding
            output.num_cached_tokens = sequences[f"{output.request_id}-0"].cached_tokens
            for i in range(p.n):
                seq = sequences[f"{output.request_id}-{i}"]
                reason = seq.finish_reason.value if seq.finish_reason else None
                output.outputs.append(CompletionOutput(i, seq.text, seq.token_ids, reason, seq.logprobs or None,
                                                       seq.stop_reason))
        return outputs

    def _loop(self, sequences: dict[str, SequenceText]) -> None:
        while self.core.has_work():
            for delta in self.core.step():
                seq = sequences.get(delta.request_id)
                if seq is None:
                    continue
                if delta.prompt_logprobs is not None:
                    seq.prompt_logprobs = delta.prompt_logprobs
                if delta.embedding is not None:
                    seq.embedding = delta.embedding
                if delta.cached_tokens is not None:
                    seq.cached_tokens = delta.cached_tokens
                if seq.take(delta.token_id, delta.logprobs, delta.finish_reason) and delta.finish_reason is None:
                    self.core.abort(delta.request_id, FinishReason.STOP)  # a stop string matched

    def _add(self, child_id: str, prompt_ids: list[int], params: SamplingParams, index: int,
             wait_for: str | None) -> SequenceText:
        params = params.for_choice(index)
        if self.end_token_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=(*params.stop_token_ids, *self.end_token_ids))
        self.core.add_request(child_id, prompt_ids, params, self.eos_token_id, wait_for)
        return SequenceText.of(self.tokenizer, prompt_ids, params, self.eos_token_id)


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
