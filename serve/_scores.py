"""Token scores (the engine's `TokenLogprobs`) in OpenAI's response shapes: completions' `logprobs` object
({tokens, token_logprobs, top_logprobs, text_offset}) and chat's ({content: [{token, logprob, bytes,
top_logprobs}]}), for a whole answer or for one streamed chunk.

A token's text is its id decoded alone, special tokens kept (an end-of-sequence token shows as itself); a byte-level
token that ends inside a UTF-8 character decodes to U+FFFD, as in other OpenAI-compatible servers. Without a
tokenizer a token shows as "token_id:N".
"""

from __future__ import annotations

from typing import Sequence

from shardtool.runtime import TokenLogprobs

# (token id, its score): the score is None for a prompt's first token, which no position predicts.
Scored = tuple[int, TokenLogprobs | None]


class TokenText:
    """token id -> its text, decoded once per id (one answer's alternatives repeat the same few ids)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._memo.get(token)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token}"
            else:
                text = self._tokenizer.decode([token], skip_special_tokens=False)
            self._memo[token] = text
        return text


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
        shown = text(token)
        return {"token": shown, "logprob": logprob, "bytes": list(shown.encode("utf-8"))}

    return {"content": [{**entry(token, score.logprob), "top_logprobs": [entry(t, lp) for t, lp in score.top]}
                        for token, score in scored]}
