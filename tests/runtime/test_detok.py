"""runtime/engine/_detok.py: the incremental detokenizer gives exactly the text a decode of all ids gives, for the
tokenizers the tests build (byte-level BPE as the tiny models ship, and a SentencePiece-style Metaspace BPE), with
multi-byte characters split over tokens, while decoding only a short window of recent ids per token."""

from __future__ import annotations

import random

import pytest

from examples.make_tiny_moe import build_tokenizer
from shardtool.runtime import Detokenizer
from shardtool.runtime.engine._detok import MAX_HELD

TEXTS = ["plain ascii words", "é", "a€b", "😀 then 😀😀", "ünïcödé ß ∑ 日本語", "  two  spaces ", "x\ny\n"]


def metaspace_tokenizer(vocab_size: int):
    """A SentencePiece-style BPE ("▁" marks a space; byte fallback for characters it did not learn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + TEXTS, trainer)
    tok.add_tokens(alphabet)
    return tok


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tok(request):
    return build_tokenizer(512) if request.param == "byte_level" else metaspace_tokenizer(400)


class CountingDecode:
    """The tokenizer's decode, remembering how many ids each call was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def __call__(self, ids) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(list(ids), skip_special_tokens=True)


def deltas(tok, ids) -> tuple[list[str], CountingDecode]:
    decode = CountingDecode(tok)
    detok = Detokenizer(decode)
    out = [detok.push(i) for i in ids]
    out.append(detok.finish())
    assert detok.tokens == len(ids)
    return out, decode


def test_random_ids_give_the_full_decode(tok):
    # SentencePiece's byte fallback decodes a run of byte tokens that is not UTF-8 into one U+FFFD per token (an
    # ASCII byte in the run too): only the whole run decides, so random ids there are whole characters' bytes.
    rng = random.Random(0)
    vocab = tok.get_vocab()
    pieces = [[i] for t, i in vocab.items() if not t.startswith("<0x")]
    if len(pieces) < len(vocab):
        pieces += [byte_ids(tok, c) for c in "é€😀ß日"]
    for _ in range(300):
        ids = [i for _ in range(rng.randrange(1, 40)) for i in rng.choice(pieces)]
        assert "".join(deltas(tok, ids)[0]) == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_comes_back_whole(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    out, _ = deltas(tok, ids)
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in out), out  # a split character is held, then sent whole


def byte_ids(tok, text: str) -> list[int]:
    """Each UTF-8 byte of `text` as its own token (the byte-level alphabet, or the <0xNN> byte-fallback tokens)."""
    if "<0x41>" in tok.get_vocab():
        return [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode()]
    table = bytes_to_unicode()
    return [tok.token_to_id(table[b]) for b in text.encode()]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_a_character_split_over_byte_tokens_appears_once_complete(tok, char):
    ids = byte_ids(tok, "a" + char + "b")
    out, _ = deltas(tok, ids)
    n = len(char.encode())
    assert out[0] == "a" and out[1:n] == [""] * (n - 1) and out[n] == char and "".join(out) == "a" + char + "b"


def test_each_token_decodes_a_short_window_not_the_whole_generation(tok):
    ids = tok.encode(" ".join(TEXTS * 20), add_special_tokens=False).ids
    assert len(ids) > 200
    out, decode = deltas(tok, ids)
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
    assert max(decode.sizes) <= 2 * MAX_HELD  # a full re-decode would reach len(ids)
    assert sum(decode.sizes) <= 8 * len(ids)


def test_bytes_no_token_completes_are_sent_as_decoded(tok):
    ids = [tok.token_to_id("x")] + byte_ids(tok, "€")[:-1]  # the euro sign's last byte never comes
    out, _ = deltas(tok, ids)
    assert out[:-1] == ["x", "", ""] and "".join(out) == tok.decode(ids) and "\ufffd" in out[-1]
