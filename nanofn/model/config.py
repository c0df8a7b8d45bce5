"""What nanofn reads from a Hugging Face config, in one place.

Works with transformers 5 configs (``rope_parameters``, ``dtype``) and older ones
(``rope_theta`` + ``rope_scaling``, ``torch_dtype``), and with any object carrying those
attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True)
class ModelShape:
    """The numbers a runner needs to size a rank's KV cache."""

    num_layers: int
    num_kv_heads: int  # on this rank: kv heads are split across ranks, or replicated
    head_dim: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``: K is 0, V is 1."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one cache block takes on this rank, K and V of every layer."""
        per_token = self.num_layers * 2 * self.num_kv_heads * self.head_dim
        return per_token * block_size * dtype.itemsize


def model_shape(hf_config: Any, tp_size: int = 1) -> ModelShape:
    """The KV-cache geometry of one of ``tp_size`` ranks."""
    return ModelShape(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=max(1, num_kv_heads(hf_config) // tp_size),
        head_dim=head_dim(hf_config),
    )


def head_dim(hf_config: Any) -> int:
    """``head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config form; scaling is ``None`` when absent.

    transformers 5 keeps everything in ``rope_parameters`` (``rope_type``, ``rope_theta``, ...);
    older configs have ``rope_theta`` and an optional ``rope_scaling`` dict.
    """
    parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {}) or parameters
    theta = parameters.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (None if rope_type == "default" else scaling)


def check_activation(hf_config: Any) -> None:
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_act {activation!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )


def sliding_window(hf_config: Any) -> int | None:
    """The attention window when the model uses one, else ``None``.

    Qwen2/Qwen3 configs always carry ``sliding_window`` but mark in ``layer_types`` whether any
    layer uses it; Mistral-style configs have no ``layer_types`` and use it whenever it is set.
    """
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


def check_context_fits_window(hf_config: Any, max_model_len: int | None) -> None:
    """Sliding-window attention is not implemented; it equals full attention up to the window."""
    window = sliding_window(hf_config)
    if window is not None and max_model_len is not None and max_model_len > window:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's sliding window of {window} tokens, "
            f"and sliding-window attention is not supported; use max_model_len <= {window}"
        )
