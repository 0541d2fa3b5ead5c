"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""
from __future__ import annotations

import torch


class Sampler:
    """Picks one token from a row of logits [vocab] per call, following SamplingParams."""

    def __init__(self, params):
        self.p = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        if self.p.temperature == 0:
            return int(logits.argmax())
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
