"""A projection's output as float32 sums over ranges of K, left for the norm after it to add
up (see ``linear.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PartialSums:
    """``x @ weight.T`` as ``sums [splits, M, N]`` (float32) over ranges of K: the product is
    their sum, added in order and rounded to ``dtype`` once."""

    sums: torch.Tensor
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        total = self.sums[0]
        for part in self.sums[1:]:
            total = total + part
        return total.to(self.dtype)


def added_up(x: torch.Tensor | PartialSums) -> torch.Tensor:
    """The projection's output itself."""
    return x.total() if isinstance(x, PartialSums) else x


def linear_partial_sums(x: torch.Tensor, weight: torch.Tensor, splits: int) -> PartialSums:
    """``x @ weight.T`` (``x [M, K]``) as ``PartialSums`` over ``splits`` equal ranges of K."""
    ranges = zip(x.float().chunk(splits, dim=-1), weight.float().chunk(splits, dim=-1))
    return PartialSums(torch.stack([F.linear(a, w) for a, w in ranges]), x.dtype)
