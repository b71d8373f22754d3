"""Logprob tokens as text (specdec.serve.token_text) and the field table (specdec.serve.fields), without a server:
the tokens of any id sequence join to its decoded text and their bytes to its UTF-8, whole or streamed in chunks,
with split characters, invalid bytes, skipped specials and ids past the vocabulary; a stop string's cut."""

import random

import msgspec
import pytest

from specdec.datamodel.sequence import Logprob
from specdec.serve.fields import ignored_fields
from specdec.serve.openai_protocol import ChatCompletionRequest, CompletionRequest, decode_body
from specdec.serve.token_text import TokenText


@pytest.fixture(scope="module")
def tt():
    from specdec.engine.loader import load_tokenizer

    return TokenText(load_tokenizer("tiny-random-llama"))


def sequences(tok):
    yield tok("Hello Berlin\n")["input_ids"]
    yield tok("é 😊 x €")["input_ids"]
    yield tok("a 😊")["input_ids"][:-2]  # ends inside the emoji: the text shows U+FFFD
    yield tok.convert_tokens_to_ids(["Ã", "a", "<|im_end|>", "b"])  # 0xC3 then "a": invalid; a special (EOS)
    yield [300, *tok("H")["input_ids"], 400]  # ids past the tokenizer's 259 (the model's padded rows)
    rng = random.Random(0)
    for _ in range(30):  # noise, as the tiny random model writes it
        yield [rng.randrange(0, 259) for _ in range(rng.randrange(1, 40))]


def test_tokens_join_to_the_text_and_bytes_to_its_utf8(tt):
    tok = tt.tokenizer
    for ids in sequences(tok):
        for skip in (True, False):
            text = tok.decode(ids, skip_special_tokens=skip)
            lps = [{t: Logprob(-1.0, 1)} for t in ids]
            lp = tt.completion_logprobs(ids, lps, 0, skip_special_tokens=skip, text=text)
            assert "".join(lp["tokens"]) == text, ids
            assert all(text[o:o + len(t)] == t for t, o in zip(lp["tokens"], lp["text_offset"]))
            assert all(top == {t: -1.0} for t, top in zip(lp["tokens"], lp["top_logprobs"]))
            chat = tt.chat_logprobs(ids, lps, 0, skip_special_tokens=skip, text=text)["content"]
            assert b"".join(bytes(c["bytes"]) for c in chat) == text.encode(), ids


def test_a_split_character_carries_raw_bytes_as_openai(tt):
    ids = tt.tokenizer("😊")["input_ids"]  # four byte tokens
    chat = tt.chat_logprobs(ids, [{t: Logprob(-1.0, 1)} for t in ids], 0, text="😊")["content"]
    assert [c["token"] for c in chat] == ["", "", "", "😊"]
    assert [c["bytes"] for c in chat] == [[0xF0], [0x9F], [0x98], [0x8A]]


def test_streamed_chunks_join_like_the_whole(tt):
    """A stream names each chunk's tokens in the context of the earlier ones: the chunks join to the text."""
    tok = tt.tokenizer
    rng = random.Random(1)
    for ids in sequences(tok):
        text = tok.decode(ids, skip_special_tokens=True)
        lps = [{t: Logprob(-1.0, 1)} for t in ids]
        cuts = sorted({0, len(ids), *(rng.randrange(len(ids) + 1) for _ in range(3))})
        tokens, raw = [], b""
        for a, b in zip(cuts, cuts[1:]):
            last = b == len(ids)
            seen = "".join(tokens)
            part = tt.chat_logprobs(ids[:b], lps[a:b], 0, start=a, text=text[len(seen):] if last else None)
            tokens += [c["token"] for c in part["content"]]
            raw += b"".join(bytes(c["bytes"]) for c in part["content"])
        assert "".join(tokens) == text and raw == text.encode(), (ids, cuts)


def test_a_stop_string_cut_and_alternatives_named_by_their_text(tt):
    ids = tt.tokenizer("abc STOP def")["input_ids"]
    x = tt.tokenizer("X")["input_ids"][0]
    lp = tt.completion_logprobs(ids, [{t: Logprob(-1.0, 1), x: Logprob(-2.0, 2)} for t in ids], 2,
                                text="abc ")  # the text ends before the stop string
    assert "".join(lp["tokens"]) == "abc " and lp["tokens"][:4] == ["a", "b", "c", " "]
    assert lp["top_logprobs"][0] == {"a": -1.0, "X": -2.0}  # the alternative under its text


def test_the_field_table():
    def req(typ, body):
        return decode_body(msgspec.json.encode(body), typ)

    c = req(CompletionRequest, {"prompt": "x", "priority": 0, "use_beam_search": False, "guided_json": None,
                                "user": "u", "suffix": "", "spaces_between_special_tokens": True})
    assert ignored_fields(c, "completions") == ([], [])
    c = req(CompletionRequest, {"prompt": "x", "priority": 2, "structural_tag": "{}", "tools": [{"type": "function"}]})
    assert ignored_fields(c, "completions") == (["priority", "structural_tag"], ["tools"])
    m = req(ChatCompletionRequest, {"messages": [], "echo": True, "tool_choice": "auto", "store": True,
                                    "response_format": {"type": "text"}, "suffix": "x"})
    assert ignored_fields(m, "chat") == (["store", "echo"], ["suffix"])
