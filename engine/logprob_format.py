"""Token logprobs (engine.sampling.TokenLogprob) in the OpenAI response forms: the legacy
completions form (tokens, token_logprobs, top_logprobs, text_offset) and the chat form
(content: [{token, logprob, bytes, top_logprobs}]). A token's text is its own decoding."""
from __future__ import annotations

from functools import lru_cache

from engine.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from engine.sampling import TokenLogprob


class TokenTexts:
    """The text of single tokens (cached); "token_id:N" for a model without a tokenizer."""

    def __init__(self, tokenizer):
        self.text = lru_cache(maxsize=1 << 16)(
            (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: f"token_id:{t}"))


def completion_logprobs(texts: TokenTexts, tokens: list[int], entries: list[TokenLogprob | None],
                        offset: int = 0, into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """tokens with their entries (None: a first prompt token) appended to `into`; text offsets
    count from `offset`. top_logprobs holds the top k and the token itself (k + 1 at most)."""
    lp = into or CompletionLogprobs()
    for token, e in zip(tokens, entries):
        text = texts.text(token)
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
        if e is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        top: dict[str, float] = {}
        for t, v in e.top:  # most likely first: a text that two tokens share keeps the likelier
            top.setdefault(texts.text(t), v)
        top.setdefault(text, e.logprob)
        lp.token_logprobs.append(e.logprob)
        lp.top_logprobs.append(top)
    return lp


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> ChatLogprobs:
    def top(t: int, v: float) -> TopLogprob:
        s = texts.text(t)
        return TopLogprob(token=s, logprob=v, bytes=list(s.encode()))

    return ChatLogprobs(content=[ChatTokenLogprob(**top(e.token, e.logprob).model_dump(),
                                                  top_logprobs=[top(t, v) for t, v in e.top]) for e in entries])
