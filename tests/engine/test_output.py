"""Incremental detokenization and stop strings, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from app.engine.output import Detokenizer, SequenceText
from app.engine.request import FinishReason


@pytest.fixture(scope="module")
def tokenizer():
    from app.model.tokenizer import load_tokenizer
    from app.model.source import resolve_source
    from app.spec.schema import ModelSpec

    return load_tokenizer(resolve_source(ModelSpec()))


TEXTS = [
    "Plain ASCII, with punctuation!",
    "Café crème brûlée: naïve façade.",
    "Emoji 🙂🚀 and flags 🇫🇷 split across byte tokens",
    "日本語のテキストと中文混合",
    "  leading spaces\nand\ttabs  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_decode_equals_decoding_everything(tokenizer, text):
    prompt = tokenizer("Say:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = Detokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_multibyte_character_waits_for_all_its_tokens(tokenizer):
    ids = tokenizer("🙂", add_special_tokens=False).input_ids
    assert len(ids) > 1  # byte-level BPE splits it
    detok = Detokenizer(tokenizer, [])
    pieces = [detok.add(t) for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🙂"


def _sequence(tokenizer, stop):
    return SequenceText(Detokenizer(tokenizer, []), stop)


def test_stop_string_ends_the_text_before_it(tokenizer):
    seq = _sequence(tokenizer, ("STOP",))
    ended = [seq.add(t, None) for t in tokenizer("go on STOP and more", add_special_tokens=False).input_ids]
    assert any(ended) and seq.finish_reason == FinishReason.STOP
    assert seq.text == "go on " and seq.take_new_text() == "go on "


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(tokenizer):
    """vLLM's include_stop_str_in_output: the text runs through the stop string that ended it (the first to start,
    the longest of those), nothing after it; streamed, nothing is held back, and the pieces make the same text."""
    ids = tokenizer("go on STOP and more", add_special_tokens=False).input_ids
    for stops, text in [(("STOP",), "go on STOP"), (("OP", "STOP", "and"), "go on STOP"), (("on", "STOP"), "go on")]:
        seq = SequenceText(Detokenizer(tokenizer, []), stops, include_stop=True)
        pieces = []
        for t in ids:
            ended = seq.add(t, None)
            pieces.append(seq.take_new_text())
            if ended:
                break
        assert seq.finish_reason == FinishReason.STOP and seq.text == text and "".join(pieces) == text, stops
        assert pieces[0] == tokenizer.decode(ids[:1])  # not held back (without it: "", it could begin "STOP")


def test_include_stop_str_in_output_keeps_a_stop_tokens_text_too(tokenizer):
    """As vLLM's: the stop token id that ended the sequence adds its text where include_stop_str_in_output is set
    (and none otherwise); its stop_reason is the id either way."""
    ids = tokenizer(" Paris.\n", add_special_tokens=False).input_ids
    newline = ids[-1]
    for include, text in ((False, " Paris."), (True, " Paris.\n")):
        seq = SequenceText(Detokenizer(tokenizer, []), (), (newline,), include_stop=include)
        for t in ids[:-1]:
            assert seq.take(t, None, None) is None
        assert seq.take(newline, None, FinishReason.STOP) == FinishReason.STOP
        assert seq.text == text and seq.stop_reason == newline and seq.token_ids == ids


def test_stop_string_split_across_tokens_never_leaks_while_streaming(tokenizer):
    stop = ("</answer>",)
    ids = tokenizer("The result is 42</answer> trailing", add_special_tokens=False).input_ids
    seq, streamed = _sequence(tokenizer, stop), ""
    for t in ids:
        done = seq.add(t, None)
        streamed += seq.take_new_text()
        assert not any(streamed.endswith(stop[0][:k]) for k in range(2, len(stop[0]) + 1)) or done
        if done:
            break
    assert streamed == "The result is 42" and "</" not in streamed


def test_text_is_released_once_it_cannot_start_a_stop_string(tokenizer):
    seq = _sequence(tokenizer, ("xyz",))
    for t in tokenizer("hello world", add_special_tokens=False).input_ids:
        seq.add(t, None)
    assert seq.take_new_text() == "hello wor"  # the last 2 characters could still begin "xyz"
    seq.finish_reason = FinishReason.LENGTH
    assert seq.take_new_text() == "ld"


def test_hidden_stop_token_is_kept_in_ids_but_not_in_text(tokenizer):
    seq = _sequence(tokenizer, ())
    eos = tokenizer.eos_token_id
    seq.add(tokenizer("Hi", add_special_tokens=False).input_ids[0], None)
    seq.add(eos, None, hidden=True)
    assert seq.token_ids[-1] == eos and seq.text == "Hi"
    assert list(seq.text_ends) == [2, 2]  # each token's end in the text, the hidden one's too (thinking_tokens)


class _Pieces:
    """A tokenizer whose token i is pieces[i]: exact control over where each token's text starts and ends."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.pieces[i] for i in ids)


def _run(pieces: list[str], stop: tuple[str, ...], min_tokens: int) -> tuple[str, int, FinishReason | None]:
    from app.engine.params import SamplingParams

    seq = SequenceText.of(_Pieces(pieces), [0], SamplingParams(stop=stop, min_tokens=min_tokens), None)
    for token in range(1, len(pieces)):
        if seq.take(token, None, None):
            break
    return seq.text, len(seq.token_ids), seq.finish_reason


@pytest.mark.parametrize(("stop", "min_tokens", "text", "tokens", "reason"), [
    # vLLM's own case (tests/detokenizer/test_min_tokens.py): only an "e" ending in a token after the 2nd counts
    (("e",), 2, " is Lee, and I'm a stud", 8, FinishReason.STOP),
    (("e",), 0, " is L", 2, FinishReason.STOP),
    # one ending inside the min_tokens-th token does not count either
    (("Lee",), 2, " is Lee, and I'm a student!", 9, None),
    (("Lee",), 1, " is ", 2, FinishReason.STOP),
    # each stop string is looked for where it could end in the new text: one that ended within the first
    # min_tokens tokens is not found later because a longer one widens the window
    ((" is", "and I'm a"), 3, " is Lee, ", 7, FinishReason.STOP),
])
def test_stop_strings_count_only_after_min_tokens(stop, min_tokens, text, tokens, reason):
    pieces = ["Hello", " is", " Lee", ",", " and", " I", "'m", " a", " student", "!"]
    assert _run(pieces, stop, min_tokens) == (text, tokens, reason)
