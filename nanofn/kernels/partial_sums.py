"""A projection's output left for the norm after it to add up (see ``linear.py``): float32 sums
over ranges of K (``PartialSums``), or at tensor parallelism each rank's summand in peer memory
(``RankSums``)."""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass(frozen=True)
class RankSums:
    """A row-parallel projection's output at two tensor-parallel ranks as the ranks' summands
    ``summands`` (rank 0's and rank 1's ``[M, N]``, each in its rank's peer-memory buffer, both
    mapped into this process), for the norm after it to add up as it reads them
    (``triton_ops._rank_sums_rms_norm_kernel``) in place of an all-reduce. The ranks meet
    through flags: each program of the norm kernel writes the epoch it reached into
    ``peer_flags`` (the other rank's, mapped here) and waits for the other rank's program to
    write it into ``own_flags``; ``epochs`` counts this rank's calls per program. ``total`` is
    the sum by the all-reduce, for readers that cannot add the summands up themselves."""

    summands: tuple[torch.Tensor, torch.Tensor]
    own_flags: torch.Tensor
    peer_flags: torch.Tensor
    epochs: torch.Tensor
    all_reduce: Callable[[], torch.Tensor]

    @property
    def dtype(self) -> torch.dtype:
        return self.summands[0].dtype

    @property
    def shape(self) -> torch.Size:
        return self.summands[0].shape

    def total(self) -> torch.Tensor:
        return self.all_reduce()


# What a norm may be handed in place of a projection's output: its summands
Unsummed = PartialSums | RankSums


def summed_shape(x: torch.Tensor | Unsummed) -> torch.Size:
    """The shape of ``added_up(x)``."""
    return x.sums.shape[1:] if isinstance(x, PartialSums) else x.shape


def added_up(x: torch.Tensor | Unsummed) -> torch.Tensor:
    """The projection's output itself."""
    return x if isinstance(x, torch.Tensor) else x.total()


def linear_partial_sums(x: torch.Tensor, weight: torch.Tensor, splits: int) -> PartialSums:
    """``x @ weight.T`` (``x [M, K]``) as ``PartialSums`` over ``splits`` equal ranges of K."""
    ranges = zip(x.float().chunk(splits, dim=-1), weight.float().chunk(splits, dim=-1))
    return PartialSums(torch.stack([F.linear(a, w) for a, w in ranges]), x.dtype)
