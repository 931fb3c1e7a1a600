"""Turns one step's logits into one token per running sequence, with vLLM's and OpenAI's semantics.

Order of operations, per row: penalties on the raw logits, EOS/stop ids masked until min_tokens,
then either argmax (temperature 0) or temperature -> top-k -> top-p -> min-p -> a random draw.
Log-probabilities describe the model, not the knobs: they come from the raw logits (vLLM v1's default).

Every step is batched across rows with different parameters. Only the random numbers are drawn row by
row, because a seeded request must draw from its own generator to sample the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.engine.params import SamplingParams

# Exp(1) draws of exactly 0 would divide by zero; a draw this small still wins any race it is in.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplingState:
    """Per-request sampler state the engine keeps for each running sequence."""

    params: SamplingParams
    prompt_ids: list[int]  # for repetition_penalty
    output_ids: list[int]  # tokens generated so far; the engine appends to it after each step
    eos_token_id: int | None
    generator: torch.Generator | None  # this request's own random stream; None when unseeded


def new_state(params: SamplingParams, prompt_ids: list[int], eos_token_id: int | None) -> SamplingState:
    generator = None
    if params.seed is not None:
        # A torch seed is a uint64; folding any int into that range keeps every API seed valid.
        generator = torch.Generator().manual_seed(params.seed % 2**64)
    return SamplingState(params, prompt_ids, [], eos_token_id, generator)


@dataclass(frozen=True)
class SampleOutput:
    tokens: torch.Tensor  # [S] int64: the sampled token of each row
    logprobs: torch.Tensor | None  # [S] float32: its log-prob (None if no row asked for logprobs)
    top_ids: torch.Tensor | None  # [S, K] int64, K = most logprobs any row asked for; extra columns are junk
    top_logprobs: torch.Tensor | None  # [S, K] float32, descending


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self._generator = torch.Generator().manual_seed(seed)  # shared by the unseeded rows

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleOutput:
        # logits: [S, V], row s belongs to states[s]
        self._check(logits, states)
        raw = logits.float()
        shaped = mask_stop_tokens(apply_penalties(raw, states), states)
        tokens = self._choose(shaped, states)
        return _with_logprobs(raw, tokens, states)

    def _check(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [S, {self.vocab_size}], got {list(logits.shape)}")
        if logits.shape[0] != len(states):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(states)} sampling states")

    def _choose(self, shaped: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        # shaped: [S, V] penalized and masked logits -> [S] int64
        tokens = greedy_tokens(shaped)
        rows = [s for s, state in enumerate(states) if not state.params.greedy]
        if rows:
            chosen = [states[s] for s in rows]
            probs = filtered_probs(shaped[rows], [state.params for state in chosen])
            # Exponential race: argmax(p / q) with q ~ Exp(1) draws token i with probability p_i / sum(p).
            tokens[rows] = (probs / self._noise(chosen, shaped.shape[1])).argmax(dim=-1)
        return tokens

    def _noise(self, states: Sequence[SamplingState], vocab: int) -> torch.Tensor:
        # -> [R, V] float32 Exp(1) draws; a seeded row's come from its own generator, V per step
        noise = torch.empty(len(states), vocab)
        shared = [r for r, state in enumerate(states) if state.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), vocab).exponential_(generator=self._generator)
        for r, state in enumerate(states):
            if state.generator is not None:
                noise[r] = torch.empty(vocab).exponential_(generator=state.generator)
        return noise.clamp_min_(_TINY)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties; NaN counts as largest, as in torch): logits [S, V] float32 -> [S] int64.

    numpy's argmax, not torch's: over SmolLM2's 49,152 logits, torch's CPU argmax took 120-220 us for 8 rows
    and 0.5-1 ms for 32 (its argmax reduction is not vectorised), numpy's 18 and 70 us (Zen 5, 1-2 threads)."""
    return torch.from_numpy(logits.contiguous().numpy().argmax(axis=-1).astype("int64", copy=False))


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Repetition (prompt and output), frequency and presence (output only) penalties.

    logits: [S, V] float32 -> [S, V] float32; the input itself when no row has a penalty, else a new tensor.
    """
    rep = _column([s.params.repetition_penalty for s in states])  # [S, 1]
    freq = _column([s.params.frequency_penalty for s in states])
    presence = _column([s.params.presence_penalty for s in states])
    if (rep == 1).all() and (freq == 0).all() and (presence == 0).all():
        return logits
    # Rows without a penalty contribute no ids: a long prompt costs nothing unless it is needed.
    penalized = [_has_penalty(s.params) for s in states]
    counts = _token_counts(logits.shape, [s.output_ids if p else [] for s, p in zip(states, penalized)])
    in_prompt = _token_counts(logits.shape, [s.prompt_ids if s.params.repetition_penalty != 1 else []
                                             for s in states]) > 0
    generated = counts > 0
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(in_prompt | generated, repeated, logits)
    return out - freq * counts - presence * generated


def mask_stop_tokens(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Until a row has min_tokens outputs, its EOS and stop token ids get -inf (ignore_eos or not, like vLLM).

    logits: [S, V] -> [S, V]; the input itself when nothing is masked, else a new tensor.
    """
    rows, ids = [], []
    for s, state in enumerate(states):
        if len(state.output_ids) < state.params.min_tokens:
            stops = set(state.params.stop_token_ids)
            if state.eos_token_id is not None:
                stops.add(state.eos_token_id)
            rows += [s] * len(stops)
            ids += sorted(stops)
    if not rows:
        return logits
    return logits.index_put((torch.tensor(rows), torch.tensor(ids)), torch.tensor(float("-inf")))


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each row with its own values.

    logits: [R, V] -> [R, V] probabilities in token order, 0 outside the kept set. Not renormalized
    after top-p and min-p: the exponential race only needs them proportional.
    """
    vocab = logits.shape[1]
    temperature = _column([p.temperature for p in params])
    top_k = _column([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = _column([p.top_p for p in params])
    min_p = _column([p.min_p for p in params])
    # Stable, so tied tokens keep a fixed order and a seeded row's draw never depends on the sort.
    ordered, order = (logits / temperature).sort(dim=-1, descending=True, stable=True)  # [R, V]
    keep = torch.arange(vocab) < top_k
    probs = ordered.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # renormalized over the top k
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens; 0 for the top token
    # top_p == 1 keeps all: rounding could push `before` to 1 and drop tail tokens otherwise.
    keep &= (before < top_p) | (top_p >= 1)
    # probs[:, :1] is the top token's; the ratio is the same before or after renormalizing.
    keep &= probs >= min_p * probs[:, :1]
    return torch.zeros_like(probs).scatter_(1, order, probs.masked_fill(~keep, 0))


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, states: Sequence[SamplingState]) -> SampleOutput:
    # raw: [S, V] logits before any penalty or filter; tokens: [S]
    asked = [s.params.logprobs for s in states if s.params.logprobs is not None]
    if not asked:
        return SampleOutput(tokens, None, None, None)
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(max(asked), dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs)


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.frequency_penalty != 0 or params.presence_penalty != 0


def _column(values: list[float]) -> torch.Tensor:
    # -> [S, 1] float32, to broadcast one value per row over the vocabulary
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def _token_counts(shape: torch.Size, id_lists: list[list[int]]) -> torch.Tensor:
    # -> [S, V] float32: how many times each token occurs in each row's list
    counts = torch.zeros(shape)
    lengths = torch.tensor([len(ids) for ids in id_lists])
    if int(lengths.sum()) == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    ids = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.int64)
    return counts.index_put_((rows, ids), torch.ones(len(ids)), accumulate=True)
