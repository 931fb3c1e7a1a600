"""Structured outputs: a request's output held to a JSON schema, a regular expression, a list of choices or a Lark
grammar, with llguidance (the library vLLM and llama.cpp use for the same): its matcher gives the tokens the grammar
allows next, a bitmask over the vocabulary that the sampler applies to a row's logits before it chooses.

The frontend turns the API's fields into one llguidance grammar (`grammar_for`) and checks it against the model's
tokenizer (so a bad schema is a 400, never an engine error); the request carries the grammar
(`SamplingParams.grammar`); the engine compiles it beside the steps, admits the request once it is compiled, and
keeps a matcher per sequence (`Grammars`), advanced by every token sampled.
Once the grammar is complete, only the end-of-sequence token is allowed, so the output ends there (`finish_reason`
"stop").
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

# JSON without optional whitespace: a small model left free to add spaces and newlines between tokens can pad
# forever; the values a schema allows are unchanged.
JSON_OPTIONS = {"whitespace_flexible": False}
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$")
log = logging.getLogger("app.engine")


def grammar_for(kind: str, value: Any) -> str:
    """The llguidance grammar of one constraint: kind "json" (a schema, as a dict or its JSON text), "json_object"
    (any JSON object), "regex", "choice" (a list of strings: exactly one of them), or "grammar" (Lark syntax).
    Raises ValueError where the value is not of that kind's shape (a schema that is not JSON, say)."""
    from llguidance import LLMatcher

    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(f"({_escape(choice)})" for choice in value))
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(value)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _escape(text: str) -> str:
    """`text` as a regular expression that matches exactly it (Rust's regex syntax, which llguidance uses)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def tokenizer_from_json(tokenizer_json: str, vocab_size: int, eos_token_id: int | None):
    """llguidance's view of a Hugging Face fast tokenizer (its tokenizer.json text); ~0.4 s for SmolLM2's 49,152
    tokens. Tokens past the tokenizer's own vocabulary (a padded embedding) are never allowed."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)


def check_grammar(grammar: str, tokenizer) -> str | None:
    """None where `grammar` compiles against `tokenizer` (an LLTokenizer), else llguidance's error message."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return messages[0] if is_error else None


# The frontend's trial of a new grammar (first_mask_problem): its first TRIAL_TOKENS tokens, within TRIAL_SECONDS in
# all. The engine computes a mask a step for each sequence while every running request waits (JSON schemas, tool
# calls and regexes take 0.1-20 ms one), and some grammars that compile fail only in their first masks.
TRIAL_TOKENS = 4
TRIAL_SECONDS = 0.5
# ... of the trial thread's CPU time, not the wall clock's: where the frontend shares its cores with a busy engine
# (machines under 8 CPUs) a grammar's trial could take twice its CPU time, and fail grammars the engine would run
# well. Past TRIAL_WALL_SECONDS on the wall clock it fails whatever its CPU time.
TRIAL_WALL_SECONDS = 1.0
# In the engine, a sequence whose grammar takes longer than SLOW_MASK_SECONDS for a token once (its mask, and the
# advance past the token before), or longer than SLOW_STEP_SECONDS SLOW_STEPS times or for SLOW_TOTAL_SECONDS in
# all, fails (MaskClock): grammars the trial let through (it follows one path, of a few tokens) can still be slow
# further on, or grow slower token by token (nested brackets a logit_bias forces: 0.09 s a token held every other
# stream to a fifteenth of its speed). Times are the engine thread's CPU time, not the wall clock's: a busy machine
# does not make a grammar slow.
SLOW_MASK_SECONDS = 1.0
SLOW_STEP_SECONDS = 0.05
SLOW_STEPS = 16
SLOW_TOTAL_SECONDS = 2.0
# Trials at once (one that overran goes on to its next token: llguidance cannot be stopped within one): past this
# many, a new grammar is a 503
MAX_TRIALS = 2
_trials = threading.BoundedSemaphore(MAX_TRIALS)


class GrammarBusy(Exception):
    """Too many grammars' trials overran and still run: a new grammar cannot be checked now (a 503)."""


class SlowGrammar(str):
    """first_mask_problem's answer where the grammar is too slow, not wrong: a refusal of the moment (a busy machine
    can make a trial overrun), which the frontend does not remember."""


def first_mask_problem(grammar: str, tokenizer, tokens: int = TRIAL_TOKENS,
                       seconds: float = TRIAL_SECONDS) -> str | None:
    """Why `grammar` cannot constrain an output, found by following it for its first `tokens` tokens as the engine
    would (each step's mask, then the lowest token it allows but the end): llguidance's error (one of its limits
    hit: a language without a finite text, a regex too big to run), no token allowed, or (a SlowGrammar) tokens that
    take over `seconds` of CPU time in all (or TRIAL_WALL_SECONDS on the wall clock), or every one after the first
    over SLOW_STEP_SECONDS, which the engine would abort; None where it can. The tokens are followed on a thread of their own (llguidance lets go of the GIL
    while it computes a mask, not while it advances past a token); one that overruns stops at its next token, and
    while MAX_TRIALS of those run, this raises GrammarBusy rather than start another."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return matcher.get_error().splitlines()[0]
    slots = _trials
    if not slots.acquire(blocking=False):
        raise GrammarBusy("the server is still computing other grammars' too complex masks; try again later")
    done, stop = threading.Event(), threading.Event()
    found: list[str] = []
    clock: list[int] = []  # the trial thread's CPU-time clock
    eos = tokenizer.eos_token

    def follow() -> None:
        try:
            clock.append(time.pthread_getcpuclockid(threading.get_ident()))
            times = []
            for _ in range(tokens):
                if stop.is_set():
                    return
                started = time.thread_time()
                bits = None if matcher.is_error() else matcher.compute_bitmask()
                if bits is None or matcher.is_error():
                    break
                allowed = np.flatnonzero(np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little"))
                if allowed.size == 0:
                    found.append("it allows no output at all")
                    return
                onward = allowed[allowed != eos]
                if onward.size == 0 or not matcher.consume_token(int(onward[0])):
                    break
                times.append(time.thread_time() - started)
            if matcher.is_error():  # (llguidance's message, less the parser state it may add after its line)
                found.append(matcher.get_error().splitlines()[0])
            elif len(times) > 1 and min(times[1:]) > SLOW_STEP_SECONDS:
                found.append(SlowGrammar(
                    f"each of its first tokens took over {SLOW_STEP_SECONDS:g} s to compute its choices (the engine "
                    "computes them for every token, while every other request waits): too complex a grammar to serve"))
        finally:
            done.set()
            slots.release()

    threading.Thread(target=follow, name="grammar-trial", daemon=True).start()
    give_up = time.monotonic() + max(TRIAL_WALL_SECONDS, seconds)
    while not done.wait(min(seconds, 0.05)):
        if _cpu_seconds(clock) > seconds or time.monotonic() > give_up:
            stop.set()
            return SlowGrammar(f"its first tokens' choices took over {seconds:g} s to compute (the engine computes "
                               "them for every token, while every other request waits): too complex a grammar to serve")
    return found[0] if found else None


def _cpu_seconds(clock: list[int]) -> float:
    """The CPU time of the thread whose clock is clock[0] (0 before it has one; once it has ended, the kernel
    refuses its clock: then 0 too, and done is set)."""
    try:
        return time.clock_gettime(clock[0]) if clock else 0.0
    except OSError:
        return 0.0


class Grammars:
    """The engine's side: the model's LLTokenizer and a compiled matcher per grammar, both made on a thread of their
    own so that no step of other requests waits for them, and a matcher for each sequence: a copy of one compiled
    once per grammar (the n choices of a request, and requests that send the same schema again, compile it once;
    a copy costs microseconds).

    - The tokenizer (~0.35 s for SmolLM2's 49,152 tokens, holding the GIL all along: every step waits meanwhile)
      is built by `warm`, which the serving engine calls once it is ready, or else for the first grammar.
    - A grammar is compiled by `prepare` (1-15 ms, without the GIL) while its request waits: the scheduler admits
      it once the future is done (vLLM holds such a request back the same way), and `matcher` then copies it.
    """

    COMPILED = 32  # grammars kept compiled, most recently used

    def __init__(self, tokenizer_json: Callable[[], str] | None, vocab_size: int):
        self._tokenizer_json, self._vocab_size = tokenizer_json, vocab_size
        self._tokenizer: Future | None = None  # the LLTokenizer, being built or built (or why it cannot be)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._fallback_lock, self._fallback_built = threading.Lock(), None  # `_fallback`'s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def warm(self, eos_token_id: int | None, tokenizer_json: Callable[[], str] | None = None,
             when: str = "for the first grammar") -> None:
        """Start building the tokenizer on the grammar thread, if no one has (`tokenizer_json`: its text, where the
        caller has it at hand; else the engine's). `when`: for the log line."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._thread.submit(self._build, tokenizer_json or self._tokenizer_json,
                                                      eos_token_id, when)

    def warm_from(self, exported: Callable[[], tuple[str, int | None] | None], when: str) -> Future:
        """`warm`, with the tokenizer's text and EOS id read on the grammar thread too (`exported`: the cached
        export's, app/model/tokenizer.py `cached_export`; where it gives None, the tokenizer is built for the first
        grammar instead, as without this). Returns the build's future (done once it is built or given up)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._thread.submit(self._build_exported, exported, when)
            return self._tokenizer

    def _build_exported(self, exported: Callable[[], tuple[str, int | None] | None], when: str):
        got = exported()
        if got is None:  # (the export went away since the engine looked): the first grammar builds it (`_fallback`)
            return None
        text, eos_token_id = got
        return self._build(lambda: text, eos_token_id, when)

    def _fallback(self, eos_token_id: int | None):
        """The tokenizer built from the engine's own source, for the first grammar, where a warm start found no
        export to build it from (built once; a failure, once, is every grammar's)."""
        with self._fallback_lock:
            if self._fallback_built is None:
                try:
                    self._fallback_built = self._build(self._tokenizer_json, eos_token_id, "for the first grammar")
                except Exception as exc:  # noqa: BLE001 (the requests fail, not the engine)
                    self._fallback_built = exc
        if isinstance(self._fallback_built, Exception):
            raise self._fallback_built
        return self._fallback_built

    def _build(self, tokenizer_json: Callable[[], str] | None, eos_token_id: int | None, when: str):
        if tokenizer_json is None:
            raise ValueError("this engine was given no tokenizer for structured outputs")
        started = time.perf_counter()
        tokenizer = tokenizer_from_json(tokenizer_json(), self._vocab_size, eos_token_id)
        log.info("structured outputs: llguidance's tokenizer built %s in %.2f s", when, time.perf_counter() - started)
        return tokenizer

    def prepare(self, grammar: str, eos_token_id: int | None) -> Future:
        """Compile `grammar` on the grammar thread (after the tokenizer); the future is done when `matcher` can
        copy it without waiting. It never raises: a grammar that cannot be compiled gives a failed matcher."""
        self.warm(eos_token_id)
        return self._thread.submit(self._compile, grammar, eos_token_id)

    def matcher(self, grammar: str, eos_token_id: int | None, compiled: Any = None):
        """A matcher at the start of `grammar`: a copy of `compiled` (what `prepare`'s future gave: the engine keeps
        it with the request, so that it cannot fall out of the cache before the request is admitted, 32 grammars
        later), else of the cache's, compiled here if need be; where it cannot be built, one in llguidance's error
        state (the sampler then gives its sequence no token, and the engine aborts that request alone)."""
        self.warm(eos_token_id)
        if compiled is None:
            compiled = self._compile(grammar, eos_token_id)
        return compiled if isinstance(compiled, FailedMatcher) else compiled.deep_copy()

    def _compile(self, grammar: str, eos_token_id: int | None):
        from llguidance import LLMatcher

        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        try:
            tokenizer = self._tokenizer.result() or self._fallback(eos_token_id)
        except Exception as exc:  # noqa: BLE001 (the requests fail, not the engine)
            return FailedMatcher(f"no tokenizer for structured outputs: {exc}")
        try:
            compiled = LLMatcher(tokenizer, grammar, log_level=0)  # (a grammar's error is the matcher's state)
        except Exception as exc:  # noqa: BLE001 (whatever else fails fails this grammar's requests alone)
            return FailedMatcher(f"the grammar could not be compiled: {exc}")
        with self._lock:
            self._compiled[grammar] = compiled
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > self.COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class FailedMatcher:
    """What a sequence gets whose grammar could not even be set up: a matcher in the error state."""

    def __init__(self, error: str):
        self.error = error

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return self.error

    def consume_token(self, token: int) -> bool:
        return False


class MaskClock:
    """One sequence's grammar's time a token in the engine (each step waits for it, every running request with it):
    `spent` adds the time of advancing the matcher by a token (llguidance computes what it forces next there),
    `ok` that of the next mask and says whether the grammar may go on; `step_seconds` the time of both since it was
    last asked (the scheduler holds back a request whose grammar takes more than its share of a step)."""

    def __init__(self):
        self.slow, self.slow_seconds, self.pending, self.unreported = 0, 0.0, 0.0, 0.0

    def spent(self, seconds: float) -> None:
        self.pending += seconds
        self.unreported += seconds

    def step_seconds(self) -> float:
        seconds, self.unreported = self.unreported, 0.0
        return seconds

    def ok(self, seconds: float) -> bool:
        self.unreported += seconds
        seconds, self.pending = seconds + self.pending, 0.0
        if seconds > SLOW_STEP_SECONDS:
            self.slow, self.slow_seconds = self.slow + 1, self.slow_seconds + seconds
        return seconds <= SLOW_MASK_SECONDS and self.slow < SLOW_STEPS and self.slow_seconds < SLOW_TOTAL_SECONDS


def grammar_error(matcher) -> str:
    """Why a sequence's grammar failed (`mask_bits` gave None): llguidance's error, or masks too slow."""
    return (matcher.get_error().splitlines() or [""])[0] or \
        (f"its choices took over {SLOW_STEP_SECONDS:g} s a token {SLOW_STEPS} times or {SLOW_TOTAL_SECONDS:g} s "
         f"in all, or {SLOW_MASK_SECONDS:g} s once, every running request waiting for each: too complex a grammar "
         "to serve")


def mask_bits(matcher, eos: int | None = None, stops: tuple[int, ...] = (),
              clock: MaskClock | None = None) -> bytes | None:
    """The tokens `matcher` allows next, one bit each (token t: bit t % 8 of byte t // 8), or None where its grammar
    failed, before or in the computation, or its masks are too slow (`clock`; the step waits for them, every
    running request with it: the grammar's request is aborted rather than let it hold them again). Where it allows `eos` (the grammar is complete), it allows `stops` too:
    the request's stop token ids, the model's other end tokens among them (llguidance knows one EOS; a Llama 3 file
    whose EOS is <|end_of_text|> ends its turns with <|eot_id|>), which end a sequence as EOS does."""
    started = time.thread_time()
    bits = None if matcher.is_error() else matcher.compute_bitmask()
    if bits is None or matcher.is_error() or not (clock or MaskClock()).ok(time.thread_time() - started):
        return None
    if stops and eos is not None and eos >> 3 < len(bits) and bits[eos >> 3] >> (eos & 7) & 1:
        more = bytearray(bits)
        for token in stops:
            if token >> 3 < len(more):
                more[token >> 3] |= 1 << (token & 7)
        bits = bytes(more)
    return bits


def allowed_tokens(matchers: list, vocab_size: int,
                   stops: list[tuple[int | None, tuple[int, ...]]] | None = None,
                   clocks: list[MaskClock] | None = None) -> tuple[np.ndarray, list[int]]:
    """The tokens each matcher allows next, as a bool array [len(matchers), vocab_size], and the indices of the
    matchers in an error state, before or after computing their mask (llguidance fails inside the computation
    where a grammar cannot go on, and then allows only EOS: such a row must fail, not end as if complete), or too
    slow. `stops`, `clocks`: each matcher's (EOS, stop token ids) and MaskClock, as `mask_bits` takes them."""
    masks, failed = [], []
    for i, matcher in enumerate(matchers):
        bits = mask_bits(matcher, *(stops[i] if stops else (None, ())), clocks[i] if clocks else None)
        if bits is None:
            failed.append(i)
            bits = b""
        masks.append(bits)
    width = max(-(-vocab_size // 8), *(len(bits) for bits in masks))  # bytes; a failed row allows nothing
    stacked = np.frombuffer(b"".join(bits.ljust(width, b"\0") for bits in masks), dtype=np.uint8)
    allowed = np.unpackbits(stacked.reshape(len(masks), width), axis=1, bitorder="little")[:, :vocab_size]
    allowed = allowed.astype(bool)
    failed += [i for i in np.flatnonzero(~allowed.any(axis=1)).tolist() if i not in failed]
    return allowed, failed
