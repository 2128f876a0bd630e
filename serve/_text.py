"""Generated token ids -> text deltas, and the request's stop strings.

Each step decodes all ids generated so far and sends the new suffix. It holds back what may still change
or end the text: a trailing U+FFFD (a byte-level token can end inside a UTF-8 character, which the next
token completes) and a trailing piece that could be the start of a stop string. When a stop string appears,
the text ends just before it. The text sent is then exactly what `verify-and-run` prints for the same ids
(cut at the stop string).
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """`decode(ids) -> str` decodes a whole sequence (special tokens skipped); `stop`: the stop strings."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: tuple[str, ...] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self.text = ""  # everything sent so far
        self.stopped = False  # a stop string was met: the text is complete

    @property
    def tokens(self) -> int:
        """Tokens pushed before the text ended (the one that completed a stop string included)."""
        return len(self._ids)

    def push(self, token: int) -> str:
        """One more generated token; returns the text that is now safe to send (often "")."""
        if self.stopped:
            return ""
        self._ids.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Generation ended: the rest, held-back characters included (a stop string is still cut)."""
        if self.stopped or not self._ids:
            return ""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        full = self._decode(self._ids)
        if not full.startswith(self.text):
            # The decoder changed text already sent. Byte-level and SentencePiece decoders do not, past a
            # held-back U+FFFD; wait for the text to agree again, and at the end send what is past it, as
            # verify-and-run prints it.
            if not final:
                return ""
            rest = full[len(self.text):]
            hits = [i for i in (rest.find(s) for s in self._stop) if i >= 0]
            self.stopped = bool(hits)
            return self._send(rest[:min(hits)] if hits else rest)
        pending = full[len(self.text):]
        # Sent text never ends inside a possible stop string, so a stop string can only start in `pending`.
        hits = [i for i in (pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._send(pending[:min(hits)])
        if final:
            return self._send(pending)
        safe = len(pending.rstrip(REPLACEMENT))
        safe -= self._stop_prefix(pending[:safe])
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
        return delta
