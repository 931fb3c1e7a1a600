"""From token ids to text: incremental detokenization and stop strings, per sequence.

This is the text side of the engine: in-process for the offline `LLM`, in the HTTP frontend once the
engine core runs in its own process. Stop strings are matched on the decoded text; text that could
still turn out to be the start of a stop string is held back, so no part of one ever leaks out.
"""

from __future__ import annotations

import weakref
from array import array
from dataclasses import dataclass, field

from app.engine.params import SamplingParams
from app.engine.request import FinishReason

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the sampled token (of a prompt's logprobs: the prompt's token there)
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int | None = None  # the token's place in the vocabulary, 1 = the most likely (prompt logprobs have it)


class Detokenizer:
    """Decodes a growing list of token ids a few at a time, correct across split multi-byte characters.

    Each step decodes a short window ending at the newest token twice, with and without it; the
    difference is the new text, emitted only once it no longer ends in an incomplete character.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 keep_special_ids: tuple[int, ...] = ()):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        # special tokens to leave out, where some are kept (None: the tokenizer's decode leaves them all out)
        self.dropped = _special_ids(tokenizer) - set(keep_special_ids) if skip_special_tokens and keep_special_ids \
            else None
        self.ids = list(prompt_ids[-6:])  # a little context: some decoders drop a leading space otherwise
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens already turned into text

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        if self.dropped is not None:  # what the tokenizer's skipping does, token by token, but for the kept ones
            return self.tokenizer.decode([i for i in ids if i not in self.dropped], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)


_SPECIAL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its length, its special ids)


def _special_ids(tokenizer) -> frozenset[int]:
    """The ids a decode with skip_special_tokens leaves out: the added tokens marked special. Kept per tokenizer
    while its length stays (tokens added change it): reading them takes ~0.7 ms where a tokenizer has a thousand
    (Mistral's), once for each sequence of a request that keeps some."""
    size = len(tokenizer)
    known = _SPECIAL_IDS.get(tokenizer)
    if known is None or known[0] != size:
        known = _SPECIAL_IDS[tokenizer] = (
            size, frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special))
    return known[1]


@dataclass
class SequenceText:
    """The text of one output sequence, its stop strings, and how much of it was already handed out."""

    detokenizer: Detokenizer
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    min_tokens: int = 0  # stop strings count only where they end in the text of a later token (as vLLM's)
    include_stop: bool = False  # the matched stop string stays in the text (SamplingParams.include_stop_str_in_output)
    text: str = ""
    checked: int = 0  # no stop string may end in text[:checked], that of the first min_tokens tokens
    sent: int = 0
    token_ids: list[int] = field(default_factory=list)
    # len(text) once each of token_ids was added (stop cuts aside): 8 bytes a token, not a list's ~36
    text_ends: array = field(default_factory=lambda: array("q"))
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs, once they came
    embedding: list[float] | None = None  # SamplingParams.embed, once it came
    cached_tokens: int = 0  # of its prompt, found in the prefix cache (known with its first token)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string matched, or the stop token id (not EOS) that ended

    @classmethod
    def of(cls, tokenizer, prompt_ids: list[int], params: SamplingParams, eos_token_id: int | None) -> SequenceText:
        """The text of one sequence of a request with these params: the one place stop strings come from."""
        return cls(Detokenizer(tokenizer, prompt_ids, params.skip_special_tokens, params.keep_special_ids), params.stop,
                   params.stop_token_ids, eos_token_id, params.min_tokens, params.include_stop_str_in_output)

    def take(self, token_id: int | None, logprobs: TokenLogprobs | None,
             engine_reason: FinishReason | None) -> FinishReason | None:
        """One engine output: its token and the engine's finish reason. Returns the sequence's finish reason:
        STOP when a stop string matched (the engine does not know yet), else the engine's. The EOS or stop
        token that ended a sequence stays in its token ids but adds no text (unless include_stop, as vLLM's
        include_stop_str_in_output keeps it; an EOS that is a special token still adds none where those are
        skipped)."""
        at_stop_token = engine_reason == FinishReason.STOP and token_id is not None and (
            token_id == self.eos_token_id or token_id in self.stop_token_ids)
        if not self.add(token_id, logprobs, at_stop_token and not self.include_stop) and engine_reason is not None \
                and self.finish_reason is None:
            self.finish_reason = engine_reason
            if at_stop_token and token_id != self.eos_token_id:
                self.stop_reason = token_id
        return self.finish_reason

    def add(self, token_id: int | None, logprobs: TokenLogprobs | None, hidden: bool = False) -> bool:
        """Take one new token; True if a stop string ended the sequence. `hidden` tokens add no text."""
        if token_id is None or self.finish_reason is not None:
            return self.finish_reason == FinishReason.STOP
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if hidden:
            self.text_ends.append(len(self.text))
            return False
        start = len(self.text)
        self.text += self.detokenizer.add(token_id)
        self.text_ends.append(len(self.text))
        if len(self.token_ids) <= self.min_tokens:
            self.checked = len(self.text)
            return False
        return self._cut_at_stop(max(start, self.checked))

    def _cut_at_stop(self, start: int) -> bool:
        # each stop string where it ends past `start`: one ending before was looked for with an earlier token
        hits = [(i, -len(s), s) for s in self.stop if (i := self.text.find(s, max(start - len(s) + 1, 0))) >= 0]
        if not hits:
            return False
        at, minus_length, self.stop_reason = min(hits)  # the first to start, the longest of those
        self.text = self.text[:at - minus_length if self.include_stop else at]
        self.finish_reason = FinishReason.STOP
        return True

    def take_new_text(self) -> str:
        """Text not handed out yet, minus a tail that could still begin a stop string."""
        end = len(self.text)
        if self.finish_reason is None and self.stop and not self.include_stop:  # shown anyway: no need to hold back
            end -= max(len(s) for s in self.stop) - 1
        if end <= self.sent:
            return ""
        new, self.sent = self.text[self.sent:end], end
        return new
