"""nanofn: an LLM inference engine whose scheduling core is a pure function.

``from nanofn import LLM, SamplingParams``; ``nanofn.demo_model()`` is the built-in demo
model's folder, ``nanofn.__version__`` the package's version. Importing ``nanofn`` (or
``nanofn.state``) does not import torch; ``LLM`` and the rest load it when first used.
"""

import re
from importlib import metadata
from pathlib import Path
from typing import Any

from nanofn.state.params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "nanofn.llm",
    "BeamSearchParams": "nanofn.engine.beam_search",
    "RequestOutput": "nanofn.engine.outputs",
    "CompletionOutput": "nanofn.engine.outputs",
    "Engine": "nanofn.engine.engine",
    "EngineOptions": "nanofn.engine.options",
    "demo_model": "nanofn.model.tiny",
}

__all__ = ["SamplingParams", "StructuredOutputsParams", "__version__", *_LAZY]


def _version() -> str:
    """pyproject.toml's version: as recorded by the installation, else (a source tree that
    was never installed) read from the file itself."""
    try:
        return metadata.version("nanofn")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        found = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
        return found.group(1) if found else "unknown"


__version__ = _version()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanofn' has no attribute {name!r}")
