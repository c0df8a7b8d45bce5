"""Compute kernels. Each module holds the plain-torch reference that defines a kernel's contract."""

from nanofn.kernels.activation import silu_and_mul
from nanofn.kernels.attention import decode_attention, prefill_attention, store_kv
from nanofn.kernels.norm import rms_norm
from nanofn.kernels.rotary import SUPPORTED_ROPE_TYPES, apply_rotary, build_cos_sin_cache

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "apply_rotary",
    "build_cos_sin_cache",
    "decode_attention",
    "prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
