"""Small modules wrapping the kernels: RMS norm and rotary embedding."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanofn.kernels import KernelBackend, build_cos_sin_cache
from nanofn.kernels.partial_sums import Unsummed
from nanofn.model.batch import AttentionBatch
from nanofn.model.parallel import load_replicated, load_zero_centred


class RMSNorm(nn.Module):
    """RMS norm over the last dimension; ``forward(x, residual)`` fuses the residual add.

    ``zero_centred``: the checkpoint's weight ``w`` scales by ``1 + w`` (Qwen3.5); the weight
    is loaded as ``1 + w``, so the same kernels apply (in bfloat16 the product rounds once
    more than transformers' float32 ``(1 + w) * x``)."""

    def __init__(self, size: int, eps: float, kernels: KernelBackend, zero_centred: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.weight.weight_loader = load_zero_centred if zero_centred else load_replicated
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor | Unsummed, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Holds the float32 cos/sin table of a head's first ``rotary_dim`` dims (all of them but
    for a partial rotary embedding), built on the default device; one instance serves all layers."""

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        kernels: KernelBackend,
    ):
        super().__init__()
        cache = build_cos_sin_cache(rotary_dim, max_positions, rope_theta, rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.kernels = kernels

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Rotated ``q [T, H, D]``; ``k [T, Hkv, D]`` rotated and ``v`` go to their cache slots
        (``slot_mapping``). With ``q_norm`` and ``k_norm`` (Qwen3) each head is RMS-normalised
        first, in the same kernel."""
        return self.kernels.rotate_and_store_kv(q, k, v, positions, self.cos_sin_cache, k_cache,
                                                v_cache, slot_mapping, **_norms(q_norm, k_norm))

    def decode_attention(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        scale: float,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """A decode step's attention ``[B, H, D]``: what ``forward`` does, then attention over
        the cache (``rotary_decode_attention``: one kernel where the backend can fuse them)."""
        return self.kernels.rotary_decode_attention(
            q, k, v, positions, self.cos_sin_cache, k_cache, v_cache, batch.slot_mapping,
            batch.seq_lens, batch.block_tables, scale, order=batch.decode_order,
            **_norms(q_norm, k_norm))


def _norms(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> dict[str, Any]:
    """The norm arguments of the rotary kernels: Qwen3's per-head norms, or none."""
    if q_norm is None:
        return {}
    return dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps)
