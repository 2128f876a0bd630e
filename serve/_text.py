"""Generated token ids -> text deltas, and the request's stop strings.

The runtime's `Detokenizer` turns each token into the text it completes (a byte-level token can end inside a UTF-8
character: that is held back until the next token completes it), decoding a short window of recent ids rather than
the whole generation. On top of it this holds back a trailing piece that could be the start of a stop string; when
a stop string appears, the text ends just before it. The text sent is then exactly what `verify-and-run` prints for
the same ids (cut at the stop string).
"""

from __future__ import annotations

from typing import Callable, Sequence

from shardtool.runtime import Detokenizer


class TextStream:
    """`decode(ids) -> str` decodes a sequence of ids (special tokens skipped); `stop`: the stop strings."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: tuple[str, ...] = ()):
        self._detok = Detokenizer(decode)
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._pending = ""  # decoded, not sent: it may end in the start of a stop string
        self.text = ""  # everything sent so far
        self.stopped = False  # a stop string was met: the text is complete

    @property
    def tokens(self) -> int:
        """Tokens pushed before the text ended (the one that completed a stop string included)."""
        return self._detok.tokens

    def push(self, token: int) -> str:
        """One more generated token; returns the text that is now safe to send (often "")."""
        if self.stopped:
            return ""
        self._pending += self._detok.push(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Generation ended: the rest, held-back characters included (a stop string is still cut)."""
        if self.stopped or not self._detok.tokens:
            return ""
        self._pending += self._detok.finish()
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        pending = self._pending
        # Sent text never ends inside a possible stop string, so a stop string can only start in `pending`.
        hits = [i for i in (pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._send(pending[:min(hits)])
        safe = len(pending) if final else len(pending) - self._stop_prefix(pending)
        return self._send(pending[:safe])

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that some stop string begins with."""
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _send(self, delta: str) -> str:
        self.text += delta
        self._pending = self._pending[len(delta):]
        return delta
