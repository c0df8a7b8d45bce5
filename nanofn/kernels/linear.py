"""The projections of a decoder layer, plain-torch references: a matrix multiply, alone or with
the small kernels around it in the layer folded in (the residual add and RMS norm before it, and
for the MLP's ``gate_up_proj`` the activation after it). A backend may fuse them into one
kernel; these define the result.

A projection whose output goes only to a norm (a decoder layer's ``o_proj`` and ``down_proj``)
is asked for with ``partial_sums=True``: a backend may then return ``PartialSums``, the product
as float32 sums over ranges of K that the norm adds up (``rms_norm`` and ``rms_norm_linear``
take either). These references always return the tensor.

A projection's weight may come as an ``Fp8Weight`` (``fp8.py``): these references then multiply
as the W8A8 GEMM does (``fp8_linear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanofn.kernels.activation import silu_and_mul
from nanofn.kernels.fp8 import Fp8Weight, fp8_linear
from nanofn.kernels.norm import rms_norm
from nanofn.kernels.partial_sums import Unsummed, added_up


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
           partial_sums: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``weight [N, K]`` and ``x [..., K]``."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm_linear(
    x: torch.Tensor | Unsummed,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm and the projection after it: ``(rms_norm(x + residual) @ weight.T (+ bias), x +
    residual)``, as ``rms_norm`` rounds them; with ``residual`` None, ``(rms_norm(x) @ weight.T
    (+ bias), x)``. The second result is the residual stream the layer carries on.

    ``gated``: the projection is the MLP's ``[gate | up]`` (``weight [2I, K]``) and the first
    result its activation, ``silu_and_mul`` of the product (``[..., I]``); a backend may
    return it as ``activation.Unactivated``, which its own ``linear`` then takes."""
    out, summed = norm_then_linear(rms_norm, x, norm_weight, eps, residual, weight, bias, linear)
    return (silu_and_mul(out) if gated else out), summed


def norm_then_linear(
    norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor | Unsummed,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    project: Callable[..., torch.Tensor] = F.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_linear`` unfused, with ``norm`` (any backend's ``rms_norm``) as the norm and
    ``project(normed, weight, bias)`` as the projection."""
    if residual is None:
        normed, summed = norm(x, norm_weight, eps), added_up(x)
    else:
        normed, summed = norm(x, norm_weight, eps, residual)
    return project(normed, weight, bias), summed
