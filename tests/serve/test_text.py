"""serve/_text.py: token ids -> text deltas with stop strings, on synthetic pieces (exact boundaries) and on the
tiny models' real byte-level BPE tokenizer (multi-byte characters split over byte tokens)."""

from __future__ import annotations

import random

import pytest

from examples.make_tiny_moe import build_tokenizer
from shardtool.serve._text import TextStream


def pieces_decoder(pieces: list[str]):
    return lambda ids: "".join(pieces[i] for i in ids)


def run(stream: TextStream, ids) -> list[str]:
    out = [stream.push(i) for i in ids]
    out.append(stream.finish())
    return out


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512)


def byte_token(tok, b: int) -> int:
    """The id of the byte-level token for one raw byte (GPT-2's byte-to-unicode alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if b in printable:
        ch = chr(b)
    else:
        ch = chr(256 + sorted(set(range(256)) - set(printable)).index(b))
    tid = tok.token_to_id(ch)
    assert tid is not None
    return tid


def byte_ids(tok, text: str) -> list[int]:
    return [byte_token(tok, b) for b in text.encode("utf-8")]


def decoder(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def test_without_stop_strings_the_deltas_are_the_decoded_text(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 30))]
        stream = TextStream(decoder(tok))
        assert "".join(run(stream, ids)) == tok.decode(ids, skip_special_tokens=True) == stream.text
        assert not stream.stopped and stream.tokens == len(ids)


@pytest.mark.parametrize("char", ["é", "€", "😀", "ünïcödé"])
def test_a_character_split_over_byte_tokens_is_sent_whole(tok, char):
    ids = byte_ids(tok, "a" + char + "b")
    stream = TextStream(decoder(tok))
    deltas = run(stream, ids)
    assert "".join(deltas) == "a" + char + "b"
    assert all("\ufffd" not in d for d in deltas), deltas
    first_char_bytes = len(char[0].encode())
    # "a" at once; nothing while the first character is incomplete; then it appears whole.
    assert deltas[0] == "a" and deltas[1:first_char_bytes] == [""] * (first_char_bytes - 1)
    assert deltas[first_char_bytes] == char[0]


def test_an_incomplete_character_at_the_end_is_sent_as_decoded(tok):
    ids = byte_ids(tok, "x€")[:-1]  # the euro sign's last byte never comes
    stream = TextStream(decoder(tok))
    deltas = run(stream, ids)
    assert deltas[:-1] == ["x", "", ""] and deltas[-1] == tok.decode(ids)[1:] and "\ufffd" in deltas[-1]


def test_a_stop_string_split_over_tokens(tok):
    ids = byte_ids(tok, "Hello END world")
    stream = TextStream(decoder(tok), ("END",))
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) == "Hello " == stream.text and stream.stopped
    assert stream.tokens == len("Hello END")  # the token that completed the stop string counts; none after it
    assert deltas[len("Hello "):] == [""] * (len(ids) - len("Hello "))
    assert stream.finish() == ""


def test_a_stop_string_with_a_multibyte_character_split_over_tokens(tok):
    stream = TextStream(decoder(tok), ("né",))
    assert "".join(run(stream, byte_ids(tok, "un née"))) == "un " and stream.stopped


def test_a_held_prefix_is_sent_when_the_text_goes_another_way():
    stream = TextStream(pieces_decoder(["x", "E", "N", "T", "D"]), ("END",))
    assert [stream.push(i) for i in (0, 1, 2)] == ["x", "", ""]  # "EN" could start "END"
    assert stream.push(3) == "ENT" and not stream.stopped
    assert stream.finish() == ""


def test_a_held_prefix_is_sent_at_the_end():
    stream = TextStream(pieces_decoder(["x", "EN"]), ("END",))
    assert run(stream, [0, 1]) == ["x", "", "EN"] and stream.text == "xEN" and not stream.stopped


def test_a_stop_string_inside_one_token_cuts_it():
    stream = TextStream(pieces_decoder(["ab", "cSTOPd", "e"]), ("STOP",))
    assert run(stream, [0, 1, 2]) == ["ab", "c", "", ""] and stream.text == "abc" and stream.tokens == 2


def test_the_earliest_of_several_stop_strings_wins():
    stream = TextStream(pieces_decoder(["one two three"]), ("three", "two", "zzz", "e t"))
    assert stream.push(0) == "on" and stream.stopped  # "e t" begins at 2, before "two" at 4


def test_a_stop_string_at_the_very_start_gives_empty_text():
    stream = TextStream(pieces_decoder(["<<", "end"]), ("<<end",))
    assert run(stream, [0, 1]) == ["", "", ""] and stream.text == "" and stream.stopped


def test_the_longest_end_that_could_start_a_stop_string_is_held():
    stream = TextStream(pieces_decoder(["aab", "a", "c"]), ("aac", "bac"))
    assert stream.push(0) == "aa"  # "b" may begin "bac"
    assert stream.push(1) == ""  # "ba" may too
    assert stream.push(2) == "" and stream.stopped and stream.text == "aa"


def test_no_token_no_text():
    stream = TextStream(pieces_decoder([]), ("x",))
    assert stream.finish() == "" and stream.text == "" and stream.tokens == 0
