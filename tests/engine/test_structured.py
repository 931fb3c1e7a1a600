"""Structured outputs' engine side (app/engine/structured.py and the sampler's grammar masks) with llguidance and
the default model's real tokenizer: masks, failures, the compile cache, choices with regex characters."""

from __future__ import annotations

import time

import pytest
import torch

from app.engine.params import SamplingParams
from app.engine.sampler import GRAMMAR_FAILED, Sampler, new_state
from app.engine.structured import Grammars, allowed_tokens, grammar_for
from app.model.source import resolve_source
from app.model.tokenizer import load_exported, tokenizer_json
from app.spec.schema import ModelSpec

VOCAB = 49152


@pytest.fixture(scope="module")
def text():
    return tokenizer_json(resolve_source(ModelSpec()))


@pytest.fixture(scope="module")
def hf(text, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    (folder / "tokenizer.json").write_text(text)
    return load_exported(folder)


@pytest.fixture(scope="module")
def grammars(text, hf):
    return Grammars(lambda: text, VOCAB)


def test_masks_keep_each_row_to_its_grammar_and_a_failed_grammar_gets_no_token(grammars, hf):
    """Three rows: free, held to a regex, held to a regex nothing can match (llguidance fails inside its mask
    computation and would allow EOS alone: the row must get no token, not end as if complete)."""
    eos = hf.eos_token_id
    digits = grammars.matcher(grammar_for("regex", r"[0-9]{2}"), eos)
    never = grammars.matcher(grammar_for("regex", r"[^\s\S]"), eos)
    states = [new_state(SamplingParams(temperature=0, logprobs=0), [], eos),
              new_state(SamplingParams(temperature=0, logprobs=0), [], eos, digits),
              new_state(SamplingParams(temperature=0, logprobs=0), [], eos, never)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    allowed, failed = allowed_tokens([grammars.matcher(grammar_for("regex", r"[0-9]{2}"), eos)], VOCAB)
    assert failed == [] and 0 < allowed[0].sum() < 200
    assert all(hf.decode([t]).isdigit() for t in allowed[0].nonzero()[0].tolist())
    out = Sampler(VOCAB)(logits, states)
    assert torch.equal(logits, raw)  # the masks never touch the model's logits
    expected = logits[1].masked_fill(~torch.from_numpy(allowed[0]), float("-inf")).argmax()
    assert out.tokens.tolist() == [int(raw[0].argmax()), int(expected), GRAMMAR_FAILED]
    # logprobs: the model's where no grammar holds the row, else among the tokens the grammar allows (as vLLM's)
    held = raw[1].masked_fill(~torch.from_numpy(allowed[0]), float("-inf")).log_softmax(-1)
    assert torch.allclose(out.logprobs[0], torch.log_softmax(raw[0], -1)[out.tokens[0]])
    assert torch.allclose(out.logprobs[1], held[out.tokens[1]]) and out.logprobs[1] > raw[1].log_softmax(-1).max()
    assert torch.isfinite(out.logprobs[2])  # (the failed grammar's row: no token, but no NaN either)


def test_each_sequence_gets_its_own_matcher_of_a_grammar_compiled_once(grammars, hf):
    grammar = grammar_for("choice", ["a+b (c)?", "[x]|y", "plain"])
    first, second = grammars.matcher(grammar, hf.eos_token_id), grammars.matcher(grammar, hf.eos_token_id)
    assert first is not second and list(grammars._compiled).count(grammar) == 1
    for choice in ("a+b (c)?", "[x]|y", "plain"):  # regex characters stand for themselves
        matcher = grammars.matcher(grammar, hf.eos_token_id)
        assert matcher.consume_tokens(hf(choice, add_special_tokens=False).input_ids) and matcher.is_accepting()
    assert first.consume_tokens(hf("plain", add_special_tokens=False).input_ids) and first.is_accepting()
    assert not second.is_accepting()  # untouched by its sibling
    assert not grammars.matcher(grammar, hf.eos_token_id).consume_tokens(hf("a+b (c)", add_special_tokens=False)
                                                                          .input_ids[:1] + [hf("z").input_ids[0]])


def test_the_tokenizer_and_the_grammars_are_made_on_the_grammar_thread(text, hf):
    """`warm` builds the tokenizer on the grammar thread, not the caller's (the engine's step loop), and `prepare`
    compiles there too: once its future is done, `matcher` copies the compiled grammar without compiling again."""
    import threading

    threads = []
    grammars = Grammars(lambda: threads.append(threading.current_thread().name) or text, VOCAB)
    try:
        grammars.warm(hf.eos_token_id)
        grammar = grammar_for("regex", "[0-9]+")
        compiling = grammars.prepare(grammar, hf.eos_token_id)
        compiling.result(timeout=60)
        assert len(threads) == 1 and threads[0].startswith("grammar") and threads[0] != threading.current_thread().name
        compiled = grammars._compiled[grammar]
        matcher = grammars.matcher(grammar, hf.eos_token_id)
        assert grammars._compiled[grammar] is compiled and matcher is not compiled
        assert matcher.consume_tokens(hf("42", add_special_tokens=False).input_ids) and matcher.is_accepting()
        # a grammar that cannot be compiled: a failed matcher for its requests, the next grammar unharmed
        bad = grammars.prepare("%% not a grammar", hf.eos_token_id).result(timeout=60)
        assert grammars.matcher("%% not a grammar", hf.eos_token_id).is_error() and bad.is_error()
        assert not grammars.matcher(grammar_for("regex", "a"), hf.eos_token_id).is_error()
    finally:
        grammars.close()


def test_the_frontend_builds_its_grammar_tokenizer_on_its_thread_when_warmed(hf):
    """AsyncTokenizer.warm_grammars (the server's start) builds llguidance's tokenizer on the tokenizer's thread,
    without holding up the caller; the grammar checks then use it, not a new one."""
    import asyncio

    from app.server.tokenizer import AsyncTokenizer

    text = AsyncTokenizer(hf, 8192, None)
    try:
        assert text._grammar_tokenizer is None
        text.warm_grammars()
        built = text._pool.submit(lambda: text._grammar_tokenizer).result(timeout=60)  # (queued after the build)
        assert built is not None and built.vocab_size == VOCAB
        asyncio.run(text.grammar("regex", "[ab]+", "structured_outputs"))
        assert text._grammar_tokenizer is built
    finally:
        text.close()


def test_the_engines_warm_start_reads_the_cached_export_and_its_eos_as_transformers_does(text):
    """What the serving engine builds its grammar tokenizer from (app/engine/process.py `warm_grammars`): the
    cached export's tokenizer.json and the EOS id transformers reads from it (SmolLM2's <|im_end|>, 2), or nothing
    where the cache has no export (then nothing is converted)."""
    from app.model.source import ModelSource
    from app.model.tokenizer import cache_entry, cached_export

    source = resolve_source(ModelSpec())
    exported, eos = cached_export(source)  # (the text fixture's export went into the cache)
    assert exported == text and eos == load_exported(cache_entry(source)).eos_token_id == 2
    assert cached_export(ModelSource(source.path.parent / "elsewhere.gguf", "gguf", "x")) is None


def test_a_warm_start_from_an_export_that_went_away_leaves_the_first_grammar_to_build_it(text, hf):
    """Grammars.warm_from (the serving engine's start) reads the export on the grammar thread; where it is gone by
    then, nothing fails for good: the first grammar builds the tokenizer from the engine's own source, as without
    a warm start."""
    threads = []
    gone = Grammars(lambda: threads.append(1) or text, VOCAB)
    try:
        gone.warm_from(lambda: None, "as the engine started")
        gone._tokenizer.result(timeout=60)  # (read and found gone before the first grammar comes)
        grammar = grammar_for("regex", "[0-9]+")
        assert not gone.prepare(grammar, hf.eos_token_id).result(timeout=60).is_error()
        assert threads == [1] and not gone.matcher(grammar, hf.eos_token_id).is_error()
    finally:
        gone.close()
    warm = Grammars(None, VOCAB)  # no source of its own: the export is all it has
    try:
        warm.warm_from(lambda: (text, hf.eos_token_id), "as the engine started")
        assert not warm.matcher(grammar_for("regex", "a+"), hf.eos_token_id).is_error()
    finally:
        warm.close()


def test_an_engine_without_a_tokenizer_fails_the_request_once_and_says_why():
    calls = []
    broken = Grammars(lambda: calls.append(1) or "not a tokenizer", VOCAB)
    for _ in range(3):
        matcher = broken.matcher(grammar_for("regex", "a"), 0)
        assert matcher.is_error() and "no tokenizer for structured outputs" in matcher.get_error()
    assert calls == [1]  # not tried again on every request


def test_the_frontend_checks_each_grammar_once_and_still_refuses_bad_ones(hf, monkeypatch):
    """AsyncTokenizer.grammar: a grammar checked once is not checked again (a client sends its schema or tools every
    turn); a bad one is a 400 every time, remembered as bad (a client that sends it again costs no check)."""
    import asyncio

    from app.engine import structured
    from app.server.errors import APIError
    from app.server.tokenizer import AsyncTokenizer

    checks = []
    real = structured.check_grammar
    monkeypatch.setattr(structured, "check_grammar", lambda g, t: checks.append(g) or real(g, t))
    text = AsyncTokenizer(hf, 8192, None)
    try:
        first = asyncio.run(text.grammar("regex", "[ab]+", "structured_outputs"))
        assert asyncio.run(text.grammar("regex", "[ab]+", "structured_outputs")) == first and len(checks) == 1
        for _ in range(2):
            with pytest.raises(APIError, match="cannot constrain"):
                asyncio.run(text.grammar("json", {"type": "nonsense"}, "response_format"))
        assert len(checks) == 2
        # one refused as too slow (a SlowGrammar: perhaps a busy moment's) is tried again every time
        trials = []
        monkeypatch.setattr(structured, "first_mask_problem",
                            lambda g, t: trials.append(g) or structured.SlowGrammar("too slow"))
        for _ in range(2):
            with pytest.raises(APIError, match="too slow"):
                asyncio.run(text.grammar("regex", "[xy]+", "structured_outputs"))
        assert len(trials) == 2
    finally:
        text.close()


def test_greedy_rows_under_grammars_take_the_general_paths_tokens(grammars, hf):
    """Greedy rows without logprobs take the argmax path, a grammar's row its argmax among the tokens the grammar
    allows (one bit of the mask where the argmax is allowed): the same tokens as the general path (the same rows
    with logprobs), over random logits, a JSON schema's matcher advanced token by token, and a failed grammar."""
    eos = hf.eos_token_id
    schema = grammar_for("json", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    generator = torch.Generator().manual_seed(1)
    fast, slow = grammars.matcher(schema, eos), grammars.matcher(schema, eos)
    never = grammars.matcher(grammar_for("regex", r"[^\s\S]"), eos)
    on_top = 0
    for step in range(12):
        logits = torch.randn(3, VOCAB, generator=generator)
        if step % 2:  # a token the grammar allows on top: the one-bit path
            allowed, _ = allowed_tokens([fast.deep_copy()], VOCAB)
            logits[1, int(allowed[0].nonzero()[0][-1])] = 100.0
        out = Sampler(VOCAB)(logits, [new_state(SamplingParams(temperature=0), [], eos, matcher)
                                      for matcher in (None, fast, never)])
        expected = Sampler(VOCAB)(logits, [new_state(SamplingParams(temperature=0, logprobs=0), [], eos, matcher)
                                           for matcher in (None, slow, never)])
        assert out.tokens.tolist() == expected.tokens.tolist() and out.tokens[2] == GRAMMAR_FAILED
        assert out.logprobs is None and out.tokens[0] == int(logits[0].argmax())
        on_top += int(out.tokens[1] == int(logits[1].argmax()))
        assert fast.consume_token(int(out.tokens[1])) and slow.consume_token(int(expected.tokens[1]))
    assert 0 < on_top < 12  # both ways of a grammar's row were taken
    digits = grammar_for("regex", r"[0-9]+")
    allowed = allowed_tokens([grammars.matcher(digits, eos)], VOCAB)[0][0]
    # a token the grammar refuses whose bit, read in the wrong order within its byte, would be an allowed one's
    refused = next(t for a in allowed.nonzero()[0].tolist() if not allowed[t := a ^ 7])
    logits = torch.randn(1, VOCAB, generator=generator)
    logits[0, refused] = 100.0
    token = Sampler(VOCAB)(logits, [new_state(SamplingParams(temperature=0), [], eos,
                                              grammars.matcher(digits, eos))]).tokens[0]
    assert allowed[int(token)] and token == int(logits[0].masked_fill(~torch.from_numpy(allowed), -1e9).argmax())


@pytest.mark.parametrize("logprobs", [None, 0])  # the greedy argmax path and the general one
def test_a_complete_grammar_lets_the_requests_stop_tokens_end_it_as_eos(grammars, hf, logprobs):
    """llguidance allows its one EOS where a grammar is complete: a request's stop token ids (the model's other end
    tokens among them: a Llama 3 file's <|eot_id|> where its EOS is <|end_of_text|>) are allowed there too, and only
    there."""
    matcher = grammars.matcher(grammar_for("regex", r"[0-9]{2}"), hf.eos_token_id)
    complete = matcher.deep_copy()
    assert all(complete.consume_token(t) for t in hf("42", add_special_tokens=False).input_ids)
    [[eos]] = allowed_tokens([complete], VOCAB)[0].nonzero()[0].reshape(1, -1).tolist()  # llguidance's EOS, alone
    stop = next(t for t in hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) if t != eos)
    logits = torch.zeros(1, VOCAB)
    logits[0, stop] = 100.0

    def sampled(stops: tuple[int, ...]) -> int:
        params = SamplingParams(temperature=0, logprobs=logprobs, stop_token_ids=stops)
        return int(Sampler(VOCAB)(logits, [new_state(params, [], eos, matcher)]).tokens[0])

    assert hf.decode([sampled((stop,))]).isdigit()  # not complete yet: the stop token is refused
    assert all(matcher.consume_token(t) for t in hf("42", add_special_tokens=False).input_ids)
    assert sampled((stop,)) == stop and sampled(()) == eos


def test_the_frontends_trial_refuses_grammars_that_fail_or_stall_in_their_first_masks(text, monkeypatch):
    """first_mask_problem follows a grammar's first tokens as the engine would: grammars that compile but fail in
    their first masks (a regex too big for llguidance's lexer, a schema or grammar with no finite text) or take too
    long there (every running request would wait for each such mask) are refused with llguidance's reason, or the
    time; a schema or a regex that can be served passes; and while MAX_TRIALS overrunning trials still run, a new
    grammar is GrammarBusy, not checked."""
    import threading

    from app.engine import structured
    from app.engine.structured import GrammarBusy, first_mask_problem, tokenizer_from_json

    tokenizer = tokenizer_from_json(text, VOCAB, 2)
    for kind, value, reason in [
            ("regex", "a{1000000}", "too many expressions"),
            ("json", {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "Too many items"),
            ("json", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "Too many items"),
            ("grammar", 'start: "(" start ")"', "Too many items")]:
        # (a budget no machine overruns: "a{1000000}" takes llguidance ~0.4 s of CPU to refuse, near TRIAL_SECONDS)
        problem = first_mask_problem(grammar_for(kind, value), tokenizer, seconds=60)
        assert problem is not None and reason in problem and "\n" not in problem, (value, problem)
    for kind, value in [("json", {"type": "object", "properties": {"name": {"type": "string"},
                                                                   "age": {"type": "integer"}}}),
                        ("regex", r"[0-9]{3}-[a-z]+"), ("choice", ["yes", "no"])]:
        assert first_mask_problem(grammar_for(kind, value), tokenizer) is None
    # 300 alternatives of one recursive rule: ~0.1 s a mask here, and a 50 ms budget
    slow = grammar_for("grammar", "start: e\ne: " + " | ".join(f'"(" e "op{i}" e ")"' for i in range(300)) +
                       " | /[0-9]+/")
    refused = first_mask_problem(slow, tokenizer, seconds=0.05)
    assert isinstance(refused, structured.SlowGrammar) and "took over 0.05 s" in refused
    monkeypatch.setattr(structured, "SLOW_STEP_SECONDS", 0.0)  # every token slow: refused, not remembered
    assert isinstance(first_mask_problem(grammar_for("regex", "[ab]+"), tokenizer), structured.SlowGrammar)
    monkeypatch.undo()
    taken = threading.BoundedSemaphore(structured.MAX_TRIALS)
    for _ in range(structured.MAX_TRIALS):
        taken.acquire()
    real, structured._trials = structured._trials, taken
    try:
        with pytest.raises(GrammarBusy):
            first_mask_problem(grammar_for("regex", "[ab]+"), tokenizer)
    finally:
        structured._trials = real


def test_the_trials_budget_is_its_cpu_time_not_the_wall_clocks(text, monkeypatch):
    """A trial whose thread waits rather than computes (as one does that shares its core with a busy engine) is not
    refused on the wall clock's time, up to TRIAL_WALL_SECONDS: here a matcher whose masks sleep 0.15 s, against a
    0.1 s budget, passes; past TRIAL_WALL_SECONDS (lowered) it is refused."""
    import llguidance

    from app.engine import structured
    from app.engine.structured import first_mask_problem, tokenizer_from_json

    real = llguidance.LLMatcher

    class Sleepy:  # (llguidance's matcher, its masks 0.15 s later)
        def __init__(self, *args, **kwargs):
            self.matcher = real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.matcher, name)

        def compute_bitmask(self):
            time.sleep(0.15)
            return self.matcher.compute_bitmask()

    tokenizer, grammar = tokenizer_from_json(text, VOCAB, 2), grammar_for("regex", "[ab]+")
    monkeypatch.setattr(llguidance, "LLMatcher", Sleepy)
    assert first_mask_problem(grammar, tokenizer, tokens=2, seconds=0.1) is None
    monkeypatch.setattr(structured, "TRIAL_WALL_SECONDS", 0.2)
    assert isinstance(first_mask_problem(grammar, tokenizer, tokens=2, seconds=0.1), structured.SlowGrammar)


def test_a_mask_slower_than_the_engine_allows_fails_its_row(grammars, hf, monkeypatch):
    """In the engine, a mask that took over SLOW_MASK_SECONDS (here: any), or SLOW_STEPS masks over
    SLOW_STEP_SECONDS, fail the sequence, with that reason, on both the general and the greedy path: its request
    is aborted rather than let it hold the others again."""
    from app.engine import structured
    from app.engine.structured import MaskClock, grammar_error, mask_bits

    matcher = grammars.matcher(grammar_for("regex", r"[0-9]+"), hf.eos_token_id)
    assert mask_bits(matcher) is not None
    monkeypatch.setattr(structured, "SLOW_STEP_SECONDS", -1.0)  # every mask slow: the third fails
    monkeypatch.setattr(structured, "SLOW_STEPS", 3)
    clock = MaskClock()
    assert [mask_bits(matcher, clock=clock) is None for _ in range(3)] == [False, False, True]
    monkeypatch.setattr(structured, "SLOW_MASK_SECONDS", -1.0)
    assert mask_bits(matcher) is None and "took over" in grammar_error(matcher)
    for logprobs in (0, None):  # the general path, the greedy one
        state = new_state(SamplingParams(temperature=0, logprobs=logprobs), [], hf.eos_token_id,
                          grammars.matcher(grammar_for("regex", r"[0-9]{2}"), hf.eos_token_id))
        out = Sampler(VOCAB)(torch.randn(1, VOCAB), [state])
        assert out.tokens.tolist() == [GRAMMAR_FAILED]
