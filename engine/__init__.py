"""moetune's engine: `from engine import LLM, SamplingParams`."""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name in __all__:
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
