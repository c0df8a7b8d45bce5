"""Gated activation of the MLP, plain-torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[..., 2 * I]``; returns ``[..., I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
