"""The sum over the tensor-parallel ranks of a layer's partial output: ``KernelBackend.all_reduce``.

``group_all_reduce`` is torch.distributed's all-reduce (NCCL on GPUs, gloo on CPUs). A decode
step's messages are small (a few MB at most: the step's tokens times the hidden size), where
NCCL's ring is bound by its latency. ``PeerAllReduce`` sums those through peer memory instead:
each rank's buffer, allocated as torch's symmetric memory and mapped into every rank, is summed
by torch's two-shot kernel (every rank adds up its share of the elements from all buffers by
direct loads over NVLink and writes the sums back to all of them), then copied out; larger
messages (prompts) go through NCCL. Multicast is not used (NVLink SHARP can take a host's
GPUs out of service: ``TORCH_SYMM_MEM_DISABLE_MULTICAST``). The kernels are captured in CUDA
graphs like any other.

A projection whose only reader is a norm (``o_proj``, ``down_proj``: ``for_norm``) at two
ranks skips the all-reduce: its output, staged in the buffer, goes to the norm as
``RankSums``, and the Triton norm kernel reads both ranks' buffers and adds them up itself
(``triton_ops._rank_sums_rms_norm_kernel``). That saves the all-reduce's kernel, its copy back
and its own meeting of the ranks (a decode step of the Qwen3-8B shape at TP=2 holds 72 of
them, 10-17 us each at 64-256 rows on H200s).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanofn.kernels.partial_sums import RankSums

log = logging.getLogger(__name__)

# Messages up to this size go through peer memory (a decode step of 256 tokens of a 4,096-wide
# model is 2 MiB in bf16)
PEER_MAX_BYTES = 8 << 20


# Flags a rank-sums norm program meets the other rank's through (two sets: before and after it
# reads), at most this many programs a launch
FLAG_SLOTS = 1024


def group_all_reduce(x: torch.Tensor, for_norm: bool = False) -> torch.Tensor:
    """``x`` summed over the ranks of the default group, in place; returns it. (``for_norm``:
    see ``PeerAllReduce``; here the sum is always made.)"""
    dist.all_reduce(x)
    return x


class PeerAllReduce:
    """``group_all_reduce`` through ``buffer`` (symmetric memory, see ``symmetric_buffer``) for
    messages of its dtype and up to its size, through NCCL for the others. Its construction
    is a collective (the buffers' rendezvous)."""

    def __init__(self, buffer: torch.Tensor, flags: torch.Tensor):
        from torch.distributed import _symmetric_memory as symmetric_memory

        self.buffer = buffer
        self.group_name = dist.group.WORLD.group_name
        rank, world_size = dist.get_rank(), dist.get_world_size()
        handle = symmetric_memory.rendezvous(buffer, self.group_name)
        self.rank_buffers = tuple(handle.get_buffer(r, buffer.shape, buffer.dtype)
                                  for r in range(world_size))
        # the rank-sums norm's: flags (zeroed on every rank before any rank writes into
        # another's) and this rank's epochs
        self.flags = flags.zero_()
        flags_handle = symmetric_memory.rendezvous(flags, self.group_name)
        self.peer_flags = (flags_handle.get_buffer(1 - rank, flags.shape, flags.dtype)
                           if world_size == 2 else None)
        self.epochs = torch.zeros(FLAG_SLOTS, dtype=torch.int32, device=buffer.device)
        torch.cuda.synchronize(buffer.device)
        dist.barrier(device_ids=[buffer.device.index])

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through peer memory (the same answer on every rank: it depends
        on the message's dtype, size and layout, which all ranks share)."""
        return (x.dtype == self.buffer.dtype and 0 < x.numel() <= self.buffer.numel()
                and x.is_contiguous())

    def __call__(self, x: torch.Tensor, for_norm: bool = False) -> torch.Tensor | RankSums:
        """``x`` summed over the ranks (in place); ``for_norm`` (its only reader a norm, which
        may add up ``RankSums``): at two ranks, ``RankSums`` of it instead."""
        if not self.takes(x):
            return group_all_reduce(x)
        self.buffer[: x.numel()].copy_(x.view(-1))
        if for_norm and self.peer_flags is not None and x.dim() == 2:
            return RankSums(tuple(b[: x.numel()].view(x.shape) for b in self.rank_buffers),
                            self.flags, self.peer_flags, self.epochs,
                            functools.partial(self._sum_staged, x))
        return self._sum_staged(x)

    def _sum_staged(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (staged in the buffer) summed over the ranks, in place."""
        staged = self.buffer[: x.numel()]
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        x.copy_(staged.view_as(x))
        return x


def symmetric_buffer(device: torch.device, dtype: torch.dtype,
                     max_bytes: int = PEER_MAX_BYTES) -> torch.Tensor:
    """A buffer of ``max_bytes`` in symmetric memory on this rank, multicast off."""
    from torch.distributed import _symmetric_memory as symmetric_memory

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return symmetric_memory.empty(max_bytes // dtype.itemsize, device=device, dtype=dtype)


def symmetric_flags(device: torch.device) -> torch.Tensor:
    """The rank-sums norm's flags in symmetric memory on this rank: before and after reading."""
    from torch.distributed import _symmetric_memory as symmetric_memory

    return symmetric_memory.empty(2 * FLAG_SLOTS, device=device, dtype=torch.int32)


def ranks_all_reduce(device: torch.device, dtype: torch.dtype,
                     custom: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """The all-reduce for a tensor-parallel group that has joined: ``PeerAllReduce`` on GPUs
    where every rank can allocate its buffer (and ``custom``), else ``group_all_reduce``. A
    collective: every rank calls it, and all of them get the same kind (they agree before the
    buffers' rendezvous, which would wait forever for a rank without one)."""
    buffer, problem = None, None
    if custom and device.type == "cuda":
        try:
            buffer, flags = symmetric_buffer(device, dtype), symmetric_flags(device)
        except Exception as error:  # (no symmetric memory here: an old driver, say)
            problem = f"{type(error).__name__}: {error}"
    agreed = torch.tensor([buffer is not None], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if agreed.item():
        return PeerAllReduce(buffer, flags)
    if problem is not None:
        log.warning("nanofn: all-reduce through NCCL only (no symmetric memory: %s)", problem)
    return group_all_reduce
