"""RMS normalisation with an optional fused residual add, and the gated RMS norm of a Gated
DeltaNet layer's output, plain-torch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanofn.kernels.partial_sums import Unsummed, added_up


def rms_norm(
    x: torch.Tensor | Unsummed,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise ``x`` over its last dimension and scale by ``weight``.

    With ``residual``, first adds it to ``x`` (in ``x``'s dtype, as a Hugging Face decoder layer
    does) and returns ``(normed(x + residual), x + residual)``. The statistics are computed in
    float32 and the result is cast back to ``x``'s dtype *before* the weight multiplies it, which
    reproduces ``LlamaRMSNorm``/``Qwen3RMSNorm`` bit for bit. ``x`` may come as a projection's
    ``PartialSums`` (``linear.py``): it is their total.
    """
    x = added_up(x)
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """``rms_norm(x, weight) * silu(gate)`` over the last dimension (a Gated DeltaNet's output
    heads, gated by its ``z`` projection). The weighted norm is rounded to ``x``'s dtype, then
    gated in float32, as transformers' ``Qwen3_5RMSNormGated`` does."""
    return (rms_norm(x, weight, eps) * F.silu(gate.float())).to(x.dtype)
