"""Incremental detokenizing: equals a full decode (multi-byte characters split across byte tokens), stop
strings cut the text and hold back what could start one, skip_special_tokens is honoured."""

import pytest

from specdec.engine.tiny import tiny_tokenizer
from specdec.core.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld ✓ 日本語", "emoji 🙂 end"])
def test_one_token_at_a_time_equals_full_decode(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok)
    streamed = ""
    for t in ids:
        d.add([t])
        streamed += d.stream_delta(False)
        assert "\ufffd" not in streamed  # a half character is never shown
    assert d.finish() == tok.decode(ids) == text
    assert streamed + d.stream_delta(True) == text


def test_stop_string_cuts_and_holds_back(tok):
    ids = tok("abc STOP def", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    shown = ""
    for i, t in enumerate(ids):
        if d.add([t]) is not None:
            break
        shown += d.stream_delta(False)
        assert "S" not in shown  # "S", "ST", "STO" could start the stop string: held back
    assert d.stop_reason == "STOP" and d.text == "abc " and len(d.token_ids) == i + 1
    d2 = IncrementalDetokenizer(tok, stop=["STOP"], include_stop_str_in_output=True)
    d2.add(ids)  # tokens after the stop are ignored
    assert d2.text == "abc STOP" and d2.token_ids == ids[:len(d.token_ids)]


def test_skip_special_tokens(tok):
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    keep.add(ids)
    skip = IncrementalDetokenizer(tok)
    skip.add(ids)
    assert keep.finish() == "hi" + tok.eos_token and skip.finish() == "hi"
