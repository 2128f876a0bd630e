"""serve/_scores.py: the names and bytes a score's tokens are shown with, and OpenAI's two shapes."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from examples.make_tiny_moe import build_tokenizer
from shardtool.runtime import TokenLogprobs
from shardtool.serve._scores import CompletionScores, TokenText, chat_scores


@pytest.fixture(scope="module")
def byte_level():
    return build_tokenizer(512)


@pytest.fixture(scope="module")
def byte_fallback():
    """A Llama-style vocabulary: whole pieces, and <0xNN> tokens for the bytes of anything else."""
    vocab = {"<unk>": 0, "</s>": 1, "▁the": 2, "é": 3, "<0xC3>": 4, "<0xA9>": 5, "<0xE2>": 6}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["</s>"])
    return tok


def _id(tok, piece: str) -> int:
    return tok.token_to_id(piece)


# name -> (tokenizer fixture, vocabulary piece or id, shown text, bytes)
NAMES = {
    "byte-level-word": ("byte_level", "Ġthe", " the", b" the"),
    "byte-level-special": ("byte_level", "</s>", "</s>", b"</s>"),
    "byte-level-lead-byte": ("byte_level", "Ã", "bytes:\\xc3", b"\xc3"),  # the first byte of é: not text alone
    "byte-level-continuation": ("byte_level", "©", "bytes:\\xa9", b"\xa9"),
    "byte-fallback-lead-byte": ("byte_fallback", "<0xC3>", "bytes:\\xc3", b"\xc3"),
    "byte-fallback-word": ("byte_fallback", "▁the", " the", b" the"),
    "byte-fallback-whole-character": ("byte_fallback", "é", "é", "é".encode()),
    "no-tokenizer": (None, 7, "token_id:7", b"token_id:7"),
}


@pytest.mark.parametrize("name", NAMES)
def test_token_names(name, request):
    which, piece, text, data = NAMES[name]
    tok = request.getfixturevalue(which) if which else None
    token = piece if tok is None else _id(tok, piece)
    assert token is not None, piece
    assert TokenText(tok).shown(token) == (text, data)


def test_byte_level_names_are_unique(byte_level):
    names = [TokenText(byte_level)(t) for t in range(byte_level.get_vocab_size())]
    assert len(set(names)) == len(names)


def test_completion_scores_continue_their_offsets_across_chunks():
    text = TokenText(None)
    scores = CompletionScores(text)
    first = scores.render([(1, None), (2, TokenLogprobs(2, -0.5, ((3, -0.25),)))], start=0)
    assert first == {"tokens": ["token_id:1", "token_id:2"], "token_logprobs": [None, -0.5],
                     "top_logprobs": [None, {"token_id:3": -0.25, "token_id:2": -0.5}], "text_offset": [0, 10]}
    assert scores.render([(4, TokenLogprobs(4, -1.0, ()))])["text_offset"] == [20]
    assert scores.render([(4, TokenLogprobs(4, -1.0, ()))], start=3)["text_offset"] == [3]


def test_chat_scores_list_exactly_the_alternatives():
    got = chat_scores([(2, TokenLogprobs(2, -0.5, ((3, -0.25), (2, -0.5))))], TokenText(None))
    entry = {"token": "token_id:2", "logprob": -0.5, "bytes": list(b"token_id:2")}
    assert got == {"content": [{**entry, "top_logprobs": [{"token": "token_id:3", "logprob": -0.25,
                                                           "bytes": list(b"token_id:3")}, entry]}]}
