"""Incremental detokenization and stop strings, checked against whole-sequence `decode` of the real tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import PreTrainedTokenizerBase

from backends.server.detokenizer import StopStringDetokenizer

TEXTS = [
    "Hello world, this is a test of streaming.",
    " héllo 日本語 😀 naïve café — “quotes”",
    "def f(x):\n    return x * 2\n\n\nprint(f(3))",
    "aaaa bbbb aaaa STOP here END and more",
]


def reference(tok: PreTrainedTokenizerBase, ids: list[int], stops: list[str]) -> tuple[str, int]:
    """Independent reference: the first token count whose full decode holds a stop, and the text cut there.

    A decode ending in U+FFFD stops inside a character whose bytes are still coming; text is only
    settled (and streamed) once the character is whole.
    """
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], n
    return tok.decode(ids, skip_special_tokens=True), len(ids)


def run(tok: PreTrainedTokenizerBase, ids: list[int], stops: list[str]) -> tuple[str, str, int]:
    """(final text, concatenation of streamed pieces, tokens consumed)."""
    detok = StopStringDetokenizer(tok.backend_tokenizer, stops)
    pieces = []
    consumed = len(ids)
    for i, token_id in enumerate(ids):
        stopped = detok.push(token_id)
        piece = detok.take()
        for stop in stops:   # nothing streamed may be (part of) a stop string that the final text cuts
            assert stop not in "".join(pieces) + piece
        pieces.append(piece)
        if stopped:
            consumed = i + 1
            break
    pieces.append(detok.finish())
    return detok.text, "".join(pieces), consumed


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode_without_stops(smollm2_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = [*smollm2_tokenizer.encode(text), smollm2_tokenizer.eos_token_id]
    final, streamed, consumed = run(smollm2_tokenizer, ids, [])
    assert final == streamed == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert consumed == len(ids)


@pytest.mark.parametrize(("text", "stops"), [
    ("aaaa bbbb aaaa STOP here END and more", ["STOP"]),
    ("aaaa bbbb aaaa STOP here END and more", ["END", "a S"]),     # the earliest match wins
    ("aaaa bbbb aaaa STOP here END and more", ["b aa"]),           # spans token boundaries
    (" héllo 日本語 😀 naïve café", ["語 😀"]),                       # multi-byte, split tokens
    ("def f(x):\n    return x * 2\n\n\nprint(f(3))", ["\n\n"]),
    ("Hello world", ["zzz"]),                                     # never matches: all text comes out
])
def test_stop_strings(smollm2_tokenizer: PreTrainedTokenizerBase, text: str, stops: list[str]) -> None:
    ids = smollm2_tokenizer.encode(text)
    final, streamed, consumed = run(smollm2_tokenizer, ids, stops)
    expected_text, expected_consumed = reference(smollm2_tokenizer, ids, stops)
    assert final == streamed == expected_text
    assert consumed == expected_consumed


def test_the_stop_string_that_matched_is_named(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    """What the worker reports as `stop_reason` (vLLM's field): the earliest match, or None."""
    ids = smollm2_tokenizer.encode("aaaa bbbb aaaa STOP here END and more")
    for stops, matched in ((["END", "a S"], "a S"), (["END"], "END"), (["zzz"], None)):
        detok = StopStringDetokenizer(smollm2_tokenizer.backend_tokenizer, stops)
        for token_id in ids:
            if detok.push(token_id):
                break
        assert detok.matched_stop == matched


def test_stop_spanning_tokens_is_held_back(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = smollm2_tokenizer.encode("one two three four")
    assert len(ids) >= 4
    detok = StopStringDetokenizer(smollm2_tokenizer.backend_tokenizer, [" three four"])
    sent = ""
    for token_id in ids[:3]:          # "one", " two", " three": " three" could begin the stop string
        assert not detok.push(token_id)
        sent += detok.take()
    assert sent == "one two"
    assert detok.push(ids[3])
    assert sent + detok.take() + detok.finish() == "one two"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(["ab", "ba", " a", "b ", "é", "日", "\n", "ab ba", "😀"]), min_size=1,
                      max_size=20),
       stop_start=st.integers(0, 40), stop_len=st.integers(1, 6))
def test_stop_property(smollm2_tokenizer: PreTrainedTokenizerBase, words: list[str], stop_start: int,
                       stop_len: int) -> None:
    text = "".join(words)
    stop = text[stop_start % len(text):][:stop_len]
    ids = smollm2_tokenizer.encode(text)
    final, streamed, consumed = run(smollm2_tokenizer, ids, [stop])
    expected_text, expected_consumed = reference(smollm2_tokenizer, ids, [stop])
    assert final == streamed == expected_text
    assert consumed == expected_consumed
