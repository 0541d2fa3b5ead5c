"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator; and
token log-probabilities (with the top k at each position) for `logprobs`."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def greedy(logits: torch.Tensor) -> int:
    """The index of the first largest logit (a NaN counts as largest), as torch.argmax: on the host
    through numpy's vectorized argmax, which measured 20x faster than torch's on this project's VM
    (a 32K vocabulary: 3.6 us vs 66 us; DeepSeek-V3's 129K: 11 us vs 245 us, per token)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


class Sampler:
    """Picks one token from a row of logits [vocab] per call, following SamplingParams."""

    def __init__(self, params):
        self.p = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        if self.p.temperature == 0:
            return greedy(logits)
        probs = self.filtered(logits.float() / self.p.temperature).softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with everything outside top-k and the top-p nucleus set to -inf."""
        if self.p.top_k:
            kth = logits.topk(min(self.p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.p.top_p < 1:
            sorted_logits, order = logits.sort(descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum - sorted_logits.softmax(dim=-1) >= self.p.top_p  # keep the token that crosses top_p
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        return logits


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of the float32 logits, before any
    sampling setting), and the `top` most likely tokens at its position, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [T, vocab] (row t predicts tokens[t]) → one TokenLogprob per row with its top k."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.int64)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]
