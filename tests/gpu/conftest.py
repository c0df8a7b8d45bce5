"""GPU tests build several engines in a row: free each one's memory before the next."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def free_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture
def nan_filled_allocations(monkeypatch):
    """Every float tensor the kernels' host code allocates starts as NaN: an unwritten output fails
    (the caching allocator would otherwise hand back the memory of an earlier, correct output).
    The kernel test modules use it for every test."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", nan_empty)
