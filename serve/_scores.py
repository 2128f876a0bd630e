"""Token scores (the engine's `TokenLogprobs`) in OpenAI's response shapes: completions' `logprobs` object
({tokens, token_logprobs, top_logprobs, text_offset}) and chat's ({content: [{token, logprob, bytes,
top_logprobs}]}), for a whole answer or for one streamed chunk.

A token's text is its id decoded alone, special tokens kept (an end-of-sequence token shows as itself). A token that
is not whole UTF-8 text on its own (a byte-level piece of a character) shows as OpenAI shows one: "bytes:\\xe2\\x80",
its bytes read from the vocabulary (the byte-level alphabet, or a `<0xNN>` byte-fallback token); so two such tokens
never share a name in `top_logprobs`. Without a tokenizer a token shows as "token_id:N".
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Sequence

from shardtool.runtime import TokenLogprobs

# (token id, its score): the score is None for a prompt's first token, which no position predicts.
Scored = tuple[int, TokenLogprobs | None]


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """token id -> its text and its bytes, found once per id (one answer's alternatives repeat the same few ids)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._memo: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> str:
        return self.shown(token)[0]

    def shown(self, token: int) -> tuple[str, bytes]:
        found = self._memo.get(token)
        if found is None:
            found = self._memo[token] = self._find(token)
        return found

    def _find(self, token: int) -> tuple[str, bytes]:
        if self._tokenizer is None:
            text = f"token_id:{token}"
            return text, text.encode("ascii")
        text = self._tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, text.encode("utf-8")
        data = _piece_bytes(self._tokenizer.id_to_token(token) or "")
        if data is None:  # a vocabulary of another kind: the decoded text is all there is
            return text, text.encode("utf-8")
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


def _piece_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary piece stands for: `<0xNN>` (byte fallback), or the byte-level alphabet's characters."""
    m = _BYTE_FALLBACK.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_level_alphabet()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the other 68 bytes for
    the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class CompletionScores:
    """Completions' `logprobs` objects for one answer, chunk after chunk: `text_offset` continues where the last
    chunk's tokens ended. `top_logprobs` holds the chosen token beside the alternatives, as OpenAI's (up to n + 1
    entries)."""

    def __init__(self, text: TokenText):
        self.text = text
        self.offset = 0  # where the next token's text starts in the answer's text

    def render(self, scored: Sequence[Scored], *, start: int | None = None) -> dict:
        """`start`: the offset of the first of these tokens (the generated ones start after the echoed prompt's
        text, which need not be the prompt tokens' texts end to end)."""
        if start is not None:
            self.offset = start
        tokens, logprobs, tops, offsets = [], [], [], []
        for token, score in scored:
            text = self.text(token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if score is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(score.logprob)
            top = {self.text(t): lp for t, lp in score.top}
            top.setdefault(text, score.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_scores(scored: Sequence[Scored], text: TokenText) -> dict:
    """Chat's `logprobs` object: every token with exactly its `top_logprobs` alternatives (generated tokens only, so
    every one has a score)."""
    def entry(token: int, logprob: float) -> dict:
        shown, data = text.shown(token)
        return {"token": shown, "logprob": logprob, "bytes": list(data)}

    return {"content": [{**entry(token, score.logprob), "top_logprobs": [entry(t, lp) for t, lp in score.top]}
                        for token, score in scored]}
