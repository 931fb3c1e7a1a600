"""Speculative decoding by n-gram lookup (app/engine/speculative.py): the lookup against a brute-force reference,
the scheduler's limits on drafts, and the engine's output with drafts against the same engine's without them (the
same tokens greedy and seeded, the same logprobs, stops and lengths), drafts being taken and missed."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.kv_cache import KVCacheConfig, KVCacheManager
from app.engine.model_runner import ModelRunner
from app.engine.request import Request
from app.engine.sampler import Sampler, new_state
from app.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from app.engine.speculative import SpeculativeConfig
from app.spec.schema import Spec


def _reference(tokens: list[int], cfg: SpeculativeConfig, limit: int) -> tuple[int, ...]:
    """The lookup as its definition reads: the longest suffix (lookup_max down to lookup_min) that occurred before,
    at its latest earlier start; the tokens after it."""
    count = min(cfg.num_tokens, limit)
    if count <= 0:
        return ()
    for n in range(cfg.lookup_max, cfg.lookup_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + count])
    return ()


def test_the_lookup_is_the_longest_latest_earlier_occurrence_of_the_suffix():
    rng = random.Random(0)
    cfg = SpeculativeConfig(num_tokens=3, lookup_min=1, lookup_max=4)
    found = 0
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        limit = rng.randrange(0, 5)
        expected = _reference(tokens, cfg, limit)
        assert cfg.propose(tokens, limit) == expected, (tokens, limit)
        found += bool(expected)
    assert found > 1000  # (most cases had something to propose)


def test_the_lookup_cases_by_hand():
    cfg = SpeculativeConfig(num_tokens=3, lookup_min=2, lookup_max=3)
    assert cfg.propose([1, 2, 3, 4, 5, 1, 2], 3) == (3, 4, 5)
    assert cfg.propose([1, 2, 3, 9, 1, 2, 7, 1, 2], 3) == (7, 1, 2)  # the latest occurrence
    assert cfg.propose([5, 1, 2, 8, 4, 1, 2, 9, 5, 1, 2], 3) == (8, 4, 1)  # the longest suffix (5 1 2) wins
    assert cfg.propose([1, 2, 3, 1, 2], 1) == (3,)  # the limit
    assert cfg.propose([1, 2, 3, 4, 2], 3) == ()  # one token matches: shorter than lookup_min
    assert cfg.propose([7, 7], 3) == ()
    assert cfg.propose([1, 2, 1, 2], 3) == (1, 2)  # what follows runs to the end


def _scheduler(spec: SpeculativeConfig | None, blocks: int = 64, max_len: int = 256) -> Scheduler:
    kv = KVCacheManager(KVCacheConfig(blocks, 16))
    return Scheduler(SchedulerConfig(8, 256, max_len, speculative=spec), kv)


def _decoding(sched: Scheduler, request_id: str, prompt: list[int], params: SamplingParams, *more) -> Request:
    """Requests (request_id, prompt, params, then more such triples) whose prompts are computed and whose first
    token (6) is out: the next step decodes them. Returns the first."""
    requests = [Request(*more[i:i + 3]) for i in range(0, len(more), 3)]
    requests.insert(0, Request(request_id, prompt, params))
    for request in requests:
        sched.add(request)
    while any(not r.output_ids for r in requests):
        out = sched.schedule()
        sched.update(out, {r.request_id: 6 for r in out.requests if r.sample})
    return requests[0]


REPEATING = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]  # and 6, the first output: "3 4 5 6" occurred, and 1 2 3 after it


def test_a_decoding_request_gets_drafts_within_max_tokens_and_the_context():
    sched = _scheduler(SpeculativeConfig(num_tokens=3))
    # b: 1 out, 2 to go: one draft and its token
    _decoding(sched, "a", REPEATING, SamplingParams(max_tokens=10), "b", REPEATING, SamplingParams(max_tokens=3))
    step = {r.request_id: r for r in sched.schedule().requests}
    assert step["a"].draft_ids == (1, 2, 3) and step["a"].token_ids == (6, 1, 2, 3) and step["a"].sample
    assert step["b"].draft_ids == (1,) and step["b"].token_ids == (6, 1)
    short = _scheduler(SpeculativeConfig(num_tokens=3), max_len=len(REPEATING) + 3)
    _decoding(short, "c", REPEATING, SamplingParams(max_tokens=None))
    assert short.schedule().requests[0].draft_ids == (1,)  # 12 tokens of 14: one draft and its token fill it


def test_no_drafts_past_the_batch_limit_or_off():
    sched = _scheduler(None)
    _decoding(sched, "a", REPEATING, SamplingParams())
    assert sched.schedule().requests[0].draft_ids == ()
    sched = _scheduler(SpeculativeConfig(max_batch=2))
    _decoding(sched, "a", REPEATING, SamplingParams(), "b", REPEATING, SamplingParams(), "c", REPEATING,
              SamplingParams())
    assert all(r.draft_ids == () for r in sched.schedule().requests)


def test_drafts_take_no_blocks_from_others():
    # one block of 16, the prompt and its first token filling it: a draft would need a second block
    sched = _scheduler(SpeculativeConfig(num_tokens=8, lookup_min=1), blocks=1)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6]
    request = _decoding(sched, "a", prompt, SamplingParams(max_tokens=20))
    assert sched.cfg.speculative.propose(request.token_ids(), 8)  # there is something to draft
    step = sched.schedule()
    assert step.requests[0].draft_ids == () and step.preempted == ()
    # a draft is cut to what the block it holds still takes: 11 tokens computed, the next and 4 drafts fill it
    sched = _scheduler(SpeculativeConfig(num_tokens=8, lookup_min=1), blocks=1)
    _decoding(sched, "a", REPEATING, SamplingParams(max_tokens=20))
    assert sched.schedule().requests[0].draft_ids == (1, 2, 3, 4)


def test_drafts_come_after_every_real_token_and_admission():
    # a's drafts would take the one free block that b's next token needs, and the step's tokens the others' need
    sched = _scheduler(SpeculativeConfig(num_tokens=16, lookup_min=1), blocks=4)
    prompt_b = list(range(100, 132))  # 32 in two blocks: its first token opens its third
    _decoding(sched, "a", REPEATING, SamplingParams(max_tokens=40), "b", prompt_b, SamplingParams(max_tokens=40))
    step = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in step.requests] == [("a", 5), ("b", 1)]  # a: what its block takes
    assert step.preempted == ()
    sched = Scheduler(SchedulerConfig(4, 4, 256, speculative=SpeculativeConfig(num_tokens=16, lookup_min=1)),
                      KVCacheManager(KVCacheConfig(64, 16)))
    _decoding(sched, "a", REPEATING, SamplingParams(max_tokens=40), "b", [7, 8], SamplingParams(max_tokens=40),
              "c", [9, 10], SamplingParams(max_tokens=40))
    sched.add(Request("d", [11], SamplingParams(max_tokens=40)))
    step = sched.schedule()  # 4 tokens a step: the three decodes' and d's prompt; nothing left for drafts
    assert [(r.request_id, len(r.token_ids)) for r in step.requests] == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_the_blocks_of_rejected_drafts_are_given_back():
    kv = KVCacheManager(KVCacheConfig(8, 16))
    sched = Scheduler(SchedulerConfig(8, 256, 256, speculative=SpeculativeConfig(num_tokens=8, lookup_min=1)), kv)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]  # and its first token 6: drafts 7 8 9 10 1 2 6
    request = _decoding(sched, "a", prompt, SamplingParams(max_tokens=40))
    free = kv.num_free_blocks()
    step = sched.schedule()
    assert step.requests[0].draft_ids == (7, 8, 9, 10, 1, 2, 6) and len(step.requests[0].block_ids) == 2
    sched.update(step, {"a": 3}, {"a": [7]})  # one taken: 15 tokens, the next one's slot in the first block
    assert request.num_computed_tokens == 14 and request.output_ids == [6, 7, 3]
    assert len(kv.block_ids("a")) == 1 and kv.num_free_blocks() == free


def test_an_update_keeps_the_drafts_taken_and_stops_inside_them():
    sched = _scheduler(SpeculativeConfig(num_tokens=3))
    request = _decoding(sched, "a", REPEATING, SamplingParams(max_tokens=10, stop_token_ids=(2,)))
    step = sched.schedule()
    assert step.requests[0].draft_ids == (1, 2, 3)
    finished = sched.update(step, {"a": 9}, {"a": [1, 2]})  # 1 and then the stop token 2 taken: it ends there
    assert finished == [request] and request.output_ids == [6, 1, 2] and request.finish_reason.value == "stop"
    sched = _scheduler(SpeculativeConfig(num_tokens=3))
    other = _decoding(sched, "b", REPEATING, SamplingParams(max_tokens=10))
    step = sched.schedule()
    sched.update(step, {"b": 9}, {"b": [1]})
    # its prompt, its first token, the draft kept: computed; the token after it is the next step's
    assert other.output_ids == [6, 1, 9] and other.num_computed_tokens == len(REPEATING) + 2
    assert sched.num_draft_tokens == 3 and sched.num_accepted_tokens == 1
    assert sched.schedule().requests[0].token_ids[0] == 9


def test_a_request_whose_drafts_miss_pauses_then_probes_with_one_draft():
    sched = _scheduler(SpeculativeConfig(num_tokens=3, lookup_min=1, max_backoff=4))
    _decoding(sched, "a", (list(range(1, 7)) * 6)[:-1], SamplingParams(max_tokens=200))  # 1 to 6 over and over
    seen = []
    for step_number in range(17):
        step = sched.schedule()
        draft = step.requests[0].draft_ids
        seen.append(len(draft))
        if step_number == 15:  # the 16th step's draft is taken
            sched.update(step, {"a": 5}, {"a": list(draft)})
        else:  # else every draft misses: the token sampled is another of 1 to 6 (so there is always a lookup)
            sched.update(step, {"a": (draft[0] + 2) % 6 + 1 if draft else 3}, {})
    # 3 drafts, a miss: a pause of 1 step, then a draft of 1; a miss: 2 steps, 1; a miss: 4 (the most), 1; ...
    assert seen == [3, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3]


def test_the_spec_section_names_what_is_wrong():
    assert Spec.model_validate({}).scheduler.speculative.config() is None
    on = Spec.model_validate({"scheduler": {"speculative": {"method": "ngram", "num_speculative_tokens": 5}}})
    assert on.scheduler.speculative.config() == SpeculativeConfig(5, 2, 4, 4)
    with pytest.raises(Exception, match="prompt_lookup_min"):
        Spec.model_validate({"scheduler": {"speculative": {"method": "ngram", "prompt_lookup_min": 5}}})


def _verify(params: SamplingParams, draft: tuple[int, ...], rows: list[dict[int, float]]):
    """The runner's verification of one request (prompt [5], output [6] so far) with these drafts, its rows' logits
    -9 but where `rows` says."""
    runner = ModelRunner.__new__(ModelRunner)  # (what _verify uses of a runner: its sampler)
    runner.sampler = Sampler(8)
    logits = torch.full((len(rows), 8), -9.0)
    for i, row in enumerate(rows):
        for token, value in row.items():
            logits[i, token] = value
    state = new_state(params, [5], None)
    state.output_ids.append(6)
    step = ScheduledRequest("r", (6, *draft), 2, (0,), True, 0, draft)
    return runner._verify([step], [state], logits, [0]), state


def test_each_drafts_row_is_sampled_as_if_the_drafts_before_it_were_output():
    # row 1's token 1 is best but for the repetition penalty, which holds it only if the draft 1 before it counts
    rows = [{1: 4.0}, {1: 3.0, 2: 2.0}, {3: 1.0}]
    out, state = _verify(SamplingParams(temperature=0, repetition_penalty=2.0), (1, 1), rows)
    assert out.accepted == {"r": [1]} and out.sampled == {"r": 2} and state.output_ids == [6, 1, 2]
    out, state = _verify(SamplingParams(temperature=0), (1, 1), rows)  # without the penalty: both drafts taken
    assert out.accepted == {"r": [1, 1]} and out.sampled == {"r": 3} and state.output_ids == [6, 1, 1, 3]
    # min_tokens 3: the stop id 4 is held in row 1 (two outputs with the draft before it); min_tokens 2: it is not
    rows = [{1: 1.0}, {4: 5.0, 2: 1.0}, {3: 1.0}]
    out, _ = _verify(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(4,)), (1, 2), rows)
    assert out.accepted == {"r": [1, 2]} and out.sampled == {"r": 3}  # row 1: 2 outputs, the stop id held
    out, _ = _verify(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(4,)), (1, 2), rows)
    assert out.accepted == {"r": [1]} and out.sampled == {"r": 4}


# --- the engine: with drafts against without ---

PROMPTS = ["The list of fruits: apples, bananas, cherries, dates, figs. Again, the list of fruits: apples,",
           "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
           "Once upon a time"]


@pytest.fixture(scope="module")
def llm():
    with LLM(model={"dtype": "float32"}, kv_cache={"memory": "512MiB", "dtype": "float32"}, bind_threads=False) as llm:
        yield llm


def _both(llm: LLM, prompts, params: SamplingParams):
    """The outputs without drafts, then with them, and the drafts computed and kept in that run."""
    sched = llm.core.scheduler
    plain = replace(sched.cfg, speculative=None)
    sched.cfg = plain
    try:
        without = llm.generate(prompts, params)
        sched.cfg = replace(plain, speculative=SpeculativeConfig(num_tokens=4, lookup_min=1))
        drafts, kept = sched.num_draft_tokens, sched.num_accepted_tokens
        with_drafts = llm.generate(prompts, params)
        return without, with_drafts, sched.num_draft_tokens - drafts, sched.num_accepted_tokens - kept
    finally:
        sched.cfg = plain


def test_greedy_tokens_and_logprobs_are_those_without_drafts(llm):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    without, with_drafts, drafts, kept = _both(llm, PROMPTS, params)
    assert kept >= 8 and drafts > kept  # drafts were taken, and some missed
    for a, b in zip(without, with_drafts, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(b.outputs[0].token_ids) == 48
        assert b.outputs[0].text == a.outputs[0].text
        assert len(b.outputs[0].logprobs) == 48
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert y.logprob == pytest.approx(x.logprob, abs=2e-3)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


def test_an_embedding_beside_drafts_is_the_one_without_them(llm):
    """An embedding request (max_tokens 1) whose prompt ends in a step in which another request drafts."""
    core, tokenizer = llm.core, llm.tokenizer
    sched = core.scheduler
    plain = replace(sched.cfg, speculative=None)
    embed = SamplingParams(temperature=0, max_tokens=1, embed=True)
    vectors = {}
    try:
        for spec in (None, SpeculativeConfig(lookup_min=1)):
            sched.cfg = replace(plain, speculative=spec)
            core.add_request("gen", tokenizer(PROMPTS[1]).input_ids,
                             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), llm.eos_token_id)
            while not sched.requests["gen"].output_ids or not SpeculativeConfig(lookup_min=1).propose(
                    sched.requests["gen"].token_ids(), 4):
                core.step()
            core.add_request("emb", tokenizer("Paris is the capital of France.").input_ids, embed, llm.eos_token_id)
            drafts = sched.num_draft_tokens
            got = [d for d in core.step() if d.request_id == "emb"]
            assert (sched.num_draft_tokens > drafts) == (spec is not None)  # its step had drafts (or not)
            vectors[spec is None] = got[0].embedding
            while core.has_work():
                core.step()
    finally:
        sched.cfg = plain
    assert vectors[False] is not None and vectors[False] == pytest.approx(vectors[True], abs=1e-4)


def test_seeded_samples_penalties_and_min_tokens_are_those_without_drafts(llm):
    for params in [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=3),
                   SamplingParams(temperature=0.7, max_tokens=40, seed=11, frequency_penalty=0.5, min_tokens=30),
                   SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.3)]:
        without, with_drafts, drafts, _ = _both(llm, PROMPTS, params)
        assert drafts > 0, params
        for a, b in zip(without, with_drafts, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, params
            assert b.outputs[0].finish_reason == a.outputs[0].finish_reason


def test_structured_outputs_with_drafts_are_those_without(llm):
    """Grammars' answers (a regex that repeats, a JSON schema, greedy and seeded): each draft's row is masked by the
    grammar advanced through the drafts before it, and the drafts kept advance the request's matcher."""
    from app.engine.structured import grammar_for

    repeat = grammar_for("regex", r"( ?(apples|bananas|cherries|dates|figs),){3,6}")
    schema = grammar_for("json", {"type": "object", "properties": {"fruits": {"type": "array", "items": {
        "type": "string", "enum": ["apples", "bananas", "cherries", "dates", "figs"]}, "minItems": 3, "maxItems": 6}},
        "required": ["fruits"]})
    kept = 0
    for grammar in (repeat, schema):
        for params in (SamplingParams(temperature=0, max_tokens=80, grammar=grammar),
                       SamplingParams(temperature=0.8, max_tokens=80, seed=4, grammar=grammar, logprobs=1)):
            without, with_drafts, _, taken = _both(llm, PROMPTS[:1], params)
            kept += taken
            a, b = without[0].outputs[0], with_drafts[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
            assert a.finish_reason == "stop"  # each grammar was complete (not cut by max_tokens)
    assert kept > 10


def test_a_stop_inside_the_drafts_ends_where_it_would_have(llm):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    reference = llm.generate(PROMPTS[:1], greedy)[0].outputs[0]
    stop_token = reference.token_ids[30]  # a token that comes again past the first outputs: drafts would hold it
    text = llm.tokenizer.decode(reference.token_ids[20:23])
    for params in [replace(greedy, stop_token_ids=(stop_token,)), replace(greedy, stop=(text,)),
                   replace(greedy, max_tokens=17)]:
        without, with_drafts, drafts, _ = _both(llm, PROMPTS[:1], params)
        assert drafts > 0
        a, b = without[0].outputs[0], with_drafts[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
