"""nanofn: an LLM inference engine whose scheduling core is a pure function.

``from nanofn import LLM, SamplingParams``. Importing ``nanofn`` (or ``nanofn.state``) does
not import torch; ``LLM`` and the rest load it when first used.
"""

from typing import Any

from nanofn.state.params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "nanofn.llm",
    "BeamSearchParams": "nanofn.engine.beam_search",
    "RequestOutput": "nanofn.engine.outputs",
    "CompletionOutput": "nanofn.engine.outputs",
    "Engine": "nanofn.engine.engine",
    "EngineOptions": "nanofn.engine.options",
}

__all__ = ["SamplingParams", "StructuredOutputsParams", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanofn' has no attribute {name!r}")
