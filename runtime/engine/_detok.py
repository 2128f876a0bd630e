"""Generated token ids -> text, incrementally: the one detokenizer `verify-and-run` prints with and `serve` streams
with (its stop strings are the serve layer's own, on top of this).

Each token decodes a short window of recent ids, never the whole generation: the ids from the last point where the
text was emitted (for the decoder's context: a SentencePiece "▁" or a byte-level space depends on the token before)
to the newest. What the window adds past its own prefix is emitted, unless it ends in U+FFFD: a byte-level token
can end inside a UTF-8 character, which a later token completes, so that is held back. The deltas joined are the
text a decode of all the ids gives (tests/runtime/test_detok.py holds this for the tokenizers the tests build). One
exception, by the decoder's design: SentencePiece's byte fallback turns a run of byte tokens that is not UTF-8 into
one U+FFFD per token, which only the whole run decides; there the U+FFFDs may fall differently.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
# Tokens held back at most while the text ends in U+FFFD: a UTF-8 character is at most 4 bytes (and a skipped special
# token decodes to nothing), so more means bytes no later token completes (the decoder's U+FFFD stays); they are then emitted as decoded.
MAX_HELD = 16


class Detokenizer:
    """`decode(ids) -> str` decodes a sequence of ids (special tokens skipped). `push(token)` returns the text the
    token completes (often ""), `finish()` the held-back rest."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._window: list[int] = []  # ids from the prefix start on
        self._prefix = 0  # window[:_prefix]: the ids before the last emitted text (context only)
        self._prefix_text = ""  # their decoded text
        self.tokens = 0  # ids pushed

    def push(self, token: int) -> str:
        self._window.append(token)
        self.tokens += 1
        return self._advance(final=False)

    def finish(self) -> str:
        """Generation ended: what is held back (a trailing U+FFFD included, as a full decode gives it)."""
        return self._advance(final=True) if len(self._window) > self._prefix else ""

    def _advance(self, *, final: bool) -> str:
        text = self._decode(self._window)
        held = len(self._window) - self._prefix
        if not final and held <= MAX_HELD and (text.endswith(REPLACEMENT) or len(text) <= len(self._prefix_text)):
            return ""
        delta = text[len(self._prefix_text):]
        # The ids just emitted become the next window's prefix: enough context, and the window stays short.
        self._window = self._window[self._prefix:]
        self._prefix = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta
