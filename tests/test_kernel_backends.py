"""Choosing the kernel backend, on a CPU: ``auto`` takes the torch references here, and asking for
flash-attn-4 where it cannot run names why. (Its kernels themselves: tests/gpu.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nanofn.kernels import TORCH_KERNELS
from nanofn.kernels.device import flash_attention_problem
from nanofn.model import ModelShape
from nanofn.runner.model_runner import RunnerConfig, choose_kernels

CUDA = torch.device("cuda")
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=16)


def config(kernel_backend: str, device: torch.device) -> RunnerConfig:
    return RunnerConfig(model_dir=Path("unused"), dtype="bfloat16", device=device, block_size=16,
                        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                        gpu_memory_utilization=0.5, kv_cache_memory_bytes=None, num_kv_blocks=None,
                        seed=0, enforce_eager=True, kernel_backend=kernel_backend, tp_size=1)


@pytest.fixture
def a_hopper_gpu(monkeypatch):
    """torch sees an SM 9.0 GPU (nothing runs on it in these tests)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.fixture
def no_flash_attn(monkeypatch):
    """``import flash_attn`` fails, even where it is installed."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)


def test_auto_on_a_cpu_takes_the_torch_references():
    assert choose_kernels(config("auto", torch.device("cpu")), torch.float32, SHAPE, 4) is TORCH_KERNELS


def test_what_keeps_flash_attention_from_running_is_named(monkeypatch, no_flash_attn):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA device" in flash_attention_problem(torch.device("cpu"), torch.bfloat16)
    assert "needs a CUDA device" in flash_attention_problem(CUDA, torch.bfloat16)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "not float32" in flash_attention_problem(CUDA, torch.float32)
    for capability, named in [((8, 0), "SM 8.0"), ((12, 0), "SM 12.0")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert named in flash_attention_problem(CUDA, torch.bfloat16)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    problem = flash_attention_problem(CUDA, torch.float16)
    assert "flash_attn.cute does not import (ModuleNotFoundError" in problem
    assert 'pip install "nanofn[flash]"' in problem


def test_asking_for_flash_where_it_cannot_run_raises_saying_why(a_hopper_gpu, no_flash_attn):
    with pytest.raises(RuntimeError, match=r"kernel_backend 'flash' \(flash-attn-4\) cannot run "
                                           r"here: flash_attn.cute does not import"):
        choose_kernels(config("flash", CUDA), torch.bfloat16, SHAPE, 4)
    with pytest.raises(RuntimeError, match="computes in float16 or bfloat16, not float32"):
        choose_kernels(config("flash", CUDA), torch.float32, SHAPE, 4)


def test_auto_on_cuda_without_flash_attention_takes_triton(a_hopper_gpu, no_flash_attn):
    from nanofn.kernels.triton_ops import TRITON_KERNELS

    assert choose_kernels(config("auto", CUDA), torch.bfloat16, SHAPE, 4) is TRITON_KERNELS
    assert choose_kernels(config("triton", CUDA), torch.bfloat16, SHAPE, 4) is TRITON_KERNELS


def test_an_fp8_kv_cache_takes_triton_where_flash_attention_would_run(a_hopper_gpu):
    """flash-attn-4 reads no FP8 cache: ``auto`` takes Triton (whose kernels read one) without
    asking flash-attn-4, and asking for ``flash`` says why not."""
    from dataclasses import replace

    from nanofn.kernels.triton_ops import TRITON_KERNELS

    fp8 = replace(config("auto", CUDA), kv_cache_dtype="fp8")
    assert choose_kernels(fp8, torch.bfloat16, SHAPE, 4) is TRITON_KERNELS
    with pytest.raises(RuntimeError, match="cannot read an FP8 KV cache"):
        choose_kernels(replace(fp8, kernel_backend="flash"), torch.bfloat16, SHAPE, 4)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_fp8_on_a_gpu_before_ada_is_refused_naming_it(monkeypatch, capability):
    """An A100's (SM 8.0) or an A10's (8.6) Triton kernels have no e4m3 products or
    conversions: FP8 weights or an FP8 cache there is an error naming the GPU's SM, not a
    compiler's error later; the torch references still take them, and bf16 runs."""
    from dataclasses import replace

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    named = rf"SM 8.9 or later .*this GPU is SM {capability[0]}.{capability[1]}"
    fp8_cache = replace(config("triton", CUDA), kv_cache_dtype="fp8")
    with pytest.raises(RuntimeError, match="an FP8 KV cache on cuda: .*" + named):
        choose_kernels(fp8_cache, torch.bfloat16, SHAPE, 4)
    with pytest.raises(RuntimeError, match="FP8 weights on cuda: .*" + named):
        choose_kernels(config("auto", CUDA), torch.bfloat16, SHAPE, 4, fp8_weights=True)
    assert choose_kernels(replace(fp8_cache, kernel_backend="torch"), torch.bfloat16, SHAPE,
                          4, fp8_weights=True) is TORCH_KERNELS
    from nanofn.kernels.triton_ops import TRITON_KERNELS

    assert choose_kernels(config("triton", CUDA), torch.bfloat16, SHAPE, 4) is TRITON_KERNELS


def test_fp8_on_hopper_takes_triton(a_hopper_gpu, no_flash_attn):
    from nanofn.kernels.triton_ops import TRITON_KERNELS

    assert choose_kernels(config("auto", CUDA), torch.bfloat16, SHAPE, 4,
                          fp8_weights=True) is TRITON_KERNELS
