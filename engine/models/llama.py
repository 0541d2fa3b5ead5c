"""Llama 3 dense (`llama`, LlamaForCausalLM): GQA attention (rope with Llama 3's scaling where the
checkpoint sets it), a dense SiLU MLP in every layer, lm_head optionally tied to the embedding."""
from __future__ import annotations

from engine.models.gqa import GqaDecoder


class Llama(GqaDecoder):
    """Nothing beyond the GQA decoder: every layer is attention + dense MLP."""
