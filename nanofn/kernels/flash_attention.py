"""Prefill attention through flash-attn-4 (FlashAttention in the CuTe DSL), and ``FLASH_KERNELS``.

Measured on the H100 (issue 9): flash-attn-4's paged prefill is 1.02-1.35x as fast as the Triton
kernel's (1.5-2x before the Triton kernel ran two programs an SM), while the Triton decode kernel
beats flash-attn-4's. So ``FLASH_KERNELS`` is ``TRITON_KERNELS`` with prefill attention replaced
for large steps; decode stays on Triton.

The paged cache is read in place: ``[num_blocks, block_size, Hkv, D]`` is flash-attn-4's
``(num_pages, page_size, h_k, d)`` and the block tables are its ``page_table``. Pages of any size
work on SM 9.0 (loaded with cp.async); pages of 128 tokens, its key tile, load by TMA. Its causal
mask is aligned bottom-right, as the reference's: a chunk's queries are the last positions of
its sequence's context.

Two kinds of prefill steps stay on Triton:

- CUDA-graph steps (``tiles`` given): their host tuples describe the capture, not the step,
  while flash-attn-4 sizes its grid from the host's maximum lengths;
- eager steps with less attention work than ``MIN_FLASH_WORK``: flash-attn-4's Python interface
  costs 160-570 us of host time per call (Triton's launch 80-120 us), more than it saves on the
  device there. (It does replay from a CUDA graph: the device times of the benchmark in
  tests/gpu/test_flash_attention_gpu.py are taken so.)

Importing this module imports flash_attn and Triton: ``choose_kernels`` does so only once
``device.flash_attention_problem`` has found nothing in the way.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import torch
from flash_attn.cute import flash_attn_varlen_func

import nanofn.kernels.attention as reference
import nanofn.kernels.triton_attention as triton_attention
from nanofn.kernels.triton_ops import TRITON_KERNELS

# Query-key pairs (per head, causal) from which an eager step runs on flash-attn-4: 4 prompts of
# 4,096 tokens. Measured on the H100 per call (layer): there it saves 99 us of device time (535
# against 634); at 8 x 1,024 (2^22 pairs, the standard workload's prefill steps) 12 us (100
# against 112) for 40-140 us more host time, and the workload ran 6.43-6.48 s with it there
# against 6.40-6.41 s without (prefill steps 0.383-0.386 against 0.336-0.339 s of device time).
MIN_FLASH_WORK = 1 << 25
SELF_CHECK_TOLERANCE = 2e-2  # relative error against the float32 reference, in bf16/fp16


def flash_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens_host: tuple[int, ...],
    seq_lens_host: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    """``attention.prefill_attention`` by flash-attn-4, whatever the step's size.

    ``query_start`` and ``seq_lens`` are int32, ``block_tables`` int32 with a contiguous last
    dimension (the runner's are). The host maxima bound flash-attn-4's grid; the lengths it
    reads are the device ones.
    """
    out, _ = flash_attn_varlen_func(
        q, k_cache, v_cache,
        cu_seqlens_q=query_start,
        seqused_k=seq_lens,
        page_table=block_tables,
        max_seqlen_q=max(query_lens_host),
        max_seqlen_k=max(seq_lens_host),
        softmax_scale=scale,
        causal=True,
    )
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens_host: tuple[int, ...],
    seq_lens_host: tuple[int, ...],
    scale: float,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attention.prefill_attention``: flash-attn-4 for large eager steps, Triton otherwise."""
    args = (q, k_cache, v_cache, query_start, seq_lens, block_tables, query_lens_host,
            seq_lens_host, scale)
    if tiles is None and causal_work(query_lens_host, seq_lens_host) >= MIN_FLASH_WORK:
        return flash_prefill_attention(*args)
    return triton_attention.prefill_attention(*args, tiles=tiles)


@functools.lru_cache(maxsize=8)  # every layer of a step asks
def causal_work(query_lens: tuple[int, ...], seq_lens: tuple[int, ...]) -> int:
    """Query-key pairs one head attends over: a chunk of ``q`` queries ending a context of
    ``s`` tokens sees ``q * (s - q)`` cached keys and ``q * (q + 1) / 2`` of its own."""
    return sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens))


FLASH_KERNELS = replace(TRITON_KERNELS, prefill_attention=prefill_attention)


def random_prefill_inputs(query_lens: tuple[int, ...], seq_lens: tuple[int, ...], num_heads: int,
                          num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                          device: torch.device, seed: int = 0) -> tuple:
    """Random arguments of ``prefill_attention`` but ``tiles``: queries and a paged cache
    whose shuffled blocks hold the sequences' contexts, ``head_dim ** -0.5`` as the scale."""
    generator = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator, device=device).to(dtype)
                        for _ in range(2))
    free = torch.randperm(num_blocks, generator=generator, device=device).tolist()
    tables = [[free.pop() for _ in range(n)] + [0] * (max(blocks) - n) for n in blocks]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator, device=device)
    return (q.to(dtype), k_cache, v_cache,
            torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            torch.tensor(tables, dtype=torch.int32, device=device), tuple(query_lens),
            tuple(seq_lens), head_dim**-0.5)


def relative_error(out: torch.Tensor, inputs: tuple) -> float:
    """``|out - ref| / |ref|`` over the whole output, the reference in float32 on upcast inputs."""
    upcast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in inputs]
    expected = reference.prefill_attention(*upcast)
    return ((out.float() - expected).norm() / expected.norm()).item()


def self_check(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int) -> str | None:
    """Run flash-attn-4 once at the model's shape on a small paged batch (a whole prompt, a
    chunk after a cached prefix, a decode row) against the torch reference. Returns what went
    wrong, or ``None``. The first call compiles the kernel (a few seconds), which the engine's
    first prefill then reuses."""
    inputs = random_prefill_inputs((70, 37, 1), (70, 100, 20), num_heads, num_kv_heads, head_dim,
                                   block_size, dtype, device)
    try:
        out = flash_prefill_attention(*inputs)
    except Exception as error:  # a compile or launch failure of this GPU, shape or version
        return f"its self-check raised {type(error).__name__}: {error}"
    error = relative_error(out, inputs)
    if not error < SELF_CHECK_TOLERANCE:  # (NaN too)
        return f"its self-check is off the torch reference by {error:.1e} (relative)"
    return None
