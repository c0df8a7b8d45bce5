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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Messages up to this size go through peer memory (a decode step of 256 tokens of a 4,096-wide
# model is 2 MiB in bf16)
PEER_MAX_BYTES = 8 << 20


def group_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks of the default group, in place; returns it."""
    dist.all_reduce(x)
    return x


class PeerAllReduce:
    """``group_all_reduce`` through ``buffer`` (symmetric memory, see ``symmetric_buffer``) for
    messages of its dtype and up to its size, through NCCL for the others. Its construction
    is a collective (the buffers' rendezvous)."""

    def __init__(self, buffer: torch.Tensor):
        from torch.distributed import _symmetric_memory as symmetric_memory

        self.buffer = buffer
        self.group_name = dist.group.WORLD.group_name
        symmetric_memory.rendezvous(buffer, self.group_name)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through peer memory (the same answer on every rank: it depends
        on the message's dtype, size and layout, which all ranks share)."""
        return (x.dtype == self.buffer.dtype and 0 < x.numel() <= self.buffer.numel()
                and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.takes(x):
            return group_all_reduce(x)
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        x.copy_(staged.view_as(x))
        return x


def symmetric_buffer(device: torch.device, dtype: torch.dtype,
                     max_bytes: int = PEER_MAX_BYTES) -> torch.Tensor:
    """A buffer of ``max_bytes`` in symmetric memory on this rank, multicast off."""
    from torch.distributed import _symmetric_memory as symmetric_memory

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return symmetric_memory.empty(max_bytes // dtype.itemsize, device=device, dtype=dtype)


def ranks_all_reduce(device: torch.device, dtype: torch.dtype,
                     custom: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """The all-reduce for a tensor-parallel group that has joined: ``PeerAllReduce`` on GPUs
    where every rank can allocate its buffer (and ``custom``), else ``group_all_reduce``. A
    collective: every rank calls it, and all of them get the same kind (they agree before the
    buffers' rendezvous, which would wait forever for a rank without one)."""
    buffer, problem = None, None
    if custom and device.type == "cuda":
        try:
            buffer = symmetric_buffer(device, dtype)
        except Exception as error:  # (no symmetric memory here: an old driver, say)
            problem = f"{type(error).__name__}: {error}"
    agreed = torch.tensor([buffer is not None], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if agreed.item():
        return PeerAllReduce(buffer)
    if problem is not None:
        log.warning("nanofn: all-reduce through NCCL only (no symmetric memory: %s)", problem)
    return group_all_reduce
