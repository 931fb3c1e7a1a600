"""A thinking model's reasoning, split from its answer on /v1/chat/completions.

Models such as Qwen3, QwQ, DeepSeek-R1's distillations and SmolLM3 think in a `<think>...</think>` block before they
answer. Where the chat template knows those tags (`model.reasoning: auto`, the default), the block's text comes back
apart from the answer, as `reasoning_content` (DeepSeek's name, llama.cpp's and the Vercel AI SDK's) and `reasoning`
(vLLM's since 0.11 and OpenRouter's), the same text in both, and `content` holds what follows the block: llama.cpp's
server does this by default, vLLM with `--reasoning-parser`.

Where the block starts is read from the prompt, not guessed from the answer: a generation prompt that ends with an
open `<think>` (DeepSeek-R1's template), or a prefilled answer under `continue_final_message` that opened one, makes
the answer start inside the block; otherwise a block opens only where the answer starts with `<think>`
(Qwen3's way; Qwen3's `enable_thinking: false` closes an empty block in the prompt, so its answer is all content).
An answer cut inside its block (`max_tokens`) is all reasoning. Under a constraint (structured outputs, a forced
tool choice) the answer is the grammar's and is not split.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template: str | dict | None) -> bool:
    """Whether a chat template (or any of a tokenizer's named ones) knows thinking blocks."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(OPEN in text and CLOSE in text for text in texts)


def opens_thinking(prompt: str, prefill: str | None = None) -> bool:
    """Whether the answer starts inside a thinking block: the generation prompt ends with an open one
    (DeepSeek-R1's), or the prefilled answer that is continued (`continue_final_message`) opened one it did not
    close. A `<think>` elsewhere in the conversation (a user asking about the tag, a tool result) is not read."""
    if prefill is not None:
        return prefill.rfind(OPEN) > prefill.rfind(CLOSE)
    return prompt.rstrip().endswith(OPEN)


@dataclass
class ReasoningReader:
    """Splits an answer's text into reasoning and content as it grows: `feed` takes the next piece and gives
    (reasoning, content); `end` gives what is held back when the answer ends. Text that may still become a tag is
    held back until it is known not to. The reasoning comes without its leading and trailing whitespace (none at
    all for a block of whitespace: Qwen3's /no_think writes one), as llama.cpp trims it; whitespace right after the
    closing tag is no content. An answer that writes `<think>` again where the prompt opened the block loses the
    repeated tag (as vLLM's DeepSeek-R1 parser)."""

    thinking: bool  # inside the block (from the start: the prompt opened it)
    _at_start: bool = True  # nothing but whitespace read yet: a tag may still open the answer
    _said: bool = False  # some reasoning was given out
    _after_close: bool = False  # the block ended (the rest is content), and no content came yet
    _held: str = ""  # text that may still become a tag
    _space: str = ""  # the reasoning's trailing whitespace so far: given out only where more reasoning follows

    def feed(self, piece: str) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        if self._at_start:
            stripped = text.lstrip()
            if len(stripped) < len(OPEN) and OPEN.startswith(stripped):
                self._held = text  # whitespace, or a tag's beginning: not known yet
                return "", ""
            self._at_start = False
            if stripped.startswith(OPEN):
                self.thinking, text = True, stripped[len(OPEN):]
        reasoning = ""
        if self.thinking:
            i = text.find(CLOSE)
            if i < 0:
                keep = tag_start(text, CLOSE)
                self._held = text[len(text) - keep:]
                return self._reasoning(text[:len(text) - keep]), ""
            reasoning, text = self._reasoning(text[:i], last=True), text[i + len(CLOSE):]
            self.thinking, self._after_close = False, True
        if self._after_close:
            text = text.lstrip()
            self._after_close = not text
        return reasoning, text

    @property
    def block_only(self) -> bool:
        """The answer so far is a thinking block (ended or not, empty or not) and no content: its content is null."""
        return self.thinking or self._after_close

    def end(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self.thinking:  # cut inside the block (max_tokens, a stop string)
            return self._reasoning(held, last=True), ""
        return "", held.lstrip() if self._after_close else held

    def _reasoning(self, text: str, last: bool = False) -> str:
        """The reasoning of `text`, whitespace at the block's two ends left out (`last`: the block ends after it)."""
        if not self._said:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space = "" if last else self._space + text
            return ""
        out, self._space, self._said = self._space + body, "" if last else text[len(body):], True
        return out


def thinking_tokens(text: str, text_ends: Sequence[int], opened: bool) -> int:
    """How many of an answer's tokens wrote its thinking block, tags included (the Responses API's
    `reasoning_tokens`): those up to the one that completed `</think>`, or all of them where the block never closed.
    `text_ends[i]`: the answer's length in characters once its token i was added; `opened`: the prompt opened the
    block (opens_thinking), else only an answer that starts with `<think>` has one."""
    start = len(text) - len(text.lstrip())
    if not opened:
        if not text.startswith(OPEN, start):
            return 0
        start += len(OPEN)
    close = text.find(CLOSE, start)
    if close < 0:
        return len(text_ends)
    return min(bisect.bisect_left(text_ends, close + len(CLOSE)) + 1, len(text_ends))


def tag_start(text: str, tag: str, start: int = 0) -> int:
    """How many characters at the end of `text` (from `start`) may begin `tag`."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - n:]):
            return n
    return 0
