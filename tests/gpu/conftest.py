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
