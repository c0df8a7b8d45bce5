"""Rotary position embeddings (neox-style rotate-half, as in Llama and Qwen), plain-torch reference.

The cache holds one row per position: ``[cos | sin]``, each ``rotary_dim // 2`` wide, in float32.
Its width is the rotary dimension: usually ``head_dim``; less for a partial rotary embedding
(Qwen3.5 turns the first quarter of each head), whose other dims pass through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from nanofn.kernels.attention import decode_attention, store_kv
from nanofn.kernels.norm import rms_norm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def build_cos_sin_cache(
    rotary_dim: int,
    max_positions: int,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The ``[max_positions, rotary_dim]`` float32 cos/sin table for positions
    ``0 .. max_positions-1`` (``rotary_dim``: ``head_dim``, or its rotated part).

    ``rope_scaling`` is Hugging Face's dict (``rope_type`` or the older ``type`` key); ``None`` or
    type ``default`` means no scaling. Types other than those in ``SUPPORTED_ROPE_TYPES`` raise.
    """
    inv_freq = _inverse_frequencies(rotary_dim, rope_theta, device)
    rope_type = _rope_type(rope_scaling)
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inverse_frequencies(inv_freq, rope_scaling)
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by the angles of ``positions [T]``: the
    first ``cos_sin_cache.shape[-1]`` dims of each head, the others unchanged.

    With ``q_norm_weight`` and ``k_norm_weight`` (``[D]``, Qwen3's ``q_norm``/``k_norm``), each
    query and key head is first RMS-normalised over ``D`` exactly as ``rms_norm`` does; the
    Triton kernel fuses the two steps. Returns new tensors in the inputs' dtypes; the rotation
    itself is computed in float32.
    """
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, norm_eps), rms_norm(k, k_norm_weight, norm_eps)
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotate_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """``apply_rotary``, then ``store_kv`` of the rotated keys and the values: returns the
    rotated queries. Attention reads keys only from the cache, so the rotated keys need no
    tensor of their own, and a Triton kernel does the whole in one pass."""
    q, k = apply_rotary(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, norm_eps)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    order: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """A decode step's attention from the projection's ``q``, ``k``, ``v`` (one token a
    sequence, at its newest position): ``rotate_and_store_kv``, then ``decode_attention`` of
    the rotated queries. The Triton kernel does both in one, attending to each token's own key
    and value without reading them back from the cache."""
    q = rotate_and_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                            q_norm_weight, k_norm_weight, norm_eps)
    return decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, order)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    first, second = x[..., :rotary_dim].float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def _rope_type(rope_scaling: Mapping[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


def _inverse_frequencies(rotary_dim: int, rope_theta: float, device) -> torch.Tensor:
    """``theta ** (-2i / rotary_dim)``, computed exactly as Hugging Face does (float32)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (rope_theta**exponents)


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling.

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their
    frequency, those longer than ``original / low_freq_factor`` are slowed by ``factor``, and the
    band between blends the two linearly in ``original / wavelength``.
    """
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original_len / low_freq_factor, inv_freq / factor, inv_freq)
    blend = (original_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_band = (wavelength >= original_len / high_freq_factor) & (wavelength <= original_len / low_freq_factor)
    return torch.where(in_band, blended, slowed)
