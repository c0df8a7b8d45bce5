"""Overlapped launches of a decode step's kernels (programmatic dependent launch, SM 9.0 on).

A decode step of a few sequences is hundreds of kernels of a few microseconds each, and each
one's launch and first loads used to wait for the previous one to finish. A kernel launched
with ``launch_pdl`` may start as soon as every program of the kernel ahead of it has started
and let it (``gdc_launch_dependents``). ``wait_for_previous`` is the wait for the kernel ahead
to finish and its writes to be visible (``gdc_wait``), followed at once by letting the next
kernel start in turn. So when a kernel starts, every kernel before the one ahead of it has
finished, and until its wait returns it may read whatever the kernel ahead does not write (a
projection's weights, a step's positions, the keys and values of earlier tokens) and may
write nothing, since a buffer it writes may be one the kernel ahead still reads. Kernels that
call it take ``OVERLAP`` and are launched with ``**launch_options(device)``, which sets it;
under Triton's interpreter (a CPU tensor) nothing overlaps.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def overlaps(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch overlapped: a CUDA GPU of SM 9.0 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a launch whose kernel calls ``wait_for_previous``: its
    ``OVERLAP`` and, where it is on, the launch attribute."""
    return {"OVERLAP": True, "launch_pdl": True} if overlaps(device) else {"OVERLAP": False}


def launch_options_up_to(device: torch.device, size: int, most: int) -> dict:
    """``launch_options`` for a launch of at most ``most`` (rows, pairs: a decode step's,
    where its kernel was measured overlapped); a larger one launches after the kernel ahead
    has finished (its many waves' programs, started early, would wait holding the shared
    memory that the kernel ahead's last wave needs)."""
    return launch_options(device) if size <= most else {"OVERLAP": False}


@triton.jit
def wait_for_previous(OVERLAP: tl.constexpr):
    """Wait until the kernel ahead has finished (its writes visible), then let the next start."""
    if OVERLAP:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
