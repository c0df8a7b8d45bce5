"""Models: tensor-parallel layers, the decoder architectures, safetensors loading, and
random-weight checkpoints (``nanofn.model.tiny``).

The names below load their module (and torch) when first used, so that ``nanofn.model.tiny``'s
presets can be listed without importing torch.
"""

from typing import Any

_LAZY = {
    "AttentionBatch": "nanofn.model.batch",
    "RecurrentState": "nanofn.model.batch",
    "ModelShape": "nanofn.model.config",
    "model_shape": "nanofn.model.config",
    "ARCHITECTURES": "nanofn.model.decoder",
    "CausalLM": "nanofn.model.decoder",
    "build_model": "nanofn.model.loader",
    "load_weights": "nanofn.model.loader",
    "resolve_dtype": "nanofn.model.loader",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanofn.model' has no attribute {name!r}")
