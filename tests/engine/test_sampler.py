"""The sampler against distributions and penalty values computed by hand or with numpy, not with its helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from app.engine.params import SamplingParams
from app.engine import sampler as sampler_module
from app.engine.sampler import NO_TOKEN, Sampler, apply_penalties, draw, filtered_probs, new_state

# Token probabilities of the test distribution, most likely first, placed at shuffled token ids so
# that a sampler mixing up sorted positions and token ids fails.
PROBS = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
TOKEN_OF_RANK = [3, 0, 6, 1, 7, 2, 5, 4]
V = len(PROBS)
DRAWS = 20_000
TVD_LIMIT = 0.02  # expected TVD of 20000 draws from 8 tokens is about 0.008; sampler seeds are fixed


def fixed_logits() -> torch.Tensor:
    # -> [V]: log PROBS at the shuffled token ids
    logits = torch.empty(V)
    logits[TOKEN_OF_RANK] = torch.tensor(np.log(PROBS), dtype=torch.float32)
    return logits


def reference(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The distribution the definitions give, by rank: p^(1/T), top k, then top p, then min p."""
    p = PROBS ** (1 / temperature)
    p = p / p.sum()
    if top_k > 0:
        p[top_k:] = 0
        p = p / p.sum()
    before = np.concatenate([[0.0], np.cumsum(p)[:-1]])  # mass of the more likely tokens
    p = np.where(before < top_p, p, 0)
    p = np.where(p >= min_p * p[0], p, 0)
    return p / p.sum()


def empirical(tokens: torch.Tensor) -> np.ndarray:
    # tokens: [N] token ids -> frequency of each rank
    counts = np.bincount(tokens.numpy(), minlength=V)
    return counts[TOKEN_OF_RANK] / len(tokens)


def tvd(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def sample_many(params: SamplingParams, draws: int = DRAWS, seed: int = 0) -> torch.Tensor:
    states = [new_state(params, [], None) for _ in range(draws)]
    return Sampler(V, seed=seed)(fixed_logits().expand(draws, V), states).tokens


def test_greedy_picks_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    # top_k and friends must not matter when temperature is 0
    states = [new_state(SamplingParams(temperature=0, top_k=3, top_p=0.5), [], None) for _ in range(6)]
    out = Sampler(50)(logits, states)
    assert out.tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert out.tokens.dtype == torch.int64
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("knobs, support", [
    (dict(), 8),
    (dict(top_k=-1), 8),
    (dict(temperature=0.5), 8),
    (dict(temperature=2.0), 8),
    (dict(top_k=3), 3),
    (dict(top_p=0.6), 3),  # cumulative 0.30, 0.50, 0.65: the third token reaches 0.6
    (dict(min_p=0.3), 5),  # keeps p >= 0.09
    # each filter cuts: top 5 of p^1.25, of which top 0.8 is 4 tokens, of which min_p keeps 3
    (dict(temperature=0.8, top_k=5, top_p=0.8, min_p=0.35), 3),
])
def test_distribution_matches_definition(knobs, support):
    """20000 unseeded draws are within total variation distance 0.02 of the exact distribution."""
    expected = reference(**knobs)
    assert np.count_nonzero(expected) == support  # the reference itself is what the comment says
    got = empirical(sample_many(SamplingParams(**knobs)))
    assert tvd(got, expected) < TVD_LIMIT, (got, expected)
    assert got[expected == 0].sum() == 0  # filtered tokens are never drawn


def test_rows_with_different_params_in_one_batch():
    """Interleaved rows of two settings each follow their own distribution (TVD < 0.02 per setting)."""
    a, b = dict(top_k=2), dict(temperature=0.5, min_p=0.3)
    states = [new_state(SamplingParams(**(a if i % 2 else b)), [], None) for i in range(2 * DRAWS)]
    tokens = Sampler(V, seed=3)(fixed_logits().expand(2 * DRAWS, V), states).tokens
    assert tvd(empirical(tokens[1::2]), reference(**a)) < TVD_LIMIT
    assert tvd(empirical(tokens[0::2]), reference(**b)) < TVD_LIMIT


def run_steps(states, target: int, steps: int, sampler_seed: int) -> list[int]:
    """Samples `steps` tokens for every row, feeding them back; returns row `target`'s tokens."""
    sampler = Sampler(50, seed=sampler_seed)
    logit_stream = torch.Generator().manual_seed(7)  # the same logits at every step, whatever the batch
    tokens = []
    for _ in range(steps):
        step_logits = torch.randn(50, generator=logit_stream)
        logits = torch.randn(len(states), 50)
        logits[target] = step_logits
        out = sampler(logits, states).tokens
        for state, token in zip(states, out.tolist()):
            state.output_ids.append(token)
        tokens.append(out[target].item())
    return tokens


def kept_by_definition(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """By the definitions, with numpy's full sort in float64: [V] probabilities a row keeps (0 elsewhere, not
    renormalized), and [V] bool: tokens so close to the top-p or min-p bound that float32 may decide otherwise."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ranked = p[order]
    if top_k > 0:
        ranked[ranked < ranked[min(top_k, len(ranked)) - 1]] = 0  # ties with the k-th stay in
        ranked /= ranked.sum()
    before = np.cumsum(ranked) - ranked
    in_p = (before < top_p) | (top_p >= 1)
    close = ((np.abs(before - top_p) < 1e-5) & (top_p < 1)) | (np.abs(ranked - min_p * ranked[0]) < 1e-5 * ranked[0])
    ranked = np.where(in_p & (ranked >= min_p * ranked[0]), ranked, 0)
    out, borderline = np.zeros_like(p), np.zeros(len(p), dtype=bool)
    out[order], borderline[order] = ranked, close
    return out, borderline


@pytest.mark.parametrize("head", [16, 1024])  # the default, and one small enough that some rows sort whole
def test_filters_on_a_large_vocabulary_match_the_definitions(monkeypatch, head):
    """5,000 tokens, rows of mixed knobs and peakedness: the kept set and its odds are the definitions'."""
    monkeypatch.setattr(sampler_module, "_NUCLEUS", head)
    gen = torch.Generator().manual_seed(5)
    knobs = [dict(), dict(top_k=7), dict(min_p=0.02), dict(top_k=40, min_p=0.05), dict(top_p=0.5),
             dict(top_p=0.95, temperature=0.7), dict(top_p=0.8, top_k=30), dict(top_p=0.9, top_k=3000),
             dict(top_p=0.9, min_p=0.01, temperature=1.3), dict(top_p=0.999)]
    params = [SamplingParams(**k) for k in knobs for _ in range(2)]
    logits = torch.randn(len(params), 5000, generator=gen) * torch.tensor([1.0, 6.0] * len(knobs)).unsqueeze(1)
    got = filtered_probs(logits, params).numpy()
    for row, (p, k) in enumerate(zip(got, [k for k in knobs for _ in range(2)])):
        expected, borderline = kept_by_definition(logits[row].numpy().astype(np.float64), **k)
        assert ((p > 0) == (expected > 0))[~borderline].all(), (row, k)
        assert np.count_nonzero(expected) > 0 and np.count_nonzero(p) > 0
        both = (p > 0) & (expected > 0)
        assert np.allclose(p[both] / p[both].sum(), expected[both] / expected[both].sum(), rtol=1e-4, atol=1e-9)


def test_draw_follows_the_odds_and_never_picks_a_token_without_mass():
    """A vocabulary not a multiple of the draw's block, mass at both ends and at a block's edges only."""
    vocab = 1000
    mass = {0: 0.1, 255: 0.2, 256: 0.3, 511: 0.05, 999: 0.35}
    probs = torch.zeros(DRAWS, vocab)
    for token, p in mass.items():
        probs[:, token] = p * 7  # not normalized: draw takes odds
    u = torch.rand(DRAWS, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tokens = draw(probs, u)
    counts = np.bincount(tokens.numpy(), minlength=vocab) / DRAWS
    assert set(np.flatnonzero(counts)) <= set(mass)
    assert tvd(counts[list(mass)], np.array(list(mass.values()))) < TVD_LIMIT
    # the extremes of u: the first token with mass, and the last one
    ends = draw(probs[:2], torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64))
    assert ends.tolist() == [0, 999]
    tail = torch.zeros(1, vocab)
    tail[0, 3] = 1.0  # everything after token 3 has no mass
    assert draw(tail, torch.tensor([1 - 2**-53], dtype=torch.float64)).tolist() == [3]


def test_a_row_gets_the_same_probabilities_in_any_batch():
    """Bit for bit, on SmolLM2's vocabulary (where one row alone is big enough for torch to split a reduction
    among threads): every path of the filters, the seeded draw's inputs."""
    gen = torch.Generator().manual_seed(8)
    # (knobs, logit scale): peaked rows keep their nucleus in the sorted head, flat ones sort the whole row
    rows = [(dict(), 4), (dict(top_k=40), 1), (dict(min_p=0.05), 4), (dict(top_p=0.9), 4), (dict(top_p=0.9), 1),
            (dict(top_p=0.9, top_k=50), 4), (dict(top_p=0.999, temperature=1.5), 4), (dict(top_p=0.95, top_k=3000), 1),
            (dict(top_p=0.8, min_p=0.01), 4), (dict(top_p=0.5), 3)] + [(dict(top_p=p), 5) for p in (0.7, 0.9, 0.95, 0.98)]
    knobs = [k for k, _ in rows]
    params = [SamplingParams(seed=1, **k) for k in knobs]
    logits = torch.randn(len(params), 49152, generator=gen) * torch.tensor([float(x) for _, x in rows]).unsqueeze(1)
    batch = filtered_probs(logits, params)
    for row, p in enumerate(params):
        assert torch.equal(filtered_probs(logits[row:row + 1], [p])[0], batch[row]), knobs[row]
        assert torch.equal(filtered_probs(logits[[row, 0, 3]], [p, params[0], params[3]])[0], batch[row]), knobs[row]


@pytest.mark.parametrize("head", [2, 1024])  # 2: the top-p rows sort whole
def test_ties_at_the_kth_stay_in_on_every_path(monkeypatch, head):
    monkeypatch.setattr(sampler_module, "_NUCLEUS", head)
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]]).expand(3, 5)
    params = [SamplingParams(top_k=2), SamplingParams(top_k=2, top_p=0.99999), SamplingParams(top_k=2, min_p=0.01)]
    kept = filtered_probs(logits, params) > 0
    assert kept.tolist() == [[True, True, True, True, False]] * 3


@pytest.mark.parametrize("head", [16, 1024, 8192])  # the cut's run inside the head, across it, past it
def test_a_cut_inside_a_run_of_equal_probabilities_keeps_its_lowest_ids(monkeypatch, head):
    """Top-p (and top-k, which keeps a whole run tied with its k-th) ending inside 3,000 tokens of exactly equal
    logits at shuffled ids: the kept ones are the run's lowest ids, as in the definitions' stable sort, on every
    path (the sorted head, a wider one, the whole row)."""
    monkeypatch.setattr(sampler_module, "_NUCLEUS", head)
    vocab, gen = 40000, torch.Generator().manual_seed(11)
    logits = torch.randn(vocab, generator=gen) - 8
    ids = torch.randperm(vocab, generator=gen)
    logits[ids[:20]] = 6 + torch.arange(20.0) / 10  # twenty distinct likely tokens
    logits[ids[20:3020]] = 4.0  # then a run of 3,000 equal ones, cut at ~280 (the head of 1,024 holds ~1,000)
    params = [SamplingParams(top_p=0.2), SamplingParams(top_p=0.2, top_k=50), SamplingParams(top_p=0.2, min_p=0.01)]
    got = filtered_probs(logits.expand(len(params), vocab), params).numpy()
    for row, knobs in enumerate([dict(top_p=0.2), dict(top_p=0.2, top_k=50), dict(top_p=0.2, min_p=0.01)]):
        expected, borderline = kept_by_definition(logits.numpy().astype(np.float64), **knobs)
        run = np.sort(ids[20:3020].numpy())
        kept = run[got[row][run] > 0]
        assert 0 < len(kept) < 3000 and kept.tolist() == run[:len(kept)].tolist(), knobs  # the lowest ids of the run
        assert ((got[row] > 0) == (expected > 0))[~borderline].all(), knobs


@pytest.mark.parametrize("head", [2, 1024])  # 2: the tie spills past the head, and a head of 16 is too big: whole
def test_equal_probabilities_from_unequal_logits_tie_by_id_on_every_path(monkeypatch, head):
    monkeypatch.setattr(sampler_module, "_NUCLEUS", head)
    logits = torch.full((1, 40), -30.0)
    logits[0, 30], logits[0, 10] = 0.0, -0.01
    logits[0, 3] = float(np.nextafter(np.float32(-0.01), np.float32(-1)))  # lower, at a lower id
    probs = logits.softmax(-1)
    assert logits[0, 3] < logits[0, 10] and probs[0, 3] == probs[0, 10]
    kept = filtered_probs(logits, [SamplingParams(top_p=0.5)])[0]
    assert torch.nonzero(kept).flatten().tolist() == [3, 30]


def test_a_top_k_the_size_of_the_head_is_decided_in_it(monkeypatch):
    """top_k == the head's size with no tie past it needs no wider head; a tie past it does."""
    calls = []
    inner = sampler_module._sorted_probs
    monkeypatch.setattr(sampler_module, "_sorted_probs",
                        lambda *a: calls.append(a[2] if len(a) > 2 else 0) or inner(*a))
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(12))
    probs = filtered_probs(logits, [SamplingParams(top_k=1024, top_p=0.99999)])
    assert calls == [0] and int((probs > 0).sum()) == 1024
    tied = logits.clone()
    tied[0, tied[0].argsort(descending=True)[1024]] = tied[0].sort(descending=True).values[1023]  # the 1,025th ties
    calls.clear()
    probs = filtered_probs(tied, [SamplingParams(top_k=1024, top_p=0.99999)])
    assert calls == [0, 8192] and int((probs > 0).sum()) == 1025


def test_rows_without_finite_mass_get_no_token_and_hold_up_no_other_row():
    """NaN or infinite logits, or all -inf: that row gets NO_TOKEN (the engine aborts its request), sampled or
    greedy, with logprobs asked for or not; the others their own tokens."""
    vocab, gen = 1000, torch.Generator().manual_seed(4)
    good = torch.randn(vocab, generator=gen)
    bad_rows = [torch.full((vocab,), float("nan")), torch.full((vocab,), float("-inf")), good.clone(), good.clone()]
    bad_rows[2][7] = float("inf")
    bad_rows[3][9] = float("nan")
    for knobs in [dict(), dict(top_k=20), dict(min_p=0.1), dict(top_p=0.9)]:
        alone = Sampler(vocab)(good.unsqueeze(0), [new_state(SamplingParams(seed=5, **knobs), [], None)]).tokens
        states = [new_state(SamplingParams(seed=5, **knobs), [], None)] + \
            [new_state(SamplingParams(**knobs), [], None) for _ in bad_rows]
        tokens = Sampler(vocab)(torch.stack([good] + bad_rows), states).tokens
        assert tokens[0] == alone[0] and tokens[1:].tolist() == [NO_TOKEN] * 4, knobs
    greedy = [new_state(SamplingParams(temperature=0, logprobs=2), [], None) for _ in range(len(bad_rows) + 1)]
    out = Sampler(vocab)(torch.stack([good] + bad_rows), greedy)
    assert out.tokens.tolist() == [int(good.argmax())] + [NO_TOKEN] * 4
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(good, dim=-1).max())
    plain = [new_state(SamplingParams(temperature=0), [], None) for _ in range(len(bad_rows) + 1)]  # the numpy path
    assert Sampler(vocab)(torch.stack([good] + bad_rows), plain).tokens.tolist() == out.tokens.tolist()


def test_plain_greedy_rows_take_the_numpy_path_and_the_general_path_keeps_the_rest(monkeypatch):
    """Greedy rows without penalties, logprobs or masked stop tokens take a numpy path (the first maximum, also
    on exact ties); a batch with a row that needs the general path (a penalty, logprobs, min_tokens) takes
    that one, and that row's token is the one its parameters make it."""
    import app.engine.sampler as sampler_module

    calls = []
    fast = sampler_module._greedy_output
    monkeypatch.setattr(sampler_module, "_greedy_output", lambda *args: calls.append(1) or fast(*args))
    vocab, gen = 2000, torch.Generator().manual_seed(7)
    logits = torch.randn(6, vocab, generator=gen)
    logits[1, 5] = logits[1, 1500] = logits[1].max() + 1  # a tie: the first wins
    plain = [new_state(SamplingParams(temperature=0), [3, 4], 2) for _ in range(6)]
    tokens = Sampler(vocab)(logits, plain).tokens
    assert calls == [1]
    assert tokens.dtype == torch.int64 and tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[1] == 5
    # the last row's largest logit on EOS (masked until min_tokens), on a prompt token (a penalty halves it), or
    # logprobs asked for: each moves its row off the numpy path, and only that row's token changes
    special = logits.clone()
    special[5, 2] = special[5, 3] = special[5].max() + 1.0
    runner_up = int(logits[5].argmax())
    for other, expected in ((dict(min_tokens=1), 3), (dict(repetition_penalty=2.0), 2), (dict(logprobs=0), 2)):
        calls.clear()
        row = special[5].clone()
        if "repetition_penalty" in other:
            row[2] = float(logits[5].min()) - 1  # only the prompt token 3 stays on top; halved, it falls below
            expected = runner_up
        batch = torch.cat([special[:5], row.unsqueeze(0)])
        mixed = plain[:5] + [new_state(SamplingParams(temperature=0, **other), [3, 4], 2)]
        out = Sampler(vocab)(batch, mixed)
        assert calls == [], other
        assert out.tokens.tolist() == tokens.tolist()[:5] + [expected], other
        assert (out.logprobs is not None) == ("logprobs" in other), other


def test_a_penalty_that_makes_a_logit_infinite_chooses_that_token():
    """The model's logits are finite; a repetition penalty of ~0 (the API allows any > 0; float32 rounds 1e-300
    to 0) divides a seen token's positive logit into +inf. That is the user's doing, not a broken model: the
    token is chosen, sampled or greedy, never NO_TOKEN."""
    vocab = 50
    logits = torch.linspace(-1.0, 1.0, vocab).unsqueeze(0)
    for temperature in (0.0, 1.0):
        state = new_state(SamplingParams(temperature=temperature, repetition_penalty=1e-300), [40], None)
        assert Sampler(vocab)(logits.clone(), [state]).tokens.tolist() == [40]  # logit 0.63: not the largest before

def test_draw_keeps_a_light_tokens_odds_beside_a_heavy_one():
    """Token 255 (1e-9) shares its 256-token block with token 0 (0.9): u inside its sliver still draws it."""
    probs = torch.zeros(3, 512)
    probs[:, 0], probs[:, 255], probs[:, 256] = 0.9, 1e-9, 0.1
    heavy, light, next_block = (float(probs[0, i]) for i in (0, 255, 256))  # as float32 holds them
    total = heavy + next_block  # the light token is below the float32 block sum's rounding: the block's sum is heavy's
    u = torch.tensor([heavy - 2 * light, heavy - light / 2, heavy + 1e-12], dtype=torch.float64) / total
    assert draw(probs, u).tolist() == [0, 255, 256]


def seeded(seed: int):
    return new_state(SamplingParams(seed=seed, top_k=20, presence_penalty=0.5), [1, 2, 3], None)


def test_seeded_request_is_reproducible_in_any_batch():
    alone = run_steps([seeded(1234)], target=0, steps=20, sampler_seed=0)
    others = [
        new_state(SamplingParams(), [], None),
        new_state(SamplingParams(temperature=0), [], None),
        new_state(SamplingParams(seed=99, top_p=0.9), [], None),
        new_state(SamplingParams(temperature=0.7, min_p=0.1, logprobs=2), [], None),
    ]
    batch = others[:3] + [seeded(1234)] + others[3:]
    in_batch = run_steps(batch, target=3, steps=20, sampler_seed=5)
    assert in_batch == alone
    assert run_steps([seeded(4321)], target=0, steps=20, sampler_seed=0) != alone


def penalty_state(prompt, output, **knobs):
    state = new_state(SamplingParams(**knobs), prompt, None)
    state.output_ids.extend(output)
    return state


def test_penalties_exact_values():
    """Prompt [0, 1], output [2, 2, 4]: repetition on prompt+output, frequency/presence on output only."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]).expand(5, 6)
    prompt, output = [0, 1], [2, 2, 4]
    states = [
        penalty_state(prompt, output, repetition_penalty=2.0),
        penalty_state(prompt, output, frequency_penalty=0.5),
        penalty_state(prompt, output, presence_penalty=0.25),
        penalty_state(prompt, output, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        penalty_state(prompt, output),
    ]
    expected = torch.tensor([
        [1.0, -2.0, 0.25, 3.0, -4.0, 1.0],  # positive / 2, negative * 2, unseen 3 and 5 untouched
        [2.0, -1.0, -0.5, 3.0, -2.5, 1.0],  # 0.5 per occurrence in the output; the prompt does not count
        [2.0, -1.0, 0.25, 3.0, -2.25, 1.0],  # 0.25 once per generated token, however often
        [1.0, -2.0, -1.0, 3.0, -4.75, 1.0],  # 0.5/2 - 2*0.5 - 0.25; -2*2 - 0.5 - 0.25
        [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
    ])
    before = logits.clone()
    assert torch.equal(apply_penalties(logits, states), expected)
    assert torch.equal(logits, before)


def dense_penalties(logits: torch.Tensor, states) -> torch.Tensor:
    """The definitions as whole-vocabulary passes (the sampler's own code before it touched only seen tokens)."""
    def column(values):
        return torch.tensor(values, dtype=torch.float32).unsqueeze(1)

    rep = column([s.params.repetition_penalty for s in states])
    freq = column([s.params.frequency_penalty for s in states])
    presence = column([s.params.presence_penalty for s in states])
    counts, in_prompt = torch.zeros(logits.shape), torch.zeros(logits.shape, dtype=torch.bool)
    for row, state in enumerate(states):
        for token in state.output_ids:
            counts[row, token] += 1
        if state.params.repetition_penalty != 1:
            in_prompt[row, state.prompt_ids] = True
    generated = counts > 0
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(in_prompt | generated, repeated, logits) - freq * counts - presence * generated


def test_penalties_equal_the_dense_definitions_step_after_step():
    """Random rows of every penalty mix, prompts and outputs with repeats, over steps whose outputs grow:
    bit for bit the whole-vocabulary formulas (the same float32 operations in the same order)."""
    gen = torch.Generator().manual_seed(11)
    vocab, knobs = 300, [dict(), dict(repetition_penalty=1.3), dict(repetition_penalty=0.7), dict(frequency_penalty=0.4),
                         dict(presence_penalty=-0.6), dict(repetition_penalty=1.2, frequency_penalty=-0.3,
                                                           presence_penalty=1.5)]
    states = [new_state(SamplingParams(**knobs[i % len(knobs)]),
                        torch.randint(0, vocab, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist(),
                        None) for i in range(13)]
    for _ in range(5):
        for state in states:
            state.output_ids.extend(torch.randint(0, 60, (7,), generator=gen).tolist())  # repeats within and across steps
        logits = torch.randn(len(states), vocab, generator=gen) * 4
        before = logits.clone()
        assert torch.equal(apply_penalties(logits, states), dense_penalties(logits, states))
        assert torch.equal(logits, before)


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 1.2, 0.0]])
    state = penalty_state([], [1], temperature=0, presence_penalty=0.5)
    assert Sampler(3)(logits, [state]).tokens.tolist() == [0]
    assert Sampler(3)(logits, [penalty_state([], [1], temperature=0)]).tokens.tolist() == [1]


def test_min_tokens_masks_eos_and_stop_ids():
    eos, stop = 4, 3
    logits = torch.tensor([0.0, 1.0, 2.0, 5.0, 6.0]).expand(DRAWS, 5)
    params = SamplingParams(min_tokens=2, stop_token_ids=(stop,))
    early = [new_state(params, [], eos) for _ in range(DRAWS)]
    tokens = Sampler(5)(logits, early).tokens
    assert not ((tokens == eos) | (tokens == stop)).any()
    assert set(tokens.tolist()) == {0, 1, 2}
    # once min_tokens are out, EOS (the argmax) is back
    done = new_state(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(stop,)), [], eos)
    done.output_ids.extend([0, 1])
    assert Sampler(5)(logits[:1], [done]).tokens.tolist() == [eos]
    early_greedy = new_state(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(stop,)), [], eos)
    assert Sampler(5)(logits[:1], [early_greedy]).tokens.tolist() == [2]


def test_bad_words_mask_the_token_that_would_complete_one():
    """vLLM's bad_words: a one-token word is never sampled; a longer one's last token only right after the rest of it
    ends the output (never where the rest is elsewhere, or in the prompt); rows without bad words are untouched;
    log-probabilities stay the model's own."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 6.0]])
    params = SamplingParams(temperature=0, logprobs=1, bad_words_token_ids=((4,), (1, 2, 3)))

    def greedy(prompt, output, p=params):
        state = new_state(p, prompt, None)
        state.output_ids.extend(output)
        return Sampler(5)(logits, [state])

    assert greedy([], []).tokens.tolist() == [3]  # 4 is a word of its own
    assert greedy([1, 2], []).tokens.tolist() == [3]  # the prompt does not count
    assert greedy([], [2, 1]).tokens.tolist() == [3]
    out = greedy([], [0, 1, 2])
    assert out.tokens.tolist() == [2]  # 3 would complete (1, 2, 3)
    assert out.logprobs.tolist() == pytest.approx(torch.log_softmax(logits, -1)[0, [2]].tolist())
    plain = new_state(SamplingParams(temperature=0), [], None)
    both = Sampler(5)(torch.cat([logits, logits]), [plain, new_state(params, [], None)])
    assert both.tokens.tolist() == [4, 3]
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=((),))


def test_ignore_eos_does_not_mask_eos():
    state = new_state(SamplingParams(temperature=0, ignore_eos=True), [], 4)
    assert Sampler(5)(torch.tensor([[0.0, 1.0, 2.0, 5.0, 6.0]]), [state]).tokens.tolist() == [4]


def test_logprobs_come_from_raw_logits():
    raw = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 3
    knobs = [
        dict(logprobs=0, temperature=0.5, repetition_penalty=1.5),
        dict(logprobs=3, top_k=5, frequency_penalty=1.0),
        dict(),  # asks for nothing: its columns are junk but the call still works
        dict(logprobs=5, temperature=0, presence_penalty=2.0),
    ]
    states = [penalty_state([7, 8], [9, 9, 10], **k) for k in knobs]
    out = Sampler(50)(raw, states)
    expected = torch.log_softmax(raw, dim=-1)
    assert torch.allclose(out.logprobs, expected.gather(1, out.tokens[:, None]).squeeze(1))
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    for row, k in [(1, 3), (3, 5)]:
        top_values, top_ids = torch.topk(expected[row], k)
        assert out.top_ids[row, :k].tolist() == top_ids.tolist()
        assert torch.allclose(out.top_logprobs[row, :k], top_values)
        assert (out.top_logprobs[row, :k].diff() <= 0).all()


def test_rejects_wrong_shapes():
    sampler = Sampler(8)
    with pytest.raises(ValueError, match="logits must be"):
        sampler(torch.zeros(1, 9), [new_state(SamplingParams(), [], None)])
    with pytest.raises(ValueError, match="2 sampling states"):
        sampler(torch.zeros(1, 8), [new_state(SamplingParams(), [], None)] * 2)


def test_logit_bias_adds_each_rows_own_biases_before_the_penalties():
    """Every row's logit_bias added to its own logits, the other rows and tokens untouched, the raw logits left as
    they were (log-probabilities come from them); then the penalties, on the biased logits (vLLM's order)."""
    gen = torch.Generator().manual_seed(5)
    vocab = 300
    logits = torch.randn(4, vocab, generator=gen) * 3
    before = logits.clone()
    biases = [{7: -100.0, 250: 2.5}, {}, {0: 100.0, 299: -0.25, 7: 1.0}, {42: 3.0}]
    states = [new_state(SamplingParams(logit_bias=b, repetition_penalty=1.5 if r == 3 else 1.0), [42], None)
              for r, b in enumerate(biases)]
    expected = logits.clone()
    for r, bias in enumerate(biases):
        for token, value in bias.items():
            expected[r, token] += value
    assert torch.equal(sampler_module.apply_logit_bias(logits, states), expected)
    assert torch.equal(logits, before)
    # row 3: token 42 is in the prompt: its biased logit is then divided (positive) or multiplied by the penalty
    shaped = apply_penalties(sampler_module.apply_logit_bias(logits, states), states)
    value = expected[3, 42]
    assert shaped[3, 42] == (value / 1.5 if value > 0 else value * 1.5)
    assert sampler_module.apply_logit_bias(logits, [new_state(SamplingParams(), [], None)] * 4) is logits


def test_logit_bias_moves_greedy_and_sampled_choices_but_not_the_logprobs():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    greedy = dict(temperature=0, logprobs=1)
    out = Sampler(4)(logits, [new_state(SamplingParams(logit_bias={1: -100}, **greedy), [], None)])
    assert out.tokens.tolist() == [2]  # the runner-up, once the argmax is all but banned
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, dim=-1)[0, 2:3])  # the model's, not the bias's
    assert out.top_ids[0, 0] == 1  # the model's own most likely token
    assert Sampler(4)(logits, [new_state(SamplingParams(logit_bias={0: 100}, temperature=0), [], None)]).tokens == 0
    # sampled: +100 on the least likely token makes it (all but) certain; -100 on all but one leaves that one
    forced = [new_state(SamplingParams(logit_bias={0: 100}), [], None) for _ in range(2000)]
    assert set(Sampler(4, seed=3)(logits.expand(2000, 4), forced).tokens.tolist()) == {0}
    banned = [new_state(SamplingParams(logit_bias={0: -100, 1: -100, 2: -100}), [], None) for _ in range(2000)]
    assert set(Sampler(4, seed=3)(logits.expand(2000, 4), banned).tokens.tolist()) == {3}
    # a small bias moves the odds by exp(bias): token 3's probability, its logit raised by ln 2, is twice the rest's
    doubled = [new_state(SamplingParams(logit_bias={3: math.log(2.0)}), [], None) for _ in range(DRAWS)]
    p = torch.softmax(logits[0] + torch.tensor([0.0, 0.0, 0.0, math.log(2.0)]), dim=-1)
    counts = np.bincount(Sampler(4, seed=4)(logits.expand(DRAWS, 4), doubled).tokens.numpy(), minlength=4) / DRAWS
    assert tvd(counts, p.numpy()) < TVD_LIMIT


def test_allowed_token_ids_are_the_only_tokens_sampled_and_the_logprobs_stay_the_models():
    """vLLM's allowed_token_ids: greedy takes the best allowed token, sampling draws among the allowed ones with
    their renormalized odds, a row without a list is untouched in the same batch; logprobs are the raw logits'."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]])
    greedy = new_state(SamplingParams(temperature=0, logprobs=1, allowed_token_ids=[3, 0, 4]), [], None)
    plain = new_state(SamplingParams(temperature=0), [], None)
    out = Sampler(5)(logits.expand(2, 5), [greedy, plain])
    assert out.tokens.tolist() == [3, 1]  # row 0: the best of 0, 3, 4; row 1: the argmax of all
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits, dim=-1)[0, 3])
    assert out.top_ids[0, 0] == 1  # the model's own most likely token
    allowed = (0, 2, 4)
    rows = [new_state(SamplingParams(allowed_token_ids=allowed, logit_bias={4: math.log(3.0)}), [], None)
            for _ in range(DRAWS)]
    counts = np.bincount(Sampler(5, seed=6)(logits.expand(DRAWS, 5), rows).tokens.numpy(), minlength=5) / DRAWS
    expected = torch.full((5,), float("-inf"))
    expected[list(allowed)] = logits[0, list(allowed)]
    expected[4] += math.log(3.0)  # logit_bias after the mask, on an allowed token
    assert counts[[1, 3]].sum() == 0 and tvd(counts, torch.softmax(expected, dim=-1).numpy()) < TVD_LIMIT
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1])
    # min_tokens yields where the only allowed tokens are stop tokens (masking them would leave none at all)
    held = new_state(SamplingParams(temperature=0, allowed_token_ids=[3], stop_token_ids=[3], min_tokens=2), [], None)
    assert Sampler(5)(logits, [held]).tokens.tolist() == [3]


def test_logit_bias_is_checked_and_takes_a_dict_or_pairs():
    assert SamplingParams(logit_bias={5: 1, 9: -100}).logit_bias == ((5, 1.0), (9, -100.0))
    assert SamplingParams(logit_bias=[(5, 1)]) == SamplingParams(logit_bias={5: 1.0})
    for bad in ({5: 100.5}, {5: float("nan")}, {-1: 0}):
        with pytest.raises(ValueError, match="from -100 to 100"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="twice"):
        SamplingParams(logit_bias=((5, 1), (5, 2)))
