"""FP8 (W8A8) projections as Triton kernels, with the contract of ``fp8.fp8_linear``: the
activations quantized to e4m3 per token and group of ``group_size`` columns (or with a static
per-tensor scale), times the e4m3 weight, each product scaled by its row's and group's scales.

- ``quantize_activations``: one program per (row, group): the group's largest magnitude, then
  its values times the reciprocal of its scale ``amax * (1 / 448)`` (one IEEE division a
  scale, as ``fp8.quantize_groups`` takes it) rounded to e4m3, from one load of the group held
  in registers (up to ``QUANTIZE_BLOCK`` columns; a wider group takes a second pass, from
  L1/L2). down_proj's input it computes as it reads the MLP's ``[gate | up]`` (``gated``), so
  that no activation kernel runs before it.
- ``quantized_linear``: prompts on per-channel weights through cuBLASLt (``torch._scaled_mm``),
  after the quantization kernel (or the norm that quantizes, ``triton_ops``).
- ``fp8_gemm``: many rows (decode batches; prompts on block-wise weights). Tiles of
  ``[BLOCK_M, BLOCK_K]`` codes times ``[BLOCK_N, BLOCK_K]`` weight codes on the FP8 tensor
  cores (``tl.dot`` on float8e4nv, float32 sums). With groups of 128 columns (block-wise
  weights) each step of 128 columns is one group: its product is scaled by the activations'
  and the weight's scales before it is added; with one group a row (per-channel or
  per-tensor weights, per-token activations) the scales apply once, after the K loop.
- ``fp8_partial_sums_gemm``: o_proj and down_proj at decode batches, that GEMM with K in
  ranges, its float32 sums left for the norm after it to add up (as ``triton_gemm``'s bf16).
- ``fp8_gemv``: a few rows (decode). Each program reads ``BLOCK_N`` weight rows
  and quantizes its input tiles itself (per group of 128 columns, or per token: over the row
  in one tile, or in a first pass over a longer row), so no quantization kernel runs ahead.
  At one row its time goes more to instructions than to the weight's bytes (one division an
  element fewer: the FP8 single request 1,292 -> 1,425 tok/s on an H200).
- ``fp8_rms_norm_gemv``: the same after the norm before the projection (qkv_proj, and
  gate_up_proj with its activation), in one kernel as ``triton_gemv.rms_norm_gemv`` does in
  bf16: whole rows a program, normed, quantized and multiplied there.

The GEMVs take ``triton_gemv.gemv_config``'s tiles (whole rows of up to 4,096 columns, a few
outputs a program), but at one row after a norm more outputs a program (``fp8_gemv_config``);
the GEMM's tiles were measured on the H100 (``gemm_tile``; its tiles for a few rows, past
``takes_gemv``'s bound, on an H200). The FP8 tensor cores add their products with fewer bits
than float32 (Triton's default on SM 9.0, as cuBLASLt's fast accumulation): the GEMM and the
GEMV differ by more than the order of their sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanofn.kernels import triton_gemm, triton_overlap
from nanofn.kernels.fp8 import FP8_DTYPE, MIN_SCALE, Fp8Weight
from nanofn.kernels.partial_sums import PartialSums
from nanofn.kernels.triton_gemv import (NORM, PLAIN, GemvConfig, gemv_config, gemv_epilogue,
                                        input_tile, row_warps, silu_times_up)
from nanofn.kernels.triton_overlap import wait_for_previous

GEMV_MAX_ROWS = 8  # rows up to which the GEMV runs (the GEMM's tiles are 64 rows at least)...
# ...past one row, while the rows times the weight's bytes are at most this (``takes_gemv``)
GEMV_MAX_ROW_BYTES = 12 << 20
# Outputs a program of the GEMVs with the norm before them at one row (``fp8_gemv_config``)
ONE_ROW_OUTPUTS = 8
NORM_GEMV_MAX_ROWS = 4  # the GEMV with the norm before it (whole rows a program)
GROUP = 128  # the one group size of block-wise scales (``quantization.BLOCK_SIZE``)
GROUP_COLUMNS = tl.constexpr(GROUP)  # (a global a kernel reads must be a constexpr)
QUANTIZE_BLOCK = 4096  # columns a quantization step: a group up to this wide is read once


class GemmTile(NamedTuple):
    """The W8A8 GEMM's launch: rows, outputs and columns a tile (columns: 128 with block-wise
    scales, whatever this says), warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Measured on the H100 at Qwen3-0.6B's projections (benchmarks/experiments/fp8_gemm.py): at
# 64-256 rows 64-output tiles, more programs, 1-6 us faster than 128 (~7 against ~9 us a
# GEMM); at 8,192 rows 128-output tiles, 8 warps, 3 stages
SMALL_GEMM_TILE = GemmTile(64, 64, 128, 4, 4)
GEMM_TILE = GemmTile(64, 128, 128, 8, 3)
SMALL_GEMM_MAX_ROWS = 256
# Up to this many rows (the GEMV's past ``takes_gemv``'s bound, and a few more), the tiles of
# ``gemm_tile``: 32 outputs a tile, six stages of 128 columns in flight, where the grid of 64
# outputs a tile would leave SMs idle (Qwen3-8B's o_proj and down_proj: 128 programs instead of
# 64); 64 outputs a tile from ``FEW_ROWS_WIDE_OUTPUTS`` outputs on (Qwen3-8B's gate_up: 384
# programs). Measured on one H200 at 1-64 rows (``fp8_gemm.py --model qwen3-8b``, us a GEMM
# alone): down 31.7 -> 23.2 and o_proj 11.6 -> 9.2 at 8 rows (against four stages), 33.3 ->
# 23.4 and 12.4 -> 9.2 at 16 (against 64 outputs a tile), qkv 13.0 -> 11.5; gate_up 26.5 at
# 64 outputs, 36.6 at 32. Qwen3-0.6B's: 32 outputs a tile the fastest (gate_up's at four stages,
# 4.6 us; six not swept there).
FEW_ROWS_MAX_ROWS = 64
FEW_ROWS_GEMM_TILE = GemmTile(64, 32, 128, 4, 6)
FEW_ROWS_WIDE_GEMM_TILE = GemmTile(64, 64, 128, 4, 4)
FEW_ROWS_WIDE_OUTPUTS = 16384


def gemm_tile(rows: int, n: int) -> GemmTile:
    """The W8A8 GEMM's tile for ``rows`` rows of ``n`` outputs."""
    if rows <= FEW_ROWS_MAX_ROWS:
        return FEW_ROWS_WIDE_GEMM_TILE if n >= FEW_ROWS_WIDE_OUTPUTS else FEW_ROWS_GEMM_TILE
    return SMALL_GEMM_TILE if rows <= SMALL_GEMM_MAX_ROWS else GEMM_TILE


@triton.jit
def quantized(x, scale):
    """``x * (1 / scale)`` rounded to e4m3, saturating at +-448 (``fp8.FP8_MAX``), as
    ``fp8.quantize_groups`` computes it: one IEEE division a scale (Triton's ``/`` on float32
    is approximate, ``div.full.f32``, which put a few codes of a 1,024-column group on the
    other side of a rounding boundary on an H200), then a product an element. (Dividing each
    element, IEEE's way, took 16 divisions a thread in a GEMV of 2,048 columns: 1,200
    instructions against 424 in bf16.) A scale is ``amax * (1.0 / 448.0)``: Triton folds the
    reciprocal into a float32 constant, and the product is exact, as in ``quantize_groups``."""
    return tl.clamp(x * tl.div_rn(1.0, scale), -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr, k, group_size, stride_x, stride_q, stride_scale,
    min_scale, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, STATIC: tl.constexpr,
    GATED: tl.constexpr, OVERLAP: tl.constexpr,
):
    """Program ``(row, group)``: the group's codes, and its scale (unless ``STATIC``: the
    static scale's codes), ``BLOCK`` columns a step (``ONE_BLOCK``: the whole group in one).
    ``GATED``: the row is ``[gate | up]`` (``2 * k`` columns) and the values quantized are
    ``silu(gate) * up``, rounded as ``silu_and_mul`` stores them."""
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    begin = group * group_size
    end = tl.minimum(begin + group_size, k)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    scale_out = scale_ptr + row * stride_scale + group
    wait_for_previous(OVERLAP)
    if STATIC:
        scale = tl.load(static_scale_ptr)
    if ONE_BLOCK:  # the group held in registers: read once
        cols = begin + tl.arange(0, BLOCK)
        x = _input_block(x_row, cols, cols < end, k, GATED)
        if not STATIC:
            scale = _stored_scale(tl.max(tl.abs(x), 0), min_scale, scale_out)
        tl.store(q_row + cols, quantized(x, scale), mask=cols < end)
    else:  # a pass for the scale, a second one (from L1/L2) for the codes
        if not STATIC:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(begin, end, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(_input_block(x_row, cols, cols < end, k, GATED)))
            scale = _stored_scale(tl.max(amax, 0), min_scale, scale_out)
        for start in range(begin, end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = _input_block(x_row, cols, cols < end, k, GATED)
            tl.store(q_row + cols, quantized(x, scale), mask=cols < end)


@triton.jit
def _stored_scale(amax, min_scale, scale_ptr):
    """A group's scale from its largest magnitude, written to ``scale_ptr`` and returned."""
    scale = tl.maximum(amax * (1.0 / 448.0), min_scale)
    tl.store(scale_ptr, scale)
    return scale


@triton.jit
def _input_block(x_row, cols, mask, k, GATED: tl.constexpr):
    """Columns ``cols`` of the row to quantize, in float32 (``GATED``: of its activation)."""
    if GATED:
        gate = tl.load(x_row + cols, mask=mask, other=0.0)
        up = tl.load(x_row + k + cols, mask=mask, other=0.0)
        return silu_times_up(gate, up, x_row.dtype.element_ty).to(tl.float32)
    return tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)


def quantize_activations(x: torch.Tensor, group_size: int,
                         input_scale: torch.Tensor | None = None, gated: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (contiguous rows) as e4m3 codes and float32 scales ``[M, ceil(K /
    group_size)]`` (``fp8.quantize_groups``), or with a static ``input_scale`` its codes and
    that scale as ``[M, 1]``. ``gated``: ``x`` is ``[gate | up]`` (``[M, 2K]``), and what is
    quantized its ``silu_and_mul``, which is not stored."""
    rows, k = x.shape[0], x.shape[1] // (2 if gated else 1)
    assert x.stride(-1) == 1, "rows must be contiguous"
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    static = input_scale is not None
    groups = 1 if static else -(-k // group_size)
    if static:
        scales = input_scale.float().reshape(1, 1).expand(rows, 1)
    else:
        scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    group_columns = k if static else min(group_size, k)  # a group: at most the row
    block = min(QUANTIZE_BLOCK, triton.next_power_of_2(group_columns))
    if rows > 0:
        _quantize_kernel[(rows, groups)](
            x, q, scales, scales, k, group_columns, x.stride(0), q.stride(0),
            scales.stride(0), MIN_SCALE, BLOCK=block, ONE_BLOCK=group_columns <= block,
            STATIC=static, GATED=gated, num_warps=row_warps(block),
            **triton_overlap.launch_options(x.device))
    return q, scales


@triton.jit
def _fp8_gemm_kernel(
    q_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, n, k_per_split,
    stride_q, stride_x_scale, stride_w, stride_w_scale, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, OVERLAP: tl.constexpr,
):
    """Program ``(row tile, output tile, K range s)``: ``out[s] = (q * x_scale) @ (w *
    w_scale).T (+ bias)`` over columns ``[s * k_per_split, (s + 1) * k_per_split)`` (one range:
    the product; several: ``PartialSums``' float32 sums); with ``PER_GROUP`` a scale per
    ``BLOCK_K`` columns, else one a row."""
    split = tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, output_mask = m < rows, outputs < n
    first = split * k_per_split
    columns = first + tl.arange(0, BLOCK_K)
    q_tile = q_ptr + m[:, None].to(tl.int64) * stride_q + columns[None, :]
    w_tile = w_ptr + outputs[:, None].to(tl.int64) * stride_w + columns[None, :]
    x_scales = x_scale_ptr + m.to(tl.int64) * stride_x_scale
    w_scales = w_scale_ptr + outputs.to(tl.int64) * stride_w_scale
    wait_for_previous(OVERLAP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, k_per_split, BLOCK_K):
        in_k = (start + columns < first + k_per_split)[None, :]
        a = tl.load(q_tile, mask=row_mask[:, None] & in_k, other=0.0)
        w = tl.load(w_tile, mask=output_mask[:, None] & in_k, other=0.0)
        product = tl.dot(a, tl.trans(w))
        if PER_GROUP:
            group = (first + start) // BLOCK_K
            a_scale = tl.load(x_scales + group, mask=row_mask, other=0.0)
            w_scale = tl.load(w_scales + group, mask=output_mask, other=0.0)
            acc += product * a_scale[:, None] * w_scale[None, :]
        else:
            acc += product
        q_tile += BLOCK_K
        w_tile += BLOCK_K
    if not PER_GROUP:
        a_scale = tl.load(x_scales, mask=row_mask, other=0.0)
        w_scale = tl.load(w_scales, mask=output_mask, other=0.0)
        acc = acc * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outputs, mask=output_mask, other=0.0).to(tl.float32)[None, :]
    out = (out_ptr + (split * rows + m[:, None]).to(tl.int64) * stride_out + outputs[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & output_mask[None, :])


def fp8_gemm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
             tile: GemmTile | None = None) -> torch.Tensor:
    """``fp8.fp8_linear`` of ``x [M, K]`` (contiguous rows): the activations quantized
    (``quantize_activations``), then the W8A8 GEMM, in x's dtype."""
    q, x_scales = quantize_activations(x, weight.group_size, weight.input_scale)
    return quantized_gemm(q, x_scales, weight, bias, x.dtype, tile)


def quantized_gemm(q: torch.Tensor, x_scales: torch.Tensor, weight: Fp8Weight,
                   bias: torch.Tensor | None, dtype: torch.dtype,
                   tile: GemmTile | None = None) -> torch.Tensor:
    """The W8A8 GEMM of activations already quantized (``quantize_activations``' codes
    ``q [M, K]`` and scales), in ``dtype``, in ``gemm_tile``'s tiles unless ``tile`` says."""
    rows = len(q)
    out = torch.empty(rows, weight.shape[0], dtype=dtype, device=q.device)
    _launch_gemm(q, x_scales, weight, bias, out[None],
                 tile or gemm_tile(rows, weight.shape[0]))
    return out


def fp8_partial_sums_gemm(x: torch.Tensor, weight: Fp8Weight, config: triton_gemm.GemmConfig,
                          gated: bool = False) -> PartialSums:
    """``fp8.fp8_linear`` of ``x [M, K]`` (contiguous rows; ``gated``: of the activation of
    ``x = [gate | up]``, as ``quantize_activations`` takes it) as float32 sums over ranges of K
    for the norm after the projection to add up, as ``triton_gemm.partial_sums_gemm`` leaves
    bf16's (o_proj, down_proj): in ``config``'s row and output tiles, 128 columns a step, and
    its ranges, or fewer where K does not split into ranges of whole steps. In one range the
    64 x 64 tiles of o_proj's and down_proj's 1,024 outputs were 64 programs at 256 rows and
    16 at 64, for an H200's 132 SMs: 8.6 us a call either way. Split (two ranges at 256 rows,
    four of 32-output tiles at 64), on the H200 the decode step of 256 sequences took 4.75 ->
    4.59 ms and of 64 2.21 -> 1.82 ms (the GEMMs' share of its critical path 478 -> 193 us)."""
    q, x_scales = quantize_activations(x, weight.group_size, weight.input_scale, gated)
    rows, k = q.shape
    splits = next(s for s in (config.split_k, 2, 1) if k % (s * GROUP) == 0 or s == 1)
    sums = torch.empty(splits, rows, weight.shape[0], dtype=torch.float32, device=x.device)
    _launch_gemm(q, x_scales, weight, None, sums,
                 GemmTile(config.block_m, config.block_n, GROUP, config.num_warps,
                          config.num_stages))
    return PartialSums(sums, x.dtype)


def _launch_gemm(q: torch.Tensor, x_scales: torch.Tensor, weight: Fp8Weight,
                 bias: torch.Tensor | None, out: torch.Tensor, tile: GemmTile) -> None:
    """``_fp8_gemm_kernel`` into ``out [splits, M, N]`` (contiguous), K in ``splits`` ranges."""
    splits, rows, n = out.shape
    k = q.shape[1]
    per_group = _per_group(weight, k)
    if rows > 0:
        _fp8_gemm_kernel[(triton.cdiv(rows, tile.block_m), triton.cdiv(n, tile.block_n), splits)](
            q, x_scales, weight.data, weight.scale, bias if bias is not None else out, out,
            rows, n, k // splits, q.stride(0), x_scales.stride(0), weight.data.stride(0),
            weight.scale.stride(0), out.stride(1),
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
            BLOCK_K=GROUP if per_group else tile.block_k, PER_GROUP=per_group,
            HAS_BIAS=bias is not None, num_warps=tile.num_warps, num_stages=tile.num_stages,
            **triton_overlap.launch_options_up_to(q.device, rows, SMALL_GEMM_MAX_ROWS))


def _per_group(weight: Fp8Weight, k: int) -> bool:
    """Whether the scales change along K (groups of 128 columns), else one a row."""
    per_group = weight.scale.shape[1] > 1
    assert not per_group or weight.group_size == GROUP, (
        f"groups of {weight.group_size} columns: the kernels take 128 or one group a row")
    assert weight.input_scale is None or not per_group, "a static scale comes with one group"
    return per_group


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr, w_ptr, w_scale_ptr, static_scale_ptr,
    bias_ptr, out_ptr, rows, n, k, num_groups, stride_x, stride_residual, stride_residual_out,
    stride_w, stride_w_scale, stride_out, eps, min_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_GROUP: tl.constexpr, STATIC: tl.constexpr, WHOLE_ROWS: tl.constexpr,
    PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, OVERLAP: tl.constexpr,
):
    """``fp8.fp8_linear`` of a few rows, one program per ``BLOCK_N`` outputs of every row
    (``GATED``: of each half of ``[gate | up]``, stored as ``silu(gate) * up``), in tiles of
    ``BLOCK_K`` columns as ``triton_gemv._gemv_kernel``'s (``WHOLE_ROWS``: one tile; with
    ``NORM`` the tile is normed as that kernel's prologue does, and program 0 also writes ``x
    + residual``). Each input tile is quantized here: per group of 128 columns
    (``PER_GROUP``), with the static scale, or per row (over the tile, or with a first pass
    over a row of several tiles), times the weight's codes in float32, scaled per group or
    once. The first weight tile and its scales are loaded before waiting for the kernel
    ahead."""
    program = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)[:, None, None]
    outputs = program * BLOCK_N + tl.arange(0, BLOCK_N)
    columns = tl.arange(0, BLOCK_K)[None, None, :]
    w_rows = w_ptr + outputs[None, :, None].to(tl.int64) * stride_w
    scale_rows = w_scale_ptr + outputs[:, None].to(tl.int64) * stride_w_scale
    w, w_scale = _weight_tile(w_rows, scale_rows, 0, columns, outputs < n, k, num_groups,
                              BLOCK_K, PER_GROUP)
    if GATED:
        w_up, w_up_scale = _weight_tile(w_rows + n * stride_w, scale_rows + n * stride_w_scale,
                                        0, columns, outputs < n, k, num_groups, BLOCK_K,
                                        PER_GROUP)
    row_scale = tl.zeros([BLOCK_M, 1, 1], dtype=tl.float32)
    if STATIC:
        row_scale += tl.load(static_scale_ptr)
    x_rows, residual_rows = x_ptr + m * stride_x, residual_ptr + m * stride_residual
    residual_out_rows = residual_out_ptr + m * stride_residual_out
    wait_for_previous(OVERLAP)
    if not STATIC and not PER_GROUP and not WHOLE_ROWS:  # per row, over several tiles
        row_scale = _row_scale(x_rows, m < rows, k, min_scale, BLOCK_M, BLOCK_K)
    x = input_tile(x_rows, residual_rows, norm_weight_ptr, residual_out_rows, columns,
                   (m < rows) & (columns < k), k, eps, program == 0, PROLOGUE, ADD_RESIDUAL)
    a = _quantized_tile(x, row_scale, min_scale, BLOCK_M, BLOCK_K, PER_GROUP,
                        STATIC or not WHOLE_ROWS)
    acc = _tile_sum(a, w, w_scale, BLOCK_M, BLOCK_N, BLOCK_K, PER_GROUP)
    if GATED:
        up = _tile_sum(a, w_up, w_up_scale, BLOCK_M, BLOCK_N, BLOCK_K, PER_GROUP)
    for start in range(BLOCK_K, k, BLOCK_K):  # none with NORM, nor up to 4,096 columns
        cols = start + columns
        # (a tile's scales are read only per group: one a row is the first tile's, kept)
        w, tile_scale = _weight_tile(w_rows, scale_rows, start, columns, outputs < n, k,
                                     num_groups, BLOCK_K, PER_GROUP)
        x = tl.load(x_rows + cols, mask=(m < rows) & (cols < k), other=0.0).to(tl.float32)
        a = _quantized_tile(x, row_scale, min_scale, BLOCK_M, BLOCK_K, PER_GROUP, True)
        acc += _tile_sum(a, w, tile_scale, BLOCK_M, BLOCK_N, BLOCK_K, PER_GROUP)
        if GATED:
            w_up, up_tile_scale = _weight_tile(
                w_rows + n * stride_w, scale_rows + n * stride_w_scale, start, columns,
                outputs < n, k, num_groups, BLOCK_K, PER_GROUP)
            up += _tile_sum(a, w_up, up_tile_scale, BLOCK_M, BLOCK_N, BLOCK_K, PER_GROUP)
    if not PER_GROUP:  # one scale a weight row
        acc = acc * tl.reshape(w_scale, (1, BLOCK_N))
        if GATED:
            up = up * tl.reshape(w_up_scale, (1, BLOCK_N))
    if not GATED:
        up = acc  # (unread)
    gemv_epilogue(acc, up, bias_ptr, out_ptr, outputs, n, rows, stride_out, BLOCK_M, HAS_BIAS,
                  GATED)


@triton.jit
def _weight_tile(w_rows, scale_rows, start, columns, output_mask, k, num_groups,
                 BLOCK_K: tl.constexpr, PER_GROUP: tl.constexpr):
    """Columns ``start ..`` of the weight's rows: their codes ``[1, BLOCK_N, BLOCK_K]`` and
    scales, ``[BLOCK_N, BLOCK_K // 128]`` per group or ``[BLOCK_N, 1]``."""
    cols = start + columns
    w = tl.load(w_rows + cols, mask=output_mask[None, :, None] & (cols < k), other=0.0)
    if PER_GROUP:
        groups = start // GROUP_COLUMNS + tl.arange(0, BLOCK_K // GROUP_COLUMNS)[None, :]
        scale = tl.load(scale_rows + groups, mask=output_mask[:, None] & (groups < num_groups),
                        other=0.0)
    else:
        scale = tl.load(scale_rows, mask=output_mask[:, None], other=0.0)
    return w, scale


@triton.jit
def _row_scale(x_rows, row_mask, k, min_scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's dynamic scale over all its ``k`` columns, ``[BLOCK_M, 1, 1]``."""
    columns = tl.arange(0, BLOCK_K)[None, None, :]
    amax = tl.zeros([BLOCK_M, 1, 1], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + columns
        x = tl.load(x_rows + cols, mask=row_mask & (cols < k), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 2, keep_dims=True))
    return tl.maximum(amax * (1.0 / 448.0), min_scale)


@triton.jit
def _quantized_tile(x, row_scale, min_scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    PER_GROUP: tl.constexpr, SCALE_GIVEN: tl.constexpr):
    """An input tile ``x [BLOCK_M, 1, BLOCK_K]`` (float32, zeros past K) as the W8A8 product
    sees it: quantized and dequantized per group of 128 columns (``PER_GROUP``), with
    ``row_scale [BLOCK_M, 1, 1]`` (``SCALE_GIVEN``: static, or a row's over several tiles),
    or per row over the tile (which then holds whole rows)."""
    if PER_GROUP:
        groups = tl.reshape(x, (BLOCK_M, BLOCK_K // GROUP_COLUMNS, GROUP_COLUMNS))
        scale = tl.maximum(tl.max(tl.abs(groups), 2) * (1.0 / 448.0), min_scale)[:, :, None]
        dequantized = quantized(groups, scale).to(tl.float32) * scale
        return tl.reshape(dequantized, (BLOCK_M, 1, BLOCK_K))
    if SCALE_GIVEN:
        scale = row_scale
    else:
        scale = tl.maximum(tl.max(tl.abs(x), 2, keep_dims=True) * (1.0 / 448.0), min_scale)
    return quantized(x, scale).to(tl.float32) * scale


@triton.jit
def _tile_sum(a, w, w_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PER_GROUP: tl.constexpr):
    """``sum_k a * w`` for ``a [BLOCK_M, 1, BLOCK_K]`` and weight codes ``w [1, BLOCK_N,
    BLOCK_K]``: with ``PER_GROUP`` each group's sum times its scale ``w_scale [BLOCK_N,
    groups]``; otherwise unscaled (the caller scales the total)."""
    products = a * w.to(tl.float32)
    if PER_GROUP:
        groups = tl.reshape(products, (BLOCK_M, BLOCK_N, BLOCK_K // GROUP_COLUMNS, GROUP_COLUMNS))
        return tl.sum(tl.sum(groups, 3) * w_scale[None, :, :], 2)
    return tl.sum(products, 2)


def _launch_gemv(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, prologue: int,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, gated: bool = False,
                 config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_fp8_gemv_kernel`` on ``x [M, K]`` (contiguous rows), in the bf16 GEMV's tiles
    (``triton_gemv.gemv_config``): ``[M, N]`` outputs (gated: ``N`` is half the weight's rows)
    and with ``NORM`` and a ``residual`` the new residual stream ``[M, K]``."""
    rows, k = x.shape
    assert x.stride(-1) == 1, "rows must be contiguous"
    n = weight.shape[0] // (2 if gated else 1)
    per_group = _per_group(weight, k)
    config = config or fp8_gemv_config(n, k, rows, prologue, gated)
    assert prologue != NORM or config.block_k >= k, "a norm's tile holds whole rows"
    assert not per_group or config.block_k % GROUP == 0, "a tile holds whole groups"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    static = weight.input_scale is not None
    if rows > 0:
        _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
            x, residual if residual is not None else x,
            norm_weight if norm_weight is not None else x,
            residual_out if residual_out is not None else out, weight.data, weight.scale,
            weight.input_scale if static else weight.scale, bias if bias is not None else out,
            out, rows, n, k, weight.scale.shape[1], x.stride(0),
            residual.stride(0) if residual is not None else 0,
            residual_out.stride(0) if residual_out is not None else 0,
            weight.data.stride(0), weight.scale.stride(0), out.stride(0), eps, MIN_SCALE,
            BLOCK_M=max(1, triton.next_power_of_2(rows)), BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, PER_GROUP=per_group, STATIC=static,
            WHOLE_ROWS=config.block_k >= k, PROLOGUE=prologue,
            ADD_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, GATED=gated,
            num_warps=config.num_warps, **triton_overlap.launch_options(x.device))
    return out, residual_out


def fp8_gemv_config(n: int, k: int, rows: int, prologue: int = PLAIN,
                    gated: bool = False) -> GemvConfig:
    """``gemv_config``'s tiles, but with the norm before the projection ``ONE_ROW_OUTPUTS``
    outputs a program at one row. Every program normalises and quantizes its input rows
    again (two reductions in series, then a division a column), which at bf16's 2-4 outputs a
    program cost more than the weight's bytes. Measured on one H200 at Qwen3-0.6B's
    projections: alone (``tests/gpu/test_triton_gemv_gpu.py --sweep --fp8``) 8 outputs took
    0.2-1.6 us less a projection (gate_up with the norm and SiLU 5.74 -> 4.18 us); in the
    engine's decode step (``profile_decode.py --batch 1 --timeline``) gate_up's 28 calls took
    166.6 -> 104.1 us of the critical path and qkv's 101.5 -> 98.7, but o_proj's and down's
    (no norm: 128 programs instead of 512) 215.7 -> 245.6, so those keep bf16's tiles. More
    rows: not measured yet."""
    config = gemv_config(n, k, rows, prologue, gated)
    if rows == 1 and prologue == NORM:
        return config._replace(block_n=ONE_ROW_OUTPUTS)
    return config


def fp8_gemv(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """``fp8.fp8_linear`` of ``x [M, K]`` (contiguous rows, at most ``GEMV_MAX_ROWS``), the
    activations quantized inside, in x's dtype."""
    assert len(x) <= GEMV_MAX_ROWS
    return _launch_gemv(x, weight, bias, PLAIN, config=config)[0]


def fp8_rms_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None, weight: Fp8Weight,
                      bias: torch.Tensor | None = None, gated: bool = False,
                      config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear.rms_norm_linear`` for ``x [M, K]`` (contiguous rows, at most ``NORM_GEMV_MAX_ROWS``)
    on an FP8 weight, in one kernel (``gated``: the weight is ``[gate | up]`` and the output
    ``silu(gate) * up``). Returns ``(out, x + residual)`` (``x`` without a residual)."""
    assert len(x) <= NORM_GEMV_MAX_ROWS
    out, summed = _launch_gemv(x, weight, bias, NORM, residual, norm_weight, eps, gated, config)
    return out, (x if summed is None else summed)


def takes_gemv(rows: int, weight: Fp8Weight, max_rows: int = GEMV_MAX_ROWS) -> bool:
    """Whether a product of ``rows`` rows by ``weight`` runs on the GEMV (else the GEMM): up
    to ``max_rows`` rows, and past one row while ``rows`` times the weight's bytes are at most
    ``GEMV_MAX_ROW_BYTES``.

    The GEMV's products are the CUDA cores' (each weight code converted, then multiplied once
    a row), the GEMM's the FP8 tensor cores' (64-row tiles: padding rows cost nothing but
    product slots), so the GEMV's instructions grow with rows times bytes (compiled for SM
    9.0 at 4 rows, about one warp instruction a weight byte) and the GEMM's time barely with
    the rows. Measured on one H200 (``fp8_gemm.py --rows 1,2,4,8``, us a projection, the
    quantization kernel included): Qwen3-0.6B's down (3 MiB) 5.0 / 7.3 / 16.0 on the GEMV at 2
    / 4 / 8 rows against 9.2 on the GEMM, its qkv (4 MiB) 4.5 / 6.2 / 10.0 against 5.0-5.3,
    its gate_up (6 MiB) 5.8 / 8.0 / 14.7 against 5.5, its o_proj (2 MiB) 3.9 / 7.3 at 4 / 8
    against 6.9-7.0: the two cross at 12-16 MiB of rows times bytes. Qwen3-8B's weights (16-96
    MiB) are past it from two rows (its qkv 18.6 on the GEMV at 2 rows, 13.4 on the GEMM;
    its gate_up at 8 rows 396 against 38)."""
    return rows <= max_rows and (rows <= 1 or rows * weight.data.numel() <= GEMV_MAX_ROW_BYTES)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               gemv_max_rows: int = GEMV_MAX_ROWS, gated: bool = False) -> torch.Tensor:
    """``fp8.fp8_linear`` for ``x [..., K]``: the GEMV where ``takes_gemv`` says (up to
    ``gemv_max_rows`` rows), else the quantization kernel and a GEMM (``quantized_linear``).
    ``gated``: of the activation of ``x = [gate | up]`` (``[..., 2K]``), which the
    quantization kernel computes (off the GEMV only: the GEMVs take the activation itself)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if takes_gemv(len(rows), weight, gemv_max_rows):
        assert not gated, "the GEMV takes the activation, not [gate | up]"
        out = fp8_gemv(rows, weight, bias)
    else:
        q, x_scales = quantize_activations(rows, weight.group_size, weight.input_scale, gated)
        out = quantized_linear(q, x_scales, weight, bias, x.dtype)
    return out.view(*x.shape[:-1], -1)


def quantized_linear(q: torch.Tensor, x_scales: torch.Tensor, weight: Fp8Weight,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The W8A8 product of activations already quantized (``quantize_activations``' codes and
    scales), in ``dtype``: cuBLASLt's GEMM for the prompt-sized products it takes
    (``takes_rowwise_scales``), the Triton one for the others. Measured on the H100 at 8,192
    rows (``fp8_gemm.py``): cuBLASLt 1.2-1.4x the Triton GEMM at Qwen3-0.6B's projections; at
    64-256 rows 0.4-1.1 us slower than the Triton GEMM's small tiles."""
    if len(q) > SMALL_GEMM_MAX_ROWS and takes_rowwise_scales(dtype, weight, bias):
        return torch._scaled_mm(q, weight.data.t(), scale_a=x_scales,
                                scale_b=weight.scale.view(1, -1), out_dtype=dtype)
    return quantized_gemm(q, x_scales, weight, bias, dtype)


def takes_rowwise_scales(dtype: torch.dtype, weight: Fp8Weight,
                         bias: torch.Tensor | None) -> bool:
    """Whether ``torch._scaled_mm`` computes a product into ``dtype``: per-channel weights and
    dynamic per-token activations (a scale per row of each operand), bf16 out (its only
    output with those scales on an H100), sizes in multiples of 16, no bias (whose support
    with these scales varies between releases: the Triton GEMM adds it)."""
    n, k = weight.shape
    return (weight.scale.shape[1] == 1 and weight.input_scale is None and bias is None
            and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0)
