"""The engine with the real SmolLM2 model in float32: batching, chunking, prefix caching and preemption
change nothing about a greedy request's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from app.engine.core import EngineCore
from app.engine.executor import local_engine
from app.engine.kv_cache import KVCacheConfig
from app.engine.model_runner import ModelRunner
from app.engine.params import SamplingParams
from app.engine.request import FinishReason
from app.engine.scheduler import ScheduledRequest, SchedulerConfig, SchedulerOutput
from app.model.batch import make_batch
from app.model.loader import load_model
from app.model.source import resolve_source
from app.spec.schema import ModelSpec

BLOCK = 16
STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of the one "
         "hundred and twelve steps, listening to the sea hammer the rocks below, and wondering whether the "
         "ships that passed in the night ever thought of the small light that kept them from harm. ")


@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve_source(ModelSpec()), "float32")


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    tok = loaded.tokenizer
    texts = [
        "Hi", "The capital of France is", "List three primary colors:", "def add(a, b):",
        STORY, STORY * 2 + "In the morning,", "Translate to French: good night", "Water boils at",
        # four prompts sharing a long prefix (two full copies of the story), then different questions
        STORY * 2 + "Question: who climbed the stairs?", STORY * 2 + "Question: how many steps were there?",
        STORY * 2 + "Question: what did the keeper hear?", STORY * 2 + "Summary:",
        "1 2 3 4 5", "Once upon a time", STORY[:90], "Why is the sky blue?",
    ]
    return [tok(t).input_ids for t in texts]


def run_engine(loaded, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams, *,
               blocks: int = 2048, budget: int = 2048, seqs: int = 64, chunked: bool = True, prefix: bool = True,
               max_len: int = 8192) -> tuple[list[list[int]], EngineCore]:
    core = local_engine(loaded.model, KVCacheConfig(blocks, BLOCK, prefix_caching=prefix),
                        SchedulerConfig(seqs, budget, max_len, chunked), "smollm2")
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(str(i), ids, p, loaded.tokenizer.eos_token_id)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_work():
        for delta in core.step():
            tokens[delta.request_id].append(delta.token_id)
    assert core.kv.usage() == 0.0 and all(c == 0 for c in core.kv.pool.ref_count)  # nothing leaked
    return [tokens[str(i)] for i in range(len(prompts))], core


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(loaded, prompts) -> list[list[int]]:
    return [run_engine(loaded, [p], GREEDY)[0][0] for p in prompts]


def test_prompts_are_mixed_lengths(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] <= 2 and lengths[-1] > 100 and len(set(lengths)) >= 10


def test_batch_of_16_equals_each_alone(loaded, prompts, alone):
    together, _ = run_engine(loaded, prompts, GREEDY)
    assert together == alone


def test_shared_prefix_is_reused_and_changes_nothing(loaded, prompts, alone):
    # prompts 8-11 share two copies of the story; the first one caches it, the others find it
    first, core = run_engine(loaded, [prompts[8]], GREEDY)
    shared = run_engine_on(core, loaded, prompts[9:12])
    assert [first[0], *shared] == alone[8:12]
    story_blocks = len(loaded.tokenizer(STORY * 2).input_ids) // BLOCK
    assert core.kv.hits >= 3 * (story_blocks - 1) * BLOCK


def run_engine_on(core: EngineCore, loaded, prompts: list[list[int]]) -> list[list[int]]:
    """More requests through an engine that already ran some (its prefix cache is warm)."""
    for i, ids in enumerate(prompts):
        core.add_request(f"more-{i}", ids, GREEDY, loaded.tokenizer.eos_token_id)
    tokens: dict[str, list[int]] = {f"more-{i}": [] for i in range(len(prompts))}
    while core.has_work():
        for delta in core.step():
            tokens[delta.request_id].append(delta.token_id)
    return [tokens[f"more-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize(("name", "options"), [
    ("chunked prefill, small budget", dict(budget=48, chunked=True)),
    ("no chunked prefill", dict(budget=512, chunked=False)),
    ("no prefix caching", dict(prefix=False)),
])
def test_scheduling_options_do_not_change_tokens(loaded, prompts, alone, name, options):
    together, core = run_engine(loaded, prompts, GREEDY, **options)
    assert together == alone, name
    if options.get("budget") == 48:  # admitted over many steps: later prompts find the story cached
        assert core.kv.hits > 0


def test_preemption_under_a_small_cache_does_not_change_tokens(loaded, prompts, alone):
    total = sum(len(p) + 12 for p in prompts)
    together, core = run_engine(loaded, prompts, GREEDY, blocks=total // BLOCK // 3, max_len=1024)
    assert core.scheduler.num_preemptions > 0
    assert together == alone


def test_seeded_requests_reproduce_alone_and_in_a_batch(loaded, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    solo, _ = run_engine(loaded, [prompts[4]], seeded)
    mixed = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 5
    mixed[3] = seeded
    batch, _ = run_engine(loaded, prompts[:3] + [prompts[4]] + prompts[5:6], mixed)
    assert batch[3] == solo[0]
    other, _ = run_engine(loaded, [prompts[4]], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=10,
                                                               ignore_eos=True))
    assert other[0] != solo[0]


def test_prompt_too_long_is_rejected(loaded):
    from app.engine.core import RequestRejected

    core = local_engine(loaded.model, KVCacheConfig(64, BLOCK), SchedulerConfig(4, 256, 100, True), "m")
    with pytest.raises(RequestRejected, match="the prompt has 150 tokens; this model's context holds 100"):
        core.add_request("x", [5] * 150, GREEDY, 0)
    with pytest.raises(RequestRejected, match="empty"):
        core.add_request("y", [], GREEDY, 0)
    with pytest.raises(RequestRejected, match="token id 50000 is outside the vocabulary"):
        core.add_request("z", [5, 6], SamplingParams(stop_token_ids=(50000,), min_tokens=1), 0)
    with pytest.raises(RequestRejected, match="token id 49152 is outside the vocabulary"):
        core.add_request("b", [5, 6], SamplingParams(logit_bias={3: 1.0, 49152: -100}), 0)
    assert not core.has_work()
    torch.testing.assert_close(torch.tensor(core.kv.usage()), torch.tensor(0.0))


def test_a_model_that_gives_nan_logits_aborts_its_requests_and_the_engine_goes_on(loaded, prompts, alone, caplog):
    """A broken model (here: its final norm's weights NaN, as a damaged file's would be) makes NaN logits: its
    requests end as aborted, with no token and an error naming them, instead of a made-up token; their blocks
    leave the prefix cache (the prompt's earlier chunks had been cached); the engine, its KV cache and the next
    request, once the model is whole again, are unharmed."""
    core = local_engine(loaded.model, KVCacheConfig(256, BLOCK), SchedulerConfig(8, 64, 4096, True), "m")
    norm = loaded.model.norm
    whole = norm.clone()
    try:
        norm.fill_(float("nan"))  # in place: the native stack reads the same storage
        core.add_request("broken", prompts[5], GREEDY, loaded.tokenizer.eos_token_id)  # in 64-token chunks
        deltas, cached = [], 0
        with caplog.at_level("ERROR", logger="app.engine"):
            while core.has_work():
                deltas += core.step()
                cached = max(cached, len(core.kv.pool.by_hash))
    finally:
        norm.copy_(whole)
    assert [(d.request_id, d.token_id, d.finish_reason) for d in deltas] == [("broken", None, FinishReason.ABORT)]
    assert "no token could be sampled for request(s) broken (the model's logits were not finite" in caplog.text
    assert cached > 0 and not core.kv.pool.by_hash  # its chunks were findable, then forgotten
    assert core.kv.usage() == 0.0 and all(c == 0 for c in core.kv.pool.ref_count)
    assert run_engine_on(core, loaded, [prompts[5]]) == [alone[5]]


def test_structured_outputs_keep_their_grammar_through_batching_and_preemption(loaded, prompts):
    """Greedy requests held to a regex (structured outputs): in a batch whose KV cache is too small for all of them
    (preemptions, recomputed prompts) each gives the tokens it gives alone, every text matches the regex in full
    and ends with EOS (the grammar complete); a request whose grammar cannot be set up (an engine given no
    tokenizer) is aborted alone, and the others finish."""
    import re

    from app.engine.structured import grammar_for
    from app.model.tokenizer import tokenizer_json

    regex = r" ?[A-Za-z]+( [A-Za-z]+){2,5}\."
    params = SamplingParams(temperature=0, max_tokens=40, grammar=grammar_for("regex", regex))
    source = resolve_source(ModelSpec())

    def run(core, batch):
        for i, ids in enumerate(batch):
            core.add_request(str(i), ids, params, loaded.tokenizer.eos_token_id)
        out = {str(i): [] for i in range(len(batch))}
        reasons = {}
        while core.has_work():
            for delta in core.step():
                if delta.token_id is not None:
                    out[delta.request_id].append(delta.token_id)
                if delta.finish_reason is not None:
                    reasons[delta.request_id] = delta.finish_reason
        return [out[str(i)] for i in range(len(batch))], [reasons[str(i)] for i in range(len(batch))], core

    def engine(blocks, tokenizer=True):
        return local_engine(loaded.model, KVCacheConfig(blocks, BLOCK), SchedulerConfig(8, 64, 4096, True), "m",
                            tokenizer_json=(lambda: tokenizer_json(source)) if tokenizer else None)

    chosen = [prompts[i] for i in (0, 1, 3, 5, 7, 15)]
    alone = [run(engine(256), [ids])[0][0] for ids in chosen]
    together, reasons, core = run(engine(12), chosen)  # 12 blocks of 16 do not hold them all at once
    assert core.scheduler.num_preemptions > 0
    assert together == alone
    eos = loaded.tokenizer.eos_token_id
    for tokens, reason in zip(together, reasons, strict=True):
        assert reason == FinishReason.STOP and tokens[-1] == eos
        assert re.fullmatch(regex, loaded.tokenizer.decode(tokens[:-1])), loaded.tokenizer.decode(tokens)
    broken = engine(256, tokenizer=False)
    steps = []
    broken.executor.execute = lambda plan: steps.append(plan)  # (none expected: the grammars fail first)
    tokens, reasons, core = run(broken, chosen[:2])
    assert reasons == [FinishReason.ABORT] * 2 and tokens == [[], []]
    assert core.kv.usage() == 0.0 and steps == []  # aborted before their prompts were computed


def test_a_request_whose_grammar_outlasts_its_share_waits_while_another_runs(loaded, prompts, monkeypatch):
    """Each step reports its grammars' time for the requests that have one (RunnerOutput.grammar_seconds), and the
    core charges it to the scheduler: with GRAMMAR_SHARE next to nothing, the grammar's request, once charged beside
    a plain one, does not run again until the plain one has finished, and then gives the tokens it gives alone."""
    from app.engine import scheduler
    from app.engine.structured import grammar_for
    from app.model.tokenizer import tokenizer_json

    source = resolve_source(ModelSpec())
    held = SamplingParams(temperature=0, max_tokens=12, grammar=grammar_for("regex", r" ?[A-Za-z]+( [A-Za-z]+){2,5}\."))
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(requests):
        core = local_engine(loaded.model, KVCacheConfig(256, BLOCK), SchedulerConfig(8, 512, 4096, True), "m",
                            tokenizer_json=lambda: tokenizer_json(source))
        real, steps = core.executor.runner.execute, []

        def execute(output):
            result = real(output)
            steps.append(([r.request_id for r in output.requests], dict(result.grammar_seconds)))
            return result

        core.executor.runner.execute = execute
        for request_id, ids, params in requests:
            core.add_request(request_id, ids, params, loaded.tokenizer.eos_token_id)
        out = {request_id: [] for request_id, _, _ in requests}
        while core.has_work():
            for delta in core.step():
                if delta.token_id is not None:
                    out[delta.request_id].append(delta.token_id)
        return out, steps

    alone, _ = run([("g-0", prompts[0], held)])
    monkeypatch.setattr(scheduler, "GRAMMAR_SHARE", 1e-9)
    together, steps = run([("g-0", prompts[0], held), ("p-0", prompts[1], plain)])
    assert together["g-0"] == alone["g-0"] and len(together["p-0"]) == 8
    assert all(set(seconds) <= {"g-0"} and all(t > 0 for t in seconds.values()) for _, seconds in steps)
    assert all("g-0" in seconds for ids, seconds in steps if "g-0" in ids)
    plain_steps = [ids for ids, _ in steps if "p-0" in ids]  # (g-0 may start later: its grammar is compiled first)
    first = next(i for i, ids in enumerate(plain_steps) if "g-0" in ids)
    assert len(plain_steps) == 8 and first < 6
    assert all(ids == ["p-0"] for ids in plain_steps[first + 1:])  # g-0 held back from its first charge on


def test_a_grammar_compiled_for_a_waiting_request_is_its_own_past_the_compile_cache(loaded, prompts):
    """A request that waits (one sequence a step, another running) while 40 other grammars are compiled after its
    own: the cache of 32 compiled grammars has dropped its grammar by the time it starts, and it still starts from
    what was compiled for it, not compiled again on the engine's thread between steps."""
    import threading

    from app.engine.structured import grammar_for
    from app.model.tokenizer import tokenizer_json

    source = resolve_source(ModelSpec())
    core = local_engine(loaded.model, KVCacheConfig(256, BLOCK), SchedulerConfig(1, 64, 4096, True), "m",
                        tokenizer_json=lambda: tokenizer_json(source))
    grammars, threads = core.executor.grammars, []
    compile_one = grammars._compile
    grammars._compile = lambda *args: threads.append(threading.current_thread().name) or compile_one(*args)
    eos = loaded.tokenizer.eos_token_id
    core.add_request("plain", prompts[0], SamplingParams(temperature=0, max_tokens=2), eos)
    core.add_request("first", prompts[1], SamplingParams(temperature=0, max_tokens=2,
                                                          grammar=grammar_for("regex", "[0-9]+")), eos)
    for i in range(40):
        core.add_request(str(i), prompts[2], SamplingParams(temperature=0, max_tokens=1,
                                                            grammar=grammar_for("regex", f"[a-z]{{{i + 1}}}")), eos)
    finished = {}
    while core.has_work():
        finished.update({d.request_id: d.finish_reason for d in core.step() if d.finish_reason is not None})
    assert len(finished) == 42 and all(r != FinishReason.ABORT for r in finished.values())
    assert len(threads) == 41 and all(name.startswith("grammar") for name in threads), threads


def test_a_request_waits_for_its_grammar_while_others_run_and_a_failed_grammar_keeps_its_prefix(loaded, prompts):
    """A request whose grammar is still being compiled (app/engine/structured.py: on the grammar thread) is not
    admitted: another request runs to its end meanwhile, and the held one starts once its compilation is done,
    giving the tokens it gives with nothing held. A grammar that fails (it allows no token) aborts its request alone,
    and its prompt's blocks stay in the prefix cache (its keys and values are sound): the same prompt finds them."""
    from concurrent.futures import Future

    from app.engine.structured import grammar_for
    from app.model.tokenizer import tokenizer_json

    source = resolve_source(ModelSpec())
    eos = loaded.tokenizer.eos_token_id
    regex = SamplingParams(temperature=0, max_tokens=12, grammar=grammar_for("regex", r" ?[A-Za-z]+( [A-Za-z]+){2,5}\."))
    plain = SamplingParams(temperature=0, max_tokens=4)

    def engine():
        return local_engine(loaded.model, KVCacheConfig(256, BLOCK), SchedulerConfig(8, 64, 4096, True), "m",
                            tokenizer_json=lambda: tokenizer_json(source))

    def drain(core, until=lambda: False):
        out, reasons = {}, {}
        while core.has_work() and not until():
            for d in core.step():
                out.setdefault(d.request_id, []).extend([] if d.token_id is None else [d.token_id])
                if d.finish_reason is not None:
                    reasons[d.request_id] = d.finish_reason
        return out, reasons

    core = engine()  # nothing held: the two side by side
    core.add_request("held", prompts[1], regex, eos)
    core.add_request("plain", prompts[3], plain, eos)
    expected, _ = drain(core)

    core = engine()
    compiling = Future()
    core.executor.grammars.prepare = lambda grammar, eos_token_id: compiling  # a compilation that takes its time
    core.add_request("held", prompts[1], regex, eos)
    core.add_request("plain", prompts[3], plain, eos)
    first, reasons = drain(core, until=lambda: "plain" not in core.scheduler.requests)
    assert reasons == {"plain": FinishReason.LENGTH} and first == {"plain": expected["plain"]}
    held = core.scheduler.requests["held"]
    assert held in core.scheduler.waiting and held.num_computed_tokens == 0 and core.step() == []
    compiling.set_result(None)
    rest, reasons = drain(core)
    assert rest == {"held": expected["held"]} and reasons == {"held": FinishReason.STOP}

    del core.executor.grammars.prepare
    never = SamplingParams(temperature=0, max_tokens=4, grammar=grammar_for("regex", r"[^\s\S]"))
    story = prompts[4]  # several full blocks
    core.add_request("never", story, never, eos)
    out, reasons = drain(core)
    assert reasons == {"never": FinishReason.ABORT} and out == {"never": []}
    assert core.kv.pool.by_hash  # its prompt's blocks are still there to be found ...
    hits = core.kv.hits  # (tokens found in the cache)
    core.add_request("again", story, plain, eos)
    drain(core)
    assert core.kv.hits - hits >= (len(story) - 1) // BLOCK * BLOCK > 0  # ... and are


def test_a_broken_request_does_not_take_a_sound_ones_blocks_out_of_the_prefix_cache(loaded, prompts):
    """Two requests of one prompt computed in one step, the first's token unusable (NO_TOKEN, as NaN logits give):
    it is aborted and its blocks are not cached, while the second's, sound, are (the first must not claim the
    prompt's block hashes and then drop them): the prompt is found again."""
    from app.engine.sampler import NO_TOKEN

    core = local_engine(loaded.model, KVCacheConfig(256, BLOCK), SchedulerConfig(8, 512, 4096, True), "m")
    real = core.executor.runner.execute

    def execute(output):
        result = real(output)
        if "x" in result.sampled:
            result.sampled["x"] = NO_TOKEN
        return result

    core.executor.runner.execute = execute
    plain = SamplingParams(temperature=0, max_tokens=2)
    for request_id in ("x", "y"):
        core.add_request(request_id, prompts[4], plain, loaded.tokenizer.eos_token_id)
    reasons = {}
    while core.has_work():
        reasons.update({d.request_id: d.finish_reason for d in core.step() if d.finish_reason is not None})
    assert reasons == {"x": FinishReason.ABORT, "y": FinishReason.LENGTH}
    hits = core.kv.hits
    core.add_request("z", prompts[4], plain, loaded.tokenizer.eos_token_id)
    while core.has_work():
        core.step()
    assert core.kv.hits - hits >= (len(prompts[4]) - 1) // BLOCK * BLOCK > 0


def test_runner_stages_a_step_as_make_batch_does(loaded):
    """The runner's vectorised staging gives the same batch as the plain per-token reference, also when a
    narrower step follows a wider one in the same buffers."""
    runner = ModelRunner(loaded.model, KVCacheConfig(64, BLOCK), max_num_tokens=512, max_num_seqs=8)
    rng = random.Random(0)
    for seqs in (6, 3, 8, 1):
        requests = []
        for s in range(seqs):
            computed = rng.choice([0, 5, 16, 47, 130])
            new = rng.choice([1, 1, 7, 33])  # decode tokens and prefill chunks in one step
            blocks = rng.sample(range(64), -(-(computed + new) // BLOCK) + rng.choice([0, 1]))
            ids = tuple(rng.randrange(1000) for _ in range(new))
            prompt = rng.choice([0, new, new // 2])  # generated tokens, prompt tokens, or both (a recompute)
            requests.append(ScheduledRequest(str(s), ids, computed, tuple(blocks), sample=True, prompt_rows=prompt))
        batch, ids = runner._prepare(SchedulerOutput(tuple(requests)))
        expected = make_batch([r.block_ids for r in requests], [r.num_computed for r in requests],
                              [len(r.token_ids) for r in requests], BLOCK, [r.prompt_rows for r in requests])
        assert ids.tolist() == [t for r in requests for t in r.token_ids]
        for name in ("positions", "slot_mapping", "block_tables", "context_lens", "q_starts", "logit_indices",
                     "prompt_rows"):
            mine, reference = getattr(batch, name), getattr(expected, name)
            assert mine.dtype == reference.dtype and torch.equal(mine, reference), name


def test_runner_refuses_a_block_table_short_of_its_tokens(loaded):
    runner = ModelRunner(loaded.model, KVCacheConfig(64, BLOCK), max_num_tokens=512, max_num_seqs=8)
    short = ScheduledRequest("0", (1,) * 20, 0, (3,), sample=True)  # 20 tokens need two blocks of 16
    with pytest.raises(ValueError, match="does not cover"):
        runner._prepare(SchedulerOutput((short,)))


def test_prompt_logprobs_of_a_prompt_preempted_halfway(loaded, prompts):
    """A prompt scored in chunks, preempted after its first chunk and recomputed from the start with another request
    in the step: each position's logprob is read once, and all come with the first sampled token as one pass gives
    them (the same kernels: rows run each one's own way, however the step is cut)."""
    from app.engine.scheduler import NewRequest

    prompt = tuple(prompts[4][:40])  # the story's first 40 tokens
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    blocks = (5, 9, 2)

    def step(runner, requests, new=()):
        return runner.execute(SchedulerOutput(tuple(requests), new_requests=tuple(new)))

    def part(start, end, sample=False, request_id="r"):
        return ScheduledRequest(request_id, prompt[start:end], start, blocks, sample, end - start)

    one = ModelRunner(loaded.model, KVCacheConfig(64, BLOCK), max_num_tokens=512, max_num_seqs=8)
    alone = step(one, [part(0, 40, True)], [NewRequest("r", prompt, params, None)])
    whole = alone.prompt_logprobs["r"]
    cut = ModelRunner(loaded.model, KVCacheConfig(64, BLOCK), max_num_tokens=512, max_num_seqs=8)
    first = step(cut, [part(0, 12)], [NewRequest("r", prompt, params, None)])
    assert first.prompt_logprobs == {} and first.sampled == {}
    other = ScheduledRequest("o", prompt[:7], 0, (11,), True, 7)  # a request without prompt logprobs beside it
    again = step(cut, [other, part(0, 25)], [NewRequest("o", prompt[:7], SamplingParams(max_tokens=2), None)])
    assert "r" not in again.prompt_logprobs and "o" not in again.prompt_logprobs
    last = step(cut, [part(25, 40, True)])
    scored = last.prompt_logprobs["r"]
    assert last.sampled == alone.sampled
    assert len(scored) == len(whole) == 40 and scored[0] is None and whole[0] is None
    for a, b in zip(whole[1:], scored[1:], strict=True):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4) and [t for t, _ in b.top] == [t for t, _ in a.top]
        assert b.rank == a.rank
    assert step(cut, [ScheduledRequest("r", (last.sampled["r"],), 40, blocks, True)]).prompt_logprobs == {}


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_pooled_embedding_of_a_prompt_preempted_halfway(loaded, prompts, pooling):
    """An embedding pooled over the prompt ("mean", "cls"), its prompt computed in chunks, preempted after its first
    chunk and recomputed from the start beside another request: each position's hidden state is counted once, and
    the vector that comes with the first sampled token is the one pass's (and not the last token's)."""
    from app.engine.scheduler import NewRequest

    prompt = tuple(prompts[4][:40])
    params = SamplingParams(temperature=0, max_tokens=1, embed=True, pooling=pooling)
    blocks = (5, 9, 2)

    def step(runner, requests, new=()):
        return runner.execute(SchedulerOutput(tuple(requests), new_requests=tuple(new)))

    def part(start, end, sample=False):
        return ScheduledRequest("r", prompt[start:end], start, blocks, sample, end - start)

    def runner():
        return ModelRunner(loaded.model, KVCacheConfig(64, BLOCK), max_num_tokens=512, max_num_seqs=8)

    whole = torch.tensor(step(runner(), [part(0, 40, True)], [NewRequest("r", prompt, params, None)]).embeddings["r"])
    last = torch.tensor(step(runner(), [part(0, 40, True)],
                             [NewRequest("r", prompt, SamplingParams(max_tokens=1, embed=True), None)]).embeddings["r"])
    cut = runner()
    assert step(cut, [part(0, 12)], [NewRequest("r", prompt, params, None)]).embeddings == {}
    other = ScheduledRequest("o", prompt[:7], 0, (11,), True, 7)
    again = step(cut, [other, part(0, 25)], [NewRequest("o", prompt[:7], SamplingParams(max_tokens=2), None)])
    assert again.embeddings == {}
    got = torch.tensor(step(cut, [part(25, 40, True)]).embeddings["r"])
    assert abs(float(got.norm()) - 1) < 1e-5 and float(got @ whole) > 0.99999, float(got @ whole)
    assert float(got @ last) < 0.99
