"""The text a request sends back: whole characters only, nothing of a stop string, all of it in the end."""

import random

import pytest
from serve_helpers import byte_tokenizer
from tiny_models import tiny_tokenizer

from linearize.serve.detokenize import IncrementalDecoder, TextStream

TEXTS = ["naïve café, 🐋 and €5", "plain ascii text", "日本語のテキスト", "🐋🐋🐋", "a\u0301 combining"]


@pytest.fixture(scope="module")
def byte_tok():
    return byte_tokenizer()


def pieces(stream, ids: list[int]) -> list[str]:
    return [stream.push(t) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_decoder_never_splits_a_character_and_adds_up_to_the_whole_decode(byte_tok, text):
    ids = byte_tok.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(byte_tok)
    out = pieces(decoder, ids)
    assert all("\ufffd" not in piece for piece in out)
    assert "".join(out) + decoder.flush() == text == byte_tok.decode(ids)
    assert decoder.text == text


def test_decoder_holds_a_split_character_until_its_last_byte(byte_tok):
    ids = byte_tok.encode("a€", add_special_tokens=False)  # "€" is three bytes, three tokens here
    assert len(ids) == 4
    assert pieces(IncrementalDecoder(byte_tok), ids) == ["a", "", "", "€"]


def test_decoder_flushes_an_incomplete_character_at_the_end(byte_tok):
    ids = byte_tok.encode("ok€", add_special_tokens=False)[:-1]  # the last byte never comes
    decoder = IncrementalDecoder(byte_tok)
    assert "".join(pieces(decoder, ids)) == "ok"
    assert decoder.flush() == "\ufffd"


def test_decoder_matches_the_whole_decode_on_random_valid_text(byte_tok):
    rng = random.Random(0)
    alphabet = "abc xyzéü€🐋日\n"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = byte_tok.encode(text, add_special_tokens=False)
        decoder = IncrementalDecoder(byte_tok)
        assert "".join(pieces(decoder, ids)) + decoder.flush() == text


def test_special_tokens_decode_to_nothing():
    tok = tiny_tokenizer()
    ids = [*tok.encode("ab", add_special_tokens=False), tok.eos_token_id, *tok.encode("c", add_special_tokens=False)]
    decoder = IncrementalDecoder(tok)
    assert "".join(pieces(decoder, ids)) + decoder.flush() == "abc"


def test_stream_cuts_before_a_stop_string_that_spans_tokens():
    tok = tiny_tokenizer()
    stream = TextStream(tok, ["||"])
    out = pieces(stream, tok.encode("ab|c||d", add_special_tokens=False))
    # "|" waits: it could start the stop string; once "c" comes it cannot, and goes out with "c".
    assert out == ["a", "b", "", "|c", "", "", ""]
    assert stream.stopped and stream.finish() == ""


def test_stream_releases_a_held_prefix_at_the_end():
    tok = tiny_tokenizer()
    stream = TextStream(tok, ["STOP"])
    out = pieces(stream, tok.encode("go ST", add_special_tokens=False))
    assert "".join(out) == "go " and stream.finish() == "ST"
    assert not stream.stopped


def test_stream_stops_at_the_earliest_of_several_stop_strings():
    tok = tiny_tokenizer()
    stream = TextStream(tok, ["xyz", "b"])
    text = "".join(pieces(stream, tok.encode("aaxybxyz", add_special_tokens=False)))
    assert text == "aaxy" and stream.stopped


def test_stream_with_a_stop_string_of_several_bytes(byte_tok):
    stream = TextStream(byte_tok, ["🐋"])
    out = pieces(stream, byte_tok.encode("fish 🐋 whale", add_special_tokens=False))
    assert "".join(out) == "fish " and stream.stopped
    assert stream.tokens == len("fish 🐋".encode())  # none after the match


def test_stream_counts_every_token_it_was_given():
    tok = tiny_tokenizer()
    stream = TextStream(tok)
    pieces(stream, tok.encode("hello", add_special_tokens=False))
    assert stream.tokens == 5 and stream.finish() == ""


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="empty"):
        TextStream(tiny_tokenizer(), ["x", ""])
