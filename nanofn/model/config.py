"""What nanofn reads from a Hugging Face config, in one place.

Works with transformers 5 configs (``rope_parameters``, ``dtype``) and older ones
(``rope_theta`` + ``rope_scaling``, ``torch_dtype``), and with any object carrying those
attributes. A composite config (a vision-language model's, such as Qwen3.5's) keeps the
language model's sizes in its ``text_config``: the functions here that read sizes take that
part themselves (``text_config``), so they accept either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ACTIVATIONS = ("silu", "swish")
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def text_config(hf_config: Any) -> Any:
    """The language model's part of ``hf_config``: its ``text_config`` for a composite config
    (Qwen3.5's ``Qwen3_5Config``), else the config itself."""
    get = getattr(hf_config, "get_text_config", None)
    return hf_config if get is None else get()


@dataclass(frozen=True)
class RecurrentShape:
    """The recurrent state of one sequence on this rank, for a hybrid model's linear-attention
    (Gated DeltaNet) layers: a slot of ``RecurrentState`` (``nanofn/model/batch.py``)."""

    num_linear_layers: int
    conv_dim: int  # convolved channels (query, key and value heads) on this rank
    conv_width: int  # the convolution's kernel size - 1: the past inputs a step needs
    num_v_heads: int  # value heads on this rank
    k_head_dim: int
    v_head_dim: int
    # the delta rule's state (None: the model's dtype, as the conv state's)
    ssm_dtype: torch.dtype | None

    def conv_shape(self, num_slots: int) -> tuple[int, ...]:
        """``[num_slots, num_linear_layers, conv_dim, conv_width]``."""
        return (num_slots, self.num_linear_layers, self.conv_dim, self.conv_width)

    def ssm_shape(self, num_slots: int) -> tuple[int, ...]:
        """``[num_slots, num_linear_layers, num_v_heads, k_head_dim, v_head_dim]``."""
        return (num_slots, self.num_linear_layers, self.num_v_heads, self.k_head_dim,
                self.v_head_dim)

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one slot takes on this rank, with the conv state in ``dtype`` (the model's)."""
        conv = math.prod(self.conv_shape(1)) * dtype.itemsize
        return conv + math.prod(self.ssm_shape(1)) * (self.ssm_dtype or dtype).itemsize


@dataclass(frozen=True)
class ModelShape:
    """The numbers a runner needs to size a rank's KV cache, and a hybrid model's state slots."""

    num_layers: int  # layers with a KV cache: a hybrid model's full-attention layers only
    num_kv_heads: int  # on this rank: kv heads are split across ranks, or replicated
    head_dim: int
    recurrent: RecurrentShape | None = None  # a hybrid model's per-sequence state, else None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``: K is 0, V is 1."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one cache block takes on this rank, K and V of every layer."""
        per_token = self.num_layers * 2 * self.num_kv_heads * self.head_dim
        return per_token * block_size * dtype.itemsize

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one state slot takes on this rank (conv state in ``dtype``); 0 without
        linear-attention layers."""
        return 0 if self.recurrent is None else self.recurrent.slot_bytes(dtype)


def model_shape(hf_config: Any, tp_size: int = 1) -> ModelShape:
    """The KV-cache (and state) geometry of one of ``tp_size`` ranks."""
    config = text_config(hf_config)
    return ModelShape(
        num_layers=config.num_hidden_layers - num_linear_layers(config),
        num_kv_heads=max(1, num_kv_heads(config) // tp_size),
        head_dim=head_dim(config),
        recurrent=recurrent_shape(config, tp_size) if num_linear_layers(config) else None,
    )


def recurrent_shape(hf_config: Any, tp_size: int) -> RecurrentShape:
    """A hybrid model's state geometry on one of ``tp_size`` ranks: key and value heads are
    split across ranks (``GatedDeltaNet``), so are the channels convolved with them."""
    config = text_config(hf_config)
    k_heads = config.linear_num_key_heads // tp_size
    v_heads = config.linear_num_value_heads // tp_size
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    return RecurrentShape(
        num_linear_layers=num_linear_layers(config),
        conv_dim=2 * k_heads * k_dim + v_heads * v_dim,
        conv_width=config.linear_conv_kernel_dim - 1,
        num_v_heads=v_heads,
        k_head_dim=k_dim,
        v_head_dim=v_dim,
        ssm_dtype=ssm_dtype(config),
    )


def ssm_dtype(hf_config: Any) -> torch.dtype | None:
    """The delta-rule state's dtype: the config's ``mamba_ssm_dtype`` (Qwen3.5's checkpoints say
    float32), else None, the model's dtype (as vLLM's ``mamba_ssm_cache_dtype="auto"``)."""
    name = getattr(text_config(hf_config), "mamba_ssm_dtype", None)
    if name is None:
        return None
    if name not in STATE_DTYPES:
        raise ValueError(f"unsupported mamba_ssm_dtype {name!r}; supported: {', '.join(STATE_DTYPES)}")
    return STATE_DTYPES[name]


def num_linear_layers(hf_config: Any) -> int:
    """Layers of linear attention (``layer_types``' ``linear_attention``): 0 for a
    transformer, some for a hybrid model."""
    return list(getattr(text_config(hf_config), "layer_types", None) or []).count("linear_attention")


def head_dim(hf_config: Any) -> int:
    """``head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    config = text_config(hf_config)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(hf_config: Any) -> int:
    config = text_config(hf_config)
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def rotary_dim(hf_config: Any) -> int:
    """How many leading dims of a head the rotary embedding turns: ``head_dim`` times the
    ``partial_rotary_factor`` (Qwen3.5: 0.25), the rest pass through."""
    config = text_config(hf_config)
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    factor = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim(config) * factor)


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config form; scaling is ``None`` when absent.

    transformers 5 keeps everything in ``rope_parameters`` (``rope_type``, ``rope_theta``, ...);
    older configs have ``rope_theta`` and an optional ``rope_scaling`` dict.
    """
    hf_config = text_config(hf_config)
    parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {}) or parameters
    theta = parameters.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (None if rope_type == "default" else scaling)


def check_activation(hf_config: Any) -> None:
    activation = getattr(text_config(hf_config), "hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_act {activation!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )


def sliding_window(hf_config: Any) -> int | None:
    """The attention window when the model uses one, else ``None``.

    Qwen2/Qwen3 configs always carry ``sliding_window`` but mark in ``layer_types`` whether any
    layer uses it; Mistral-style configs have no ``layer_types`` and use it whenever it is set.
    """
    hf_config = text_config(hf_config)
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
