"""What the kernels' launch heuristics need to know about the device."""

import functools

import torch


@functools.cache
def num_sms(device: torch.device, elsewhere: int) -> int:
    """Streaming multiprocessors of a CUDA device; ``elsewhere`` under Triton's interpreter."""
    if device.type != "cuda":
        return elsewhere
    return torch.cuda.get_device_properties(device).multi_processor_count
