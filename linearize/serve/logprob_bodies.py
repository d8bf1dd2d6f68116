"""Log-probabilities (`logprobs.TokenLogprob`) spelled out as OpenAI's bodies: the legacy completions'
`{tokens, token_logprobs, top_logprobs, text_offset}` and chat's `{content: [{token, logprob, bytes,
top_logprobs}]}`.

A token's text is its id decoded alone (a part of a character of several bytes decodes to U+FFFD, and
`bytes` are that text's). A log-probability too small for a float is given as -9999.0, as vLLM gives it:
JSON has no -Infinity.
"""

from __future__ import annotations

import functools

from .logprobs import TokenLogprob
from .schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)


class TokenTexts:
    """Each token id's text, decoded alone, remembered."""

    def __init__(self, tokenizer):
        self._decode = functools.lru_cache(maxsize=65536)(lambda token: tokenizer.decode([token]))

    def __call__(self, token: int) -> str:
        return self._decode(token)


def completion_logprobs(tokens: list[int], entries: list[TokenLogprob | None],
                        text_of: TokenTexts) -> CompletionLogprobs:
    """`entries`: one for each of `tokens`, None for a first prompt token (which nothing scores). Each
    `top_logprobs` holds the most likely tokens' texts and the chosen token's, most likely first (a text
    that several of them share keeps the likeliest's)."""
    texts = [text_of(t) for t in tokens]
    offsets = [0]
    for text in texts[:-1]:
        offsets.append(offsets[-1] + len(text))
    return CompletionLogprobs(tokens=texts, text_offset=offsets[:len(texts)],
                              token_logprobs=[None if e is None else _finite(e.logprob) for e in entries],
                              top_logprobs=[None if e is None else _top_texts(e, text_of) for e in entries])


def _top_texts(entry: TokenLogprob, text_of: TokenTexts) -> dict[str, float]:
    ranked = list(entry.top)
    if all(token != entry.token for token, _ in ranked):
        ranked.append((entry.token, entry.logprob))
    top: dict[str, float] = {}
    for token, logprob in sorted(ranked, key=lambda pair: -pair[1]):
        top.setdefault(text_of(token), _finite(logprob))
    return top


def chat_logprobs(entries: list[TokenLogprob], text_of: TokenTexts) -> ChatLogprobs:
    """Each generated token's log-probability and its `top` alternatives', most likely first."""
    return ChatLogprobs(content=[ChatTokenLogprob(**_top(e.token, e.logprob, text_of).model_dump(),
                                                  top_logprobs=[_top(t, lp, text_of) for t, lp in e.top])
                                 for e in entries])


def _top(token: int, logprob: float, text_of: TokenTexts) -> TopLogprob:
    text = text_of(token)
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))
