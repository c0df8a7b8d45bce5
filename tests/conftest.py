"""Fixtures: tiny random-weight Hugging Face checkpoints, written once per test session; a
Triton interpreter in a child process per test module."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nanofn.model.tiny import make_tiny_checkpoint
from triton_interpreter import interpreter_process

# The test tensors are tiny: extra intra-op threads only add synchronisation, and on a busy
# machine with few cores they spin against other processes (several times slower).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    """``make(arch="qwen3", **kwargs)``: a fresh checkpoint in a new folder, safe to modify."""

    def make(arch: str = "qwen3", **kwargs) -> Path:
        return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_factory) -> Callable[..., Path]:
    """``get(arch="qwen3", **kwargs)``: a shared checkpoint, built on first use; do not modify it."""
    built: dict[str, Path] = {}

    def get(arch: str = "qwen3", **kwargs) -> Path:
        key = repr((arch, sorted(kwargs.items())))
        if key not in built:
            built[key] = tiny_checkpoint_factory(arch, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_llama3(tiny_checkpoint) -> Path:
    """Llama with llama3-type rope scaling."""
    return tiny_checkpoint("llama3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_checkpoint) -> Path:
    return tiny_checkpoint("mistral")


@pytest.fixture(scope="module")
def interpreter():
    """``run(function, *args, **kwargs)``: ``function`` in a child whose kernels run in the interpreter."""
    with interpreter_process() as run:
        yield run
