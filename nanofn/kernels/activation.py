"""Gated activation of the MLP, plain-torch reference.

A backend's ``rms_norm_linear(..., gated=True)`` may return ``Unactivated`` instead of the
activation: the gate-up product itself, whose activation the projection after it (the MLP's
``down_proj``, through the same backend's ``linear``) computes as it reads its input. An FP8
``down_proj`` quantizes its input in a kernel of its own anyway, so the activation is computed
there, and no activation kernel runs between the two projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[..., 2 * I]``; returns ``[..., I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Unactivated:
    """``silu_and_mul(gate_up)``, not computed yet: ``gate_up [..., 2 * I]`` is the gate-up
    projection's output."""

    gate_up: torch.Tensor
