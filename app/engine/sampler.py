"""Turns one step's logits into one token per running sequence, with vLLM's and OpenAI's semantics.

Order of operations, per row: tokens outside allowed_token_ids masked, then the last token of each bad word that
the output would complete, logit_bias added to the raw logits, then
penalties (as vLLM), EOS/stop ids masked
until min_tokens,
then either argmax (temperature 0) or temperature -> top-k -> top-p -> min-p -> a random draw (the vocabulary
sorted only for rows that set top-p).
Log-probabilities describe the model, not the knobs: they come from the raw logits (vLLM v1's default), where a
structured output's grammar has masked the tokens it does not allow (vLLM's grammar masks the logits before its
sampler sees them): a constrained answer's logprobs are those of the tokens it could be.

Every step is batched across rows with different parameters. Only the random numbers are drawn row by
row, because a seeded request must draw from its own generator to sample the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.engine.params import SamplingParams
from app.engine.structured import MaskClock

log = logging.getLogger(__name__)

_DRAW_BLOCK = 256  # tokens a block of `draw`'s two-level running sum
_NUCLEUS = 1024  # most likely tokens top-p sorts before it sorts a whole row


@dataclass
class SamplingState:
    """Per-request sampler state the engine keeps for each running sequence."""

    params: SamplingParams
    prompt_ids: list[int]  # for repetition_penalty
    output_ids: list[int]  # tokens generated so far; the engine appends to it after each step
    eos_token_id: int | None
    generator: torch.Generator | None  # this request's own random stream; None when unseeded
    early_stops: torch.Tensor | None = None  # [n] int64: ids masked until min_tokens (EOS, stop ids); built once
    # for the penalties, kept as the outputs grow: each output token's count, of output_ids[:counted]
    output_counts: dict[int, int] = field(default_factory=dict)
    counted: int = 0
    prompt_tokens: torch.Tensor | None = None  # [n] int64: the prompt's distinct tokens, once asked for
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias as ([n] int64 ids, [n] float32 biases)
    allowed: torch.Tensor | None = None  # params.allowed_token_ids as [n] int64, distinct
    matcher: Any = None  # the grammar's llguidance matcher (params.grammar), advanced by each token sampled
    mask_clock: MaskClock = field(default_factory=MaskClock)  # how slow its masks have been (structured.py)
    # params.prompt_logprobs: the prompt's so far (None for its first token, then a TokenLogprobs for each next one),
    # until they go out with the first sampled token; and how many prompt positions gave theirs (a preempted
    # request recomputes its prompt: those are not read twice)
    prompt_logprobs: list | None = None
    prompt_done: int = 0
    # params.embed with "mean" or "cls" pooling: the float32 sum of the prompt's final hidden states so far (or its
    # first token's), and how many prompt positions gave theirs (not read twice after a preemption, as above)
    pooled: torch.Tensor | None = None
    pooled_done: int = 0


def new_state(params: SamplingParams, prompt_ids: list[int], eos_token_id: int | None,
              matcher: Any = None) -> SamplingState:
    generator = None
    if params.seed is not None:
        # A torch seed is a uint64; folding any int into that range keeps every API seed valid.
        generator = torch.Generator().manual_seed(params.seed % 2**64)
    early_stops = None
    if params.min_tokens > 0:
        stops = set(params.stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        # (min_tokens yields where allowed_token_ids allows only stop tokens: masking them would leave no token)
        if not (params.allowed_token_ids and set(params.allowed_token_ids) <= stops):
            early_stops = torch.tensor(sorted(stops), dtype=torch.int64)
    bias = None
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        bias = (torch.tensor(ids, dtype=torch.int64), torch.tensor(values, dtype=torch.float32))
    allowed = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.int64) \
        if params.allowed_token_ids else None
    return SamplingState(params, prompt_ids, [], eos_token_id, generator, early_stops, bias=bias, allowed=allowed,
                         matcher=matcher,
                         prompt_logprobs=[None] if params.scores_prompt else None)


# What a row gets whose logits hold no usable distribution (NaN or infinite, or all -inf): not a token id.
NO_TOKEN = -1
# ... and one whose logits are fine but whose grammar failed (it allows no further token): its keys and values are
# sound, so the engine aborts the request without dropping its blocks from the prefix cache.
GRAMMAR_FAILED = -2


@dataclass(frozen=True)
class SampleOutput:
    tokens: torch.Tensor  # [S] int64: the sampled token of each row, NO_TOKEN / GRAMMAR_FAILED where none
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
        if all(_plain_greedy(state, grammar=True) for state in states):
            return _greedy_output(raw, states)
        shaped = apply_allowed(raw, states)
        shaped = mask_stop_tokens(apply_penalties(apply_logit_bias(apply_bad_words(shaped, states), states), states),
                                  states)
        if shaped is raw and any(state.matcher is not None for state in states):
            shaped = raw.clone()  # the grammars mask in place; the raw logits give the log-probabilities
        failed, refused = apply_grammars(shaped, states, raw)
        tokens = self._choose(shaped, states)
        undrawn = tokens < 0  # no finite, positive mass to draw from: the argmax decides (a penalty that made a
        if undrawn.any():     # logit infinite makes that token certain; NaN or +inf comes first, as in torch)
            tokens[undrawn] = greedy_tokens(shaped[undrawn])
        tokens = _usable(raw, tokens)
        for s in failed:  # (NaN logits are the model's fault, whatever the grammar says)
            tokens[s] = GRAMMAR_FAILED if _sound(raw[s].numpy()) else NO_TOKEN
        return _with_logprobs(raw, tokens, states, refused)

    def _check(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [S, {self.vocab_size}], got {list(logits.shape)}")
        if logits.shape[0] != len(states):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(states)} sampling states")

    def _choose(self, shaped: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        # shaped: [S, V] penalized and masked logits -> [S] int64
        rows = [s for s, state in enumerate(states) if not state.params.greedy]
        if len(rows) == len(states):
            return draw(filtered_probs(shaped, [state.params for state in states]), self._uniforms(states))
        tokens = greedy_tokens(shaped)
        if rows:
            chosen = [states[s] for s in rows]
            probs = filtered_probs(shaped[rows], [state.params for state in chosen])
            tokens[rows] = draw(probs, self._uniforms(chosen))
        return tokens

    def _uniforms(self, states: Sequence[SamplingState]) -> torch.Tensor:
        # -> [R] float64 uniform draws in [0, 1), one a row; a seeded row's from its own generator
        u = torch.empty(len(states), dtype=torch.float64)
        shared = [r for r, state in enumerate(states) if state.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self._generator, dtype=torch.float64)
        for r, state in enumerate(states):
            if state.generator is not None:
                u[r] = torch.rand(1, generator=state.generator, dtype=torch.float64)
        return u


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token i of each row with probability probs[i] / sum(probs): the first whose running sum passes u x sum.

    probs: [R, V] >= 0, not normalized; u: [R] float64 in [0, 1) -> [R] int64. The running sum is taken in
    two levels: over blocks of 256 tokens (float32 sums), then in float64 inside the one block u falls in,
    scaled to that block's sum, so a token's odds move by ~1e-7 of themselves at most (a float32 running sum
    over 49,152 tokens would round them to multiples of ~6e-8). A token without mass is never drawn. The exponential race (argmax p / q, q ~ Exp(1) a token) is as exact, but its
    49,152 exponentials a row took 72 ms of a 64-row step's 100 on the Xeon of docs/PERFORMANCE.md.
    """
    rows, vocab = probs.shape
    width = _DRAW_BLOCK
    blocks = -(-vocab // width)
    if blocks * width != vocab:
        probs = torch.nn.functional.pad(probs, (0, blocks * width - vocab))
    tiles = probs.view(rows, blocks, width)
    ends = tiles.sum(dim=-1).double().cumsum(dim=-1)  # [R, blocks]: the mass up to each block's end
    total = ends[:, -1:].contiguous()  # [R, 1]
    target = u.unsqueeze(1) * total
    block = torch.minimum(torch.searchsorted(ends, target, right=True),  # the first block ending past it,
                          torch.searchsorted(ends, total)).clamp_(max=blocks - 1)  # or (rounding) the last with mass
    before = torch.nn.functional.pad(ends, (1, 0)).gather(1, block)  # [R, 1]: the mass before the block
    inner = tiles[torch.arange(rows), block.squeeze(1)].cumsum(dim=-1, dtype=torch.float64)  # [R, width]
    # scaled to the block's float32 sum that chose it: so a token's odds move by ~1e-7 of themselves, not of its block's
    inside = before + inner * ((ends.gather(1, block) - before) / inner[:, -1:])
    token = torch.minimum(torch.searchsorted(inside, target, right=True),  # the first token ending past the target,
                          torch.searchsorted(inside, inside[:, -1:].contiguous())).clamp_(max=width - 1)  # or the last
    # A row without a finite, positive mass (NaN or infinite logits, all -inf) gets NO_TOKEN; the others are not
    # held up by it.
    return torch.where((total > 0) & (total < math.inf), block * width + token, NO_TOKEN).squeeze(1)


def _plain_greedy(state: SamplingState, grammar: bool = False) -> bool:
    """Greedy, without allowed_token_ids, bad words, logit_bias, penalties, logprobs or a stop token still masked: the
    argmax of
    the raw logits (`grammar`: or of those the row's grammar allows)."""
    params = state.params
    held = len(state.output_ids) < params.min_tokens and state.early_stops is not None
    return params.greedy and params.logprobs is None and not params.logit_bias and not params.allowed_token_ids and \
        not params.bad_words_token_ids and (grammar or state.matcher is None) and not _has_penalty(params) and not held


def _greedy_output(raw: torch.Tensor, states: Sequence[SamplingState] = ()) -> SampleOutput:
    """What __call__ gives rows that are all `_plain_greedy(grammar=True)`: the argmax of the raw logits, no torch
    op on them; a grammar's row (structured outputs, tool calls) its argmax among the tokens the grammar allows.
    Most steps of a held answer pick a token the grammar allows anyway: one bit of its mask tells, and only the
    others unpack the mask (the general path's mask, copy and masked fill cost ~0.35 ms a row over SmolLM2's
    49,152 tokens)."""
    tokens = greedy_tokens(raw)
    for s, state in enumerate(states):
        if state.matcher is not None:
            tokens[s] = _grammar_argmax(raw[s], int(tokens[s]), state)
    return SampleOutput(_usable(raw, tokens), None, None, None)


def _grammar_argmax(row: torch.Tensor, best: int, state: SamplingState) -> int:
    """`row`'s argmax among the tokens its grammar allows next (`best`: its argmax among all), or GRAMMAR_FAILED
    where the grammar failed (allowed_tokens' rule: in an error state, or allowing no token); `_usable` makes that
    NO_TOKEN where the row's logits are not finite."""
    from app.engine.structured import grammar_error, mask_bits

    bits = mask_bits(state.matcher, state.eos_token_id, state.params.stop_token_ids, state.mask_clock)
    if bits is None:
        log.warning("structured output of a sequence failed (%s); its request is aborted", grammar_error(state.matcher))
        return GRAMMAR_FAILED
    if best >> 3 < len(bits) and bits[best >> 3] >> (best & 7) & 1:
        return best
    values = row.contiguous().numpy()
    allowed = np.zeros(values.shape[0], dtype=bool)  # a mask shorter than the logits allows none past its end
    unpacked = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:values.shape[0]]
    allowed[:unpacked.shape[0]] = unpacked
    if not allowed.any():
        log.warning("structured output of a sequence failed (its grammar allows no token); its request is aborted")
        return GRAMMAR_FAILED
    return int(np.where(allowed, values, -np.inf).argmax())


def _usable(raw: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """tokens, but NO_TOKEN where the model's own logit for the token chosen is not a finite number: its row was
    NaN or infinite (or all -inf), a broken model, not a token; the engine aborts the request.

    raw: [S, V] float32; tokens: [S] int64, >= 0 or GRAMMAR_FAILED (kept where the row is `_sound`). In numpy:
    each torch op on these few values costs 10-40 us right after a step has streamed the weights through the caches
    (a plain greedy batch's half dozen of them were ~0.15 ms of a ~5 ms batch-1 decode step on Zen 4)."""
    chosen, rows = tokens.numpy(), raw.contiguous().numpy()
    usable = np.isfinite(rows[np.arange(chosen.shape[0]), np.maximum(chosen, 0)])
    for s in np.flatnonzero(chosen < 0):  # (rare: a failed grammar's rows)
        usable[s] = _sound(rows[s])
    return torch.from_numpy(np.where(usable, chosen, NO_TOKEN).astype(np.int64, copy=False))


def _sound(row: np.ndarray) -> bool:
    """Whether a row of logits is a model's (no NaN, some finite logit), not a broken model's: where its grammar
    failed, the row's keys and values are sound (GRAMMAR_FAILED) or not (NO_TOKEN)."""
    return not np.isnan(row).any() and bool(np.isfinite(row).any())


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties; NaN counts as largest, as in torch): logits [S, V] float32 -> [S] int64.

    numpy's argmax, not torch's: over SmolLM2's 49,152 logits, torch's CPU argmax took 120-220 us for 8 rows
    and 0.5-1 ms for 32 (its argmax reduction is not vectorised), numpy's 18 and 70 us (Zen 5, 1-2 threads)."""
    return torch.from_numpy(logits.contiguous().numpy().argmax(axis=-1).astype("int64", copy=False))


def apply_grammars(shaped: torch.Tensor, states: Sequence[SamplingState],
                   raw: torch.Tensor) -> tuple[list[int], tuple[list[int], torch.Tensor] | None]:
    """In place: -inf on every token a row's grammar does not allow next (structured outputs; the last of the masks,
    so a grammar's choice is never undone). Where the masks before it left none of those tokens (min_tokens holding
    back the EOS that a complete grammar allows alone), the grammar wins: the row is the raw logits, masked by the
    grammar only. Returns the rows whose grammar failed (it allows no token): they get no token, and the engine
    aborts their requests; and the grammars' rows with their refused tokens ([rows, V] bool), or None.

    shaped: [S, V] float32, already a copy of the raw logits wherever a row has a grammar (see __call__)."""
    from app.engine.structured import allowed_tokens, grammar_error

    rows = [s for s, state in enumerate(states) if state.matcher is not None]
    if not rows:
        return [], None
    allowed, failed_at = allowed_tokens([states[s].matcher for s in rows], shaped.shape[1],
                                        [(states[s].eos_token_id, states[s].params.stop_token_ids) for s in rows],
                                        [states[s].mask_clock for s in rows])
    for i in failed_at:
        log.warning("structured output of a sequence failed (%s); its request is aborted",
                    grammar_error(states[rows[i]].matcher))
    refused = torch.from_numpy(~allowed)
    whole = len(rows) == shaped.shape[0]  # every row has a grammar: masked in place, no gather and scatter
    masked = shaped if whole else shaped[rows]
    masked.masked_fill_(refused, float("-inf"))
    # Only min_tokens' mask can have taken every token the grammar allows (a complete grammar's EOS): the model's
    # logits are finite (a row that is not gets no token anyway), and penalties and logit_bias keep them so.
    held = [i for i, s in enumerate(rows) if len(states[s].output_ids) < states[s].params.min_tokens]
    for i in held:
        if bool((masked[i] == float("-inf")).all()):  # the grammar wins over the masks before it
            masked[i] = raw[rows[i]].masked_fill(refused[i], float("-inf"))
    if not whole:
        shaped[rows] = masked
    return [rows[i] for i in failed_at], (rows, refused)


def apply_allowed(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """-inf on every token outside a row's allowed_token_ids (vLLM's; first, so nothing after it brings one back).

    logits: [S, V] float32 -> [S, V] float32; the input itself when no row has such a list, else a new tensor (the raw
    logits stay as they are: log-probabilities come from them)."""
    rows = [s for s, state in enumerate(states) if state.allowed is not None]
    if not rows:
        return logits
    out = logits.clone(memory_format=torch.contiguous_format)
    for s in rows:
        kept = out[s, states[s].allowed]
        out[s] = float("-inf")
        out[s, states[s].allowed] = kept
    return out


def apply_bad_words(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """-inf on the last token of each of a row's bad words (params.bad_words_token_ids) whose other tokens end its
    output so far (vLLM's bad_words: its output, not its prompt); a copy where any is masked."""
    out = logits
    for s, state in enumerate(states):
        output = state.output_ids
        banned = [word[-1] for word in state.params.bad_words_token_ids
                  if len(word) - 1 <= len(output) and (len(word) == 1 or output[len(output) - len(word) + 1:] ==
                                                       list(word[:-1]))]
        if banned:
            out = logits.clone() if out is logits else out
            out[s, banned] = -math.inf
    return out


def apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Each row's logit_bias added to its logits (OpenAI's logit_bias; before the penalties, as in vLLM).

    logits: [S, V] float32 -> [S, V] float32; the input itself when no row has a bias, else a new tensor (the raw
    logits stay as they are: log-probabilities come from them). Only the biased tokens are touched."""
    biased = [s for s, state in enumerate(states) if state.bias is not None]
    if not biased:
        return logits
    vocab = logits.shape[1]
    out = logits.clone(memory_format=torch.contiguous_format)
    at = torch.cat([states[s].bias[0] + s * vocab for s in biased])
    out.view(-1).index_add_(0, at, torch.cat([states[s].bias[1] for s in biased]))
    return out


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Repetition (prompt and output), frequency and presence (output only) penalties.

    logits: [S, V] float32 -> [S, V] float32; the input itself when no row has a penalty, else a new tensor.
    Only the tokens a row has seen change, so only they are touched (gathered, penalized, scattered back):
    as whole [S, V] passes, penalties took 50-90 ms for 64 rows of 49,152 (docs/PERFORMANCE.md's Xeon).
    """
    penalized = [s for s, state in enumerate(states) if _has_penalty(state.params)]
    if not penalized:
        return logits
    vocab = logits.shape[1]
    seen, rep, generated, freq, counts, presence = [], [], [], [], [], []
    for s in penalized:
        state, params = states[s], states[s].params
        ids, n = _output_counts(state)
        if params.repetition_penalty != 1:
            tokens = torch.cat([_prompt_tokens(state), ids]).unique()
            seen.append(tokens + s * vocab)
            rep.append(torch.full(tokens.shape, params.repetition_penalty))
        if params.frequency_penalty != 0 or params.presence_penalty != 0:
            generated.append(ids + s * vocab)
            freq.append(torch.full(ids.shape, params.frequency_penalty))
            counts.append(n)
            presence.append(torch.full(ids.shape, params.presence_penalty))
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    if seen:  # positive logits divided by the penalty, negative ones multiplied
        at, by = torch.cat(seen), torch.cat(rep)
        x = flat[at]
        flat[at] = torch.where(x > 0, x / by, x * by)
    if generated:  # in this order, as OpenAI defines them: - frequency x count - presence
        at = torch.cat(generated)
        flat[at] = flat[at] - torch.cat(freq) * torch.cat(counts) - torch.cat(presence)
    return out


def _output_counts(state: SamplingState) -> tuple[torch.Tensor, torch.Tensor]:
    # -> ([n] int64 distinct output tokens, [n] float32 their counts); the counts kept up to date a step at a time
    if state.counted > len(state.output_ids):  # never expected: the outputs only grow; recount rather than drift
        state.output_counts, state.counted = {}, 0
    for token in state.output_ids[state.counted:]:
        state.output_counts[token] = state.output_counts.get(token, 0) + 1
    state.counted = len(state.output_ids)
    return (torch.tensor(list(state.output_counts), dtype=torch.int64),
            torch.tensor(list(state.output_counts.values()), dtype=torch.float32))


def _prompt_tokens(state: SamplingState) -> torch.Tensor:
    # -> [n] int64: the prompt's distinct tokens, found once
    if state.prompt_tokens is None:
        state.prompt_tokens = torch.tensor(state.prompt_ids, dtype=torch.int64).unique()
    return state.prompt_tokens


def mask_stop_tokens(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Until a row has min_tokens outputs, its EOS and stop token ids get -inf (ignore_eos or not, like vLLM).

    logits: [S, V] -> [S, V]; the input itself when nothing is masked, else a new tensor.
    """
    rows, ids = [], []
    for s, state in enumerate(states):
        if len(state.output_ids) < state.params.min_tokens and state.early_stops is not None:
            rows.append(torch.full_like(state.early_stops, s))
            ids.append(state.early_stops)
    if not rows:
        return logits
    return logits.index_put((torch.cat(rows), torch.cat(ids)), torch.tensor(float("-inf")))


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each row with its own values.

    logits: [R, V] -> [R, V] probabilities in token order, 0 outside the kept set. Not renormalized
    after top-p and min-p: `draw` only needs them proportional. Only top-p needs the
    vocabulary sorted (a stable sort of 49,152 logits is most of a 64-row step's sampling time), so
    only rows that set it pay for one; a row's path depends on its own parameters, never on its batch.
    """
    temperature = _column([p.temperature for p in params])
    scaled = logits if (temperature == 1).all() else logits / temperature
    nucleus = [r for r, p in enumerate(params) if p.top_p < 1]
    if not nucleus:
        return _unsorted_probs(scaled, params)
    if len(nucleus) == len(params):
        return _sorted_probs(scaled, params)
    rest = [r for r, p in enumerate(params) if p.top_p >= 1]
    probs = torch.empty_like(scaled)
    probs[nucleus] = _sorted_probs(scaled[nucleus], [params[r] for r in nucleus])
    probs[rest] = _unsorted_probs(scaled[rest], [params[r] for r in rest])
    return probs


def _unsorted_probs(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    # scaled: [R, V] logits / temperature of rows without top-p -> [R, V]. Top-k keeps every probability at
    # least the k-th largest (ties at the boundary stay in, as in vLLM's top-k), min-p every one at least
    # min_p times the largest: not renormalized, so both cut the softmax's output, row by row with threshold_.
    # On docs/PERFORMANCE.md's Xeon, 64 rows of 49,152: masked_fill over the batch 6 ms, these 1.6; torch's
    # topk 6.6 ms, numpy's introselect (np.partition) 4.2.
    vocab = scaled.shape[1]
    probs = scaled.softmax(dim=-1)
    floor = [0.0] * len(params)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        rows = [r for r, k in enumerate(ks) if k]
        selected = np.partition(probs.numpy(), sorted({vocab - ks[r] for r in rows}), axis=-1)
        for r, kth in zip(rows, selected[rows, [vocab - ks[r] for r in rows]].tolist()):
            floor[r] = kth
    rows = [r for r, p in enumerate(params) if p.min_p > 0]
    if rows:
        least = (torch.tensor([params[r].min_p for r in rows]) * probs[rows].amax(dim=-1)).tolist()
        for r, bound in zip(rows, least):
            floor[r] = max(floor[r], bound)
    rows = [r for r, bound in enumerate(floor) if bound > 0]
    if rows:
        _keep_at_least(probs, rows, torch.tensor([floor[r] for r in rows]), 0.0)
    return probs


def _keep_at_least(x: torch.Tensor, rows: list[int], bound: torch.Tensor, value: float) -> None:
    # x: [R, V] float32, in place: x[r, i] = value where x[r, i] < bound[j], r = rows[j]
    below = torch.nextafter(bound.float(), torch.tensor(float("-inf"))).tolist()
    for r, t in zip(rows, below):
        torch.nn.functional.threshold_(x[r], t, value)


def _sorted_probs(scaled: torch.Tensor, params: Sequence[SamplingParams], head: int = 0) -> torch.Tensor:
    # scaled: [R, V] logits / temperature of rows with top-p (top-k and min-p too, if set) -> [R, V].
    # Top-p needs the most likely tokens in order only until their mass reaches top_p: the `head` (_NUCLEUS)
    # most likely are selected (numpy's argpartition) and sorted; a row whose nucleus (or top-k, or a tie at its
    # k-th) reaches past them tries a head 8 times as big, and past a quarter of the vocabulary sorts it whole.
    # 64 rows of 49,152 on docs/PERFORMANCE.md's Xeon: ~13 ms, a full stable sort 260 ms; one row on an AVX2
    # Zen 3, 0.7 ms, its full sort (a flat row: sampling at temperature 1 from a small model, 1 step in 10) 8 ms,
    # a head of 8,192 ~1.5 ms. Every reduction here is a row's own (numpy's, or torch's cumsum): a seeded row gets
    # the same bits in any batch (torch's sum over a whole row split it among threads when alone).
    vocab = scaled.shape[1]
    probs = scaled.softmax(dim=-1)
    head = min(head or _NUCLEUS, vocab)
    k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params])[:, None]  # [R, 1]
    flat = probs.numpy()
    ids = np.argpartition(flat, vocab - head, axis=-1)[:, vocab - head:]  # [R, head], any order
    values = np.take_along_axis(flat, ids, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    ids, values = np.take_along_axis(ids, order, axis=-1), np.take_along_axis(values, order, axis=-1)  # descending
    # top-k keeps every token at least as likely as the k-th (ties stay in, as without top-p); renormalized over them
    kth = np.take_along_axis(values, np.minimum(k, head) - 1, axis=-1)
    in_k = (values >= kth) | (k >= vocab)
    mass = np.where(k >= vocab, np.float32(1), (values * in_k).sum(axis=-1, keepdims=True, dtype=np.float32))
    ordered = torch.from_numpy(values * in_k / mass)
    before = ordered.cumsum(dim=-1) - ordered  # mass of the more likely tokens; 0 for the top token
    top_p, min_p = _column([p.top_p for p in params]), _column([p.min_p for p in params])
    keep = torch.from_numpy(in_k) & (before < top_p) & (ordered >= min_p * ordered[:, :1])
    # rows whose kept set may reach past the head: a top-k beyond it (and not all), a nucleus not reached in it, or
    # a cut (a top-k's k-th, a nucleus's last) on the head's least likely value where a token outside has it too
    # (which of a run of equal values is kept is its lowest ids, and a top-k keeps the whole run)
    kept = keep.numpy().sum(axis=-1)
    last = np.take_along_axis(values, np.maximum(kept - 1, 0)[:, None], axis=-1)
    _cut_ties_by_id(keep.numpy(), ids, values, kept)
    edge = (((kth == values[:, -1:]) & (k < vocab)) | (last == values[:, -1:]))[:, 0] & (head < vocab)
    spills = np.zeros_like(edge)
    spills[edge] = (flat[edge] >= values[edge, -1:]).sum(axis=-1) > head
    whole = ((k > head) & (k < vocab)) | ((k >= vocab) & (before[:, -1:] + ordered[:, -1:] < top_p).numpy()) | \
        spills[:, None]
    out = torch.zeros_like(probs).scatter_(1, torch.from_numpy(ids), ordered.masked_fill(~keep, 0))
    rows = np.flatnonzero(whole[:, 0]).tolist()
    if rows:
        wider, chosen = head * 8, [params[r] for r in rows]
        out[rows] = _sorted_probs(scaled[rows], chosen, wider) if wider * 4 <= vocab else \
            _fully_sorted_probs(scaled[rows], chosen)
    return out


def _cut_ties_by_id(keep: np.ndarray, ids: np.ndarray, values: np.ndarray, kept: np.ndarray) -> None:
    # keep: [R, head] bool, a prefix of each row's head (ids, values: most likely first, tied ones in any order),
    # in place: where the cut falls inside a run of equal values, the run's kept ones are its lowest ids, as the
    # whole row's stable sort would keep
    head = keep.shape[1]
    for r in np.flatnonzero((kept > 0) & (kept < head)).tolist():
        n = int(kept[r])
        if values[r, n] != values[r, n - 1]:
            continue
        run = np.flatnonzero(values[r] == values[r, n - 1])  # positions, contiguous
        lowest = np.argsort(ids[r, run], kind="stable")[:int(keep[r, run].sum())]
        keep[r, run] = False
        keep[r, run[lowest]] = True


def _fully_sorted_probs(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    # scaled: [R, V] -> [R, V]: _sorted_probs over the whole vocabulary
    vocab = scaled.shape[1]
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).unsqueeze(1)  # [R, 1]
    top_p = _column([p.top_p for p in params])
    min_p = _column([p.min_p for p in params])
    # in the order of the probabilities, ties by id, as the sorted head orders them: logits that differ can give
    # equal probabilities, and which of those a cut keeps must not depend on the path
    order = scaled.softmax(dim=-1).sort(dim=-1, descending=True, stable=True).indices  # [R, V]
    ordered = scaled.gather(1, order)
    keep = ordered >= ordered.gather(1, k - 1)  # the top k, and any tied with the k-th
    probs = ordered.masked_fill(~keep, float("-inf")).softmax(dim=-1)  # renormalized over them
    before = probs.cumsum(dim=-1) - probs
    keep &= before < top_p
    keep &= probs >= min_p * probs[:, :1]
    return torch.zeros_like(probs).scatter_(1, order, probs.masked_fill(~keep, 0))


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, states: Sequence[SamplingState],
                   refused: tuple[list[int], torch.Tensor] | None = None) -> SampleOutput:
    # raw: [S, V] logits before any penalty or filter; tokens: [S]; refused: apply_grammars' rows and masks
    asked = [s.params.logprobs for s in states if s.params.logprobs is not None]
    if not asked:
        return SampleOutput(tokens, None, None, None)
    if refused is not None and any(states[s].params.logprobs is not None for s in refused[0]):
        rows, mask = refused
        mask = mask & ~mask.all(dim=1, keepdim=True)  # (a failed grammar's row allows none: it gets no token anyway)
        raw = raw.clone()
        raw[rows] = raw[rows].masked_fill(mask, float("-inf"))  # what the grammar allows, as vLLM's logprobs
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1)  # (a NO_TOKEN row's is junk)
    top_logprobs, top_ids = logprobs.topk(max(asked), dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs)


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.frequency_penalty != 0 or params.presence_penalty != 0


def _column(values: list[float]) -> torch.Tensor:
    # -> [S, 1] float32, to broadcast one value per row over the vocabulary
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)
