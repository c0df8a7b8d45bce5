"""The two projections of a decoder layer whose outputs go to a norm (o_proj, down_proj), for a
decode step of 5-256 sequences, as a split-K Triton GEMM whose float32 sums over ranges of K
the norm adds up (``partial_sums.PartialSums``).

At these row counts such a projection is neither bound by its weight's bytes nor by its
arithmetic (both ~1-3 us for Qwen3-0.6B's 1,024 x 2,048 and 1,024 x 3,072): cuBLAS takes ~6
and ~7.5 us, its grid of output tiles (16 of 64 outputs) leaving most SMs idle. Splitting K two
or four ways puts that many times the programs on the SMs, and leaving the partial sums to the
norm, which reads the output anyway, costs that kernel a few loads instead of costing this one
a reduction. (Reducing inside the GEMM, the last program of a tile to arrive adding the others'
sums behind a counter, measured 3.5-10 us slower on the H100: the arrival's fence and the
dependent loads at the end of every tile.) On the H100, a projection and the norm after it:
4.9-6.9 us (o_proj) and 5.7-8.4 us (down_proj) at 8-256 rows, against 7.0-8.2 and 8.1-10.0 us
with cuBLAS (``benchmarks/experiments/decode_gemm.py``).

Program ``(tile of outputs, range of K, tile of rows)`` stores its sums to ``sums[range]``;
``rms_norm`` of ``triton_ops`` adds the ranges up in order.

The same kernel with K in one range writes the product itself (``gemm``): for the two wide
projections (qkv_proj, gate_up_proj) at 5-64 rows it beats cuBLAS by 0.3-0.9 us, and in the
decode step, launched overlapped with the norm ahead, more (64 sequences: 2.63 -> 2.56 ms a
step; at 128-256 rows cuBLAS is faster, and keeps them). Grids depend only on shapes, and the
sums' buffer is the launch's only allocation: the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanofn.kernels import triton_overlap
from nanofn.kernels.partial_sums import PartialSums
from nanofn.kernels.triton_overlap import wait_for_previous


class GemmConfig(NamedTuple):
    """Launch parameters: rows and outputs a tile, columns a step, ranges of K, warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _partial_sums_kernel(
    x_ptr, weight_ptr, sums_ptr, rows, n, k_per_split, stride_x, stride_weight,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OVERLAP: tl.constexpr,
):
    """Program ``(output tile, K range s, row tile)``: ``sums[s, rows, outputs] = x[rows, range]
    @ weight[outputs, range].T``, summed in float32 and stored in ``sums``' dtype."""
    split = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    columns = split * k_per_split + tl.arange(0, BLOCK_K)[None, :]
    x_tile = x_ptr + m[:, None].to(tl.int64) * stride_x + columns
    weight_tile = weight_ptr + outputs[:, None].to(tl.int64) * stride_weight + columns
    row_mask, output_mask = m[:, None] < rows, outputs[:, None] < n
    wait_for_previous(OVERLAP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        a = tl.load(x_tile, mask=row_mask, other=0.0)
        w = tl.load(weight_tile, mask=output_mask, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        x_tile += BLOCK_K
        weight_tile += BLOCK_K
    sums = sums_ptr + (split * rows + m[:, None]).to(tl.int64) * n + outputs[None, :]
    tl.store(sums, acc.to(sums_ptr.dtype.element_ty), mask=row_mask & (outputs[None, :] < n))


# (most rows, rows a tile, outputs a tile, ranges of K): the best of a sweep on the H100 for
# o_proj and down_proj together, each followed by its norm
# (benchmarks/experiments/decode_gemm.py; 128 columns a step, 4 warps, 4 stages)
TILES = ((32, 16, 32, 4), (64, 64, 32, 4), (128, 64, 32, 2), (256, 64, 64, 2))
MAX_ROWS = TILES[-1][0]
MAX_K = 3072  # measured at K = 2,048 and 3,072 (Qwen3-0.6B); cuBLAS for wider K until measured
# The same for ``gemm`` (one range of K) at qkv_proj's and gate_up_proj's widths: the best of a
# sweep on the H100 for the two (the GEMM alone; 128 columns a step, 4 warps, 4 stages)
WHOLE_TILES = ((32, 16, 64, 1), (64, 64, 64, 1))
WHOLE_MAX_ROWS = WHOLE_TILES[-1][0]
# Measured at K = 1,024 only (Qwen3-0.6B); a wider K makes each program's loop longer on the
# same grid, where cuBLAS may split it: cuBLAS there until measured.
WHOLE_MAX_K = 1024


def gemm_config(k: int, rows: int) -> GemmConfig | None:
    """Launch parameters for ``rows`` from ``TILES``; where K does not split into those ranges
    of 128 columns, fewer ranges and narrower steps; None over ``MAX_ROWS`` rows or ``MAX_K``,
    or where K is not a multiple of 16."""
    return _config(TILES, k, rows) if k <= MAX_K else None


def whole_gemm_config(k: int, rows: int) -> GemmConfig | None:
    """``gemm_config`` for ``gemm`` (K in one range), from ``WHOLE_TILES``; None over
    ``WHOLE_MAX_ROWS`` rows or ``WHOLE_MAX_K``."""
    return _config(WHOLE_TILES, k, rows) if k <= WHOLE_MAX_K else None


def _config(tiles: tuple[tuple[int, int, int, int], ...], k: int, rows: int) -> GemmConfig | None:
    tile = next((t for t in tiles if rows <= t[0]), None)
    if tile is None:
        return None
    _, block_m, block_n, most_splits = tile
    splits = (most_splits, *(s for s in (2, 1) if s < most_splits))
    for split, block_k in itertools.product(splits, (128, 64, 32, 16)):
        if k % (split * block_k) == 0:
            return GemmConfig(block_m, block_n, block_k, split)
    return None


def partial_sums_gemm(x: torch.Tensor, weight: torch.Tensor,
                      config: GemmConfig | None = None) -> PartialSums:
    """``x @ weight.T`` for ``x [M, K]`` (contiguous rows) and ``weight [N, K]``, as float32 sums
    over ``config.split_k`` ranges of K, to be added up and rounded to x's dtype."""
    rows, k = x.shape
    config = _checked(config or gemm_config(k, rows), k, rows)
    sums = torch.empty(config.split_k, rows, len(weight), dtype=torch.float32, device=x.device)
    _launch(x, weight, sums, config)
    return PartialSums(sums, x.dtype)


def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ weight.T`` in x's dtype, K in one range: qkv_proj and gate_up_proj (4,096 and 6,144
    outputs, enough tiles without a split) at up to ``WHOLE_MAX_ROWS`` rows."""
    rows, k = x.shape
    config = _checked(config or whole_gemm_config(k, rows), k, rows)
    assert config.split_k == 1, "one range of K"
    out = torch.empty(rows, len(weight), dtype=x.dtype, device=x.device)
    _launch(x, weight, out[None], config)
    return out


def _checked(config: GemmConfig | None, k: int, rows: int) -> GemmConfig:
    assert config is not None, f"no launch parameters for {rows} rows of K={k}: give a config"
    assert k % (config.block_k * config.split_k) == 0, f"K={k} does not split by {config}"
    return config


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: GemmConfig) -> None:
    """The kernel into ``out [splits, M, N]`` (contiguous)."""
    rows, k = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == weight.stride(-1) == 1, "rows must be contiguous"
    grid = (triton.cdiv(n, config.block_n), config.split_k, triton.cdiv(rows, config.block_m))
    _partial_sums_kernel[grid](
        x, weight, out, rows, n, k // config.split_k, x.stride(0), weight.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **triton_overlap.launch_options(x.device),
    )
