"""A thinking block split from the answer (app/server/reasoning.py): where it starts, and the reader that splits
the answer as it grows, at every piece boundary the same as whole."""

from __future__ import annotations

import random

import pytest

from app.server.reasoning import ReasoningReader, opens_thinking, template_thinks, thinking_tokens

ANSWERS = [  # (the prompt left a block open, the answer, its reasoning, its content)
    (False, "\n<think>\nHmm, France.\n</think>\n\nParis.", "Hmm, France.", "Paris."),
    (True, "Hmm </thi and </think>  Paris <think> x </think>", "Hmm </thi and", "Paris <think> x </think>"),
    (True, " <think>\nOnce more.\n\nAnd again. \n</think>Paris", "Once more.\n\nAnd again.", "Paris"),  # tag again
    (False, "Paris <think>a</think>", "", "Paris <think>a</think>"),  # a block opens only at the start
    (False, "<thin", "", "<thin"),  # a tag's beginning at the end: text after all
    (False, "<thinking>", "", "<thinking>"),
    (True, "cut inside the block </thi", "cut inside the block </thi", ""),
    (False, "<think>cut inside  \n", "cut inside", ""),
    (False, "  \n", "", "  \n"),
    (False, "<think>\n\n</think>\n\nHello", "", "Hello"),  # Qwen3's /no_think: no reasoning at all
    (True, "</think>\n\n", "", ""),
]


def read(thinking: bool, pieces: list[str]) -> tuple[str, str]:
    reader, reasoning, content = ReasoningReader(thinking), "", ""
    for piece in pieces:
        more, rest = reader.feed(piece)
        reasoning, content = reasoning + more, content + rest
    more, rest = reader.end()
    return reasoning + more, content + rest


@pytest.mark.parametrize("thinking, text, reasoning, content", ANSWERS)
def test_the_reader_splits_an_answer_the_same_at_every_piece_boundary(thinking, text, reasoning, content):
    assert read(thinking, [text]) == (reasoning, content)
    assert read(thinking, list(text)) == (reasoning, content)
    rng = random.Random(text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        assert read(thinking, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == (reasoning, content)


def test_text_that_may_still_become_a_tag_is_held_back_until_it_cannot():
    reader = ReasoningReader(False)
    assert reader.feed(" <th") == ("", "") and reader.feed("ink>\n I") == ("I", "")
    assert reader.feed(" see </thin") == (" see", "") and reader.feed("g> \n") == (" </thing>", "")
    assert reader.feed("</think>\n") == ("", "") and reader.feed("\nParis") == ("", "Paris")
    plain = ReasoningReader(False)
    assert plain.feed("<b") == ("", "<b")  # cannot begin "<think>": out at once


def test_where_a_block_starts_is_read_from_the_prompt_and_the_template():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3's enable_thinking false
    assert not opens_thinking("<think>\nold\n</think>\n\nRome<|im_start|>assistant\n")
    assert not opens_thinking("Say <thinking> in a word")
    # a tag in the conversation (a question about it, a tool's result) opens nothing
    assert not opens_thinking("<|im_start|>user\nWhy write <think> first?<|im_end|>\n<|im_start|>assistant\n")
    assert opens_thinking("...<|im_start|>assistant\n<think>\nThe user", prefill="<think>\nThe user")
    assert not opens_thinking("...<|im_start|>assistant\n<think>a</think>b", prefill="<think>a</think>b")
    assert template_thinks("{{ '<think>' + message.reasoning_content + '</think>' }}")
    assert template_thinks({"default": "{{ messages }}", "think": "<think>{{ x }}</think>"})
    assert not template_thinks("{{ messages }}") and not template_thinks(None)


def test_a_thinking_answer_with_hermes_calls_splits_the_same_at_every_piece_boundary():
    """Qwen3's way with tools: the block, then calls in tags; the calls are read from the content only (a tag inside
    the thinking is thought, not a call)."""
    from app.server.openai_api import AnswerReader
    from app.server.protocol import ChatCompletionRequest
    from app.server.tools import plan

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]})
    tools = plan(body, "hermes")
    text = ('<think>\nI could write <tool_call>{"name": "no"}</tool_call> here.\n</think>\n\nLet me check.\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    rng = random.Random(1)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 30))) if trial else list(range(1, len(text)))
        reader, fields = AnswerReader(tools, thinking=False), {}
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for i, piece in enumerate(pieces):
            for key, value in reader.feed(piece, last=i == len(pieces) - 1).items():
                fields[key] = fields.get(key, [] if key == "tool_calls" else "") + value
        assert fields["reasoning_content"] == fields["reasoning"] == (
            'I could write <tool_call>{"name": "no"}</tool_call> here.')
        assert fields["content"] == "Let me check.\n"
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in fields["tool_calls"]] == [
            ("get_weather", '{"city": "Paris"}')] and reader.tools.closed


@pytest.mark.parametrize("thinking, text, content", [
    (False, "<think>\n\n</think>\n\n", None),  # an empty block closed, nothing after: null, as vLLM
    (True, "  ", None),  # the prompt opened the block; the answer ended (EOS) inside it with nothing in it
    (False, "<think>Hmm.</think>", None),
    (False, "<think>Hmm.</think>Paris.", "Paris."),
    (False, "", ""),  # no block: an empty answer is empty text
    (False, "  \n", "  \n"),
])
def test_a_thinking_block_with_no_answer_after_it_has_null_content(thinking, text, content):
    from types import SimpleNamespace

    from app.server.openai_api import AnswerReader, chat_message

    seq = SimpleNamespace(text=SimpleNamespace(text=text, finish_reason=None, stop_reason=None))
    assert chat_message(seq, None, AnswerReader(None, thinking))["message"]["content"] == content


def _ends(pieces: list[str]) -> tuple[str, list[int]]:
    return "".join(pieces), [sum(map(len, pieces[:i + 1])) for i in range(len(pieces))]


@pytest.mark.parametrize(("opened", "pieces", "count"), [
    (False, ["<think>", "a", " b", "</think>", "\n\n", "Rome", "<|im_end|>"], 4),  # the tags count
    (False, ["\n", "<th", "ink>", "a", "</th", "ink>", "Rome"], 6),  # a tag over two tokens, after whitespace
    (False, ["a", "</think>", "Rome"], 0),  # no block opened: the tag is content
    (True, ["a", " b", "</think>", "Rome"], 3),  # the prompt opened it
    (True, ["a", " b", "</think>", ""], 3),  # an end token after the close adds no text: not the block's
    (True, ["a", " b", " c"], 3),  # cut inside the block: all of it
    (True, ["a</think>Ro", "me"], 1),  # a token across the close counts with the block
    (False, ["Rome", "."], 0),
])
def test_thinking_tokens_count_those_up_to_the_closing_tag(opened, pieces, count):
    text, ends = _ends(pieces)
    assert thinking_tokens(text, ends, opened) == count
