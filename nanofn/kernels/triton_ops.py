"""The elementwise kernels of a decoder layer as Triton kernels, and ``TRITON_KERNELS``.

Same signatures and semantics as the torch references in ``norm.py``, ``rotary.py`` and
``activation.py``. Unfused, those are several small kernels each (RMS norm alone is about six);
in a decode step of a small model such launches take most of the time. Here each is one launch:

- ``rms_norm``: one program per row, the whole row in one tile; with ``residual`` the add is fused.
- ``rotate_and_store_kv``: one program per token, rotating all of its query and key heads (with
  norm weights it first RMS-normalises each head: Qwen3's ``q_norm``/``k_norm``) and writing the
  keys and values straight into the paged cache, in the same pass.
- ``silu_and_mul``: one program per (row, block of ``SILU_BLOCK`` columns).
- the projections (``linear``, and ``rms_norm_linear`` with the norm before it and maybe the
  activation after it fused in): a GEMV of ``triton_gemv.py`` for at most ``GEMV_MAX_ROWS``
  tokens (decode of a few sequences, where cuBLAS is latency-bound; past one token only of a
  weight ``triton_gemv.takes_gemv`` takes); then up to the row bounds
  of ``triton_gemm.py``'s configs, its GEMMs: for projections asked for ``partial_sums`` (those
  a norm reads) the split-K one, its sums added up in ``rms_norm``, and after the norm kernel
  the one with K in one range; cuBLAS beyond. Gated (gate_up_proj) the GEMV stores the
  activation itself; the others are followed by ``silu_and_mul``.

On SM 9.0 and later these kernels, the GEMVs and decode attention launch overlapped with the
kernel ahead of them (``triton_overlap.py``).

Arithmetic is float32 but intermediate results are rounded to the input dtype where the
references round them, so the kernels reproduce the references up to the order of a sum and the
accuracy of ``rsqrt``. Grids depend only on shapes: no host sync, and all of them can be captured
in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import nanofn.kernels.triton_attention as triton_attention
from nanofn.kernels import triton_overlap
from nanofn.kernels.triton_overlap import wait_for_previous
import nanofn.kernels.triton_gemm as triton_gemm
import nanofn.kernels.triton_gemv as triton_gemv
from nanofn.kernels.triton_gemv import silu_times_up
from nanofn.kernels.triton_attention import head_norm_scaled, to_cache_dtype
from nanofn.kernels import KernelBackend
from nanofn.kernels import triton_linear_attention as linear_attention
from nanofn.kernels import triton_moe
from nanofn.kernels import triton_fp8
from nanofn.kernels.fp8 import FP8_DTYPE, MIN_SCALE, Fp8Weight
from nanofn.kernels.linear import norm_then_linear
from nanofn.kernels.activation import Unactivated
from nanofn.kernels.partial_sums import PartialSums, RankSums, Unsummed, added_up, summed_shape

SILU_BLOCK = 1024  # columns per silu_and_mul program
# Token counts up to which the projections run as Triton GEMVs (triton_gemv.py), cuBLAS above.
# Measured on the H100 at Qwen3-0.6B's shapes: launched one after another, a layer's four
# projections with the fused norms and activation took 22.3 us at one row and 26.0 us at two,
# against 31.6 and 31.2 us on cuBLAS after the separate kernels, and at four rows 33.4 against
# 31.5 (tests/gpu/test_triton_gemv_gpu.py). Overlapped (triton_overlap.py), a whole decode step
# of 4 sequences takes 1.36 ms on the GEMVs against 1.54 ms on cuBLAS, of 8 2.16 against 1.64
# (benchmarks/profile_decode.py --batch B --gemv-max-rows R).
GEMV_MAX_ROWS = 4
# Token counts up to which the GEMMs of triton_gemm.py may run, each further bounded by its
# config's rows (the measured ranges: see there), cuBLAS above. Measured on the H100: the
# split-K one with the norm after it at 8-256 rows 4.9-6.9 us (o_proj) and 5.7-8.4 us
# (down_proj) against 7.0-8.2 and 8.1-10.0 us for cuBLAS and the norm
# (benchmarks/experiments/decode_gemm.py); K in one range 5.3-5.4 (qkv_proj) and 6.2-6.7 us
# (gate_up_proj) against cuBLAS's 5.6-5.7 and 7.1-7.2 at 16-64 rows.
TRITON_GEMM_MAX_ROWS = max(triton_gemm.MAX_ROWS, triton_gemm.WHOLE_MAX_ROWS)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_sums, stride_residual, stride_out, stride_residual_out, size, eps,
    BLOCK: tl.constexpr, NUM_SUMS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, OVERLAP: tl.constexpr,
):
    """Program ``row``: ``out = weight * normed(x + residual)``; with ``ADD_RESIDUAL`` it also
    writes ``x + residual``, which is rounded to the output's dtype before it is normalised.
    With ``NUM_SUMS``, ``x`` is a projection's float32 partial sums (``stride_sums`` apart),
    added up in order and rounded to the output's dtype first."""
    wait_for_previous(OVERLAP)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    x = _norm_input(x_ptr, row, cols, mask, stride_x, stride_sums, dtype, BLOCK, NUM_SUMS)
    _norm_row(x, row, cols, mask, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
              stride_residual, stride_out, stride_residual_out, size, eps, ADD_RESIDUAL)


@triton.jit
def _rms_norm_quantize_kernel(
    x_ptr, residual_ptr, weight_ptr, q_ptr, scale_ptr, static_scale_ptr, residual_out_ptr,
    stride_x, stride_sums, stride_residual, stride_q, stride_scale, stride_residual_out, size,
    eps, min_scale, BLOCK: tl.constexpr, NUM_SUMS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    GROUP: tl.constexpr, STATIC: tl.constexpr, OVERLAP: tl.constexpr,
):
    """``_rms_norm_kernel``'s row, rounded to the residual's dtype as it would store it, then
    quantized to e4m3 as ``triton_fp8.quantize_activations`` quantizes a stored one: with the
    static scale (``STATIC``), per group of ``GROUP`` columns, or (``GROUP`` 0) over the row.
    Its codes and scales are stored, not the row."""
    wait_for_previous(OVERLAP)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = residual_out_ptr.dtype.element_ty
    x = _norm_input(x_ptr, row, cols, mask, stride_x, stride_sums, dtype, BLOCK, NUM_SUMS)
    normed = _normed_row(x, row, cols, mask, residual_ptr, weight_ptr, residual_out_ptr,
                         stride_residual, stride_residual_out, size, eps, dtype,
                         ADD_RESIDUAL).to(tl.float32)
    if STATIC:
        codes = triton_fp8.quantized(normed, tl.load(static_scale_ptr))
    elif GROUP > 0:
        groups = tl.reshape(normed, (BLOCK // GROUP, GROUP))
        scales = tl.maximum(tl.max(tl.abs(groups), 1) * (1.0 / 448.0), min_scale)
        codes = tl.reshape(triton_fp8.quantized(groups, scales[:, None]), (BLOCK,))
        group_ids = tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + row * stride_scale + group_ids, scales,
                 mask=group_ids * GROUP < size)
    else:
        scale = tl.maximum(tl.max(tl.abs(normed), 0) * (1.0 / 448.0), min_scale)
        codes = triton_fp8.quantized(normed, scale)
        tl.store(scale_ptr + row * stride_scale, scale)
    tl.store(q_ptr + row * stride_q + cols, codes, mask=mask)


@triton.jit
def _norm_input(x_ptr, row, cols, mask, stride_x, stride_sums, dtype, BLOCK: tl.constexpr,
                NUM_SUMS: tl.constexpr):
    """A norm's input row in float32, holding values of ``dtype``: the row, or a projection's
    ``NUM_SUMS`` partial sums added up in order and rounded to ``dtype``."""
    if NUM_SUMS > 0:
        x = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(NUM_SUMS):
            x += tl.load(x_ptr + s * stride_sums + row * stride_x + cols, mask=mask, other=0.0)
        return x.to(dtype).to(tl.float32)
    return tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _norm_row(x, row, cols, mask, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
              stride_residual, stride_out, stride_residual_out, size, eps,
              ADD_RESIDUAL: tl.constexpr):
    """``rms_norm``'s row ``row`` from its input ``x`` (float32, holding values of the
    output's dtype): the residual added (and stored), normalised, scaled, stored."""
    dtype = out_ptr.dtype.element_ty
    out = _normed_row(x, row, cols, mask, residual_ptr, weight_ptr, residual_out_ptr,
                      stride_residual, stride_residual_out, size, eps, dtype, ADD_RESIDUAL)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _normed_row(x, row, cols, mask, residual_ptr, weight_ptr, residual_out_ptr,
                stride_residual, stride_residual_out, size, eps, dtype,
                ADD_RESIDUAL: tl.constexpr):
    """``_norm_row``'s output row in ``dtype``, not stored (the residual sum is)."""
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (weight * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rank_sums_rms_norm_kernel(
    first_ptr, second_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    own_flags_ptr, peer_flags_ptr, epochs_ptr, num_rows,
    stride_x, stride_residual, stride_out, stride_residual_out, size, eps,
    BLOCK: tl.constexpr, FLAG_SLOTS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    """``_rms_norm_kernel`` of ``first + second`` (two ranks' summands, added in rank order, so
    both ranks compute the same rows; rounded to the output's dtype first, as the all-reduce
    rounds them). Program p takes rows p, p + P, ... (P programs, as many as run at once at
    most). It meets the other rank's program p before reading (both summands are written:
    each rank's kernel starts after the kernel that wrote its own) and again after (neither
    rank's next kernels may overwrite a summand the other still reads), through flags that
    hold the epoch each reached. (Offsets stay in int32: a message fits the peer-memory
    buffer, 8 MiB.)"""
    program = tl.program_id(0)
    wait_for_previous(OVERLAP)
    epoch = tl.load(epochs_ptr + program) + 1
    _meet(own_flags_ptr + program, peer_flags_ptr + program, epoch)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    for row in tl.range(program, num_rows, tl.num_programs(0)):
        x = (tl.load(first_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
             + tl.load(second_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32))
        _norm_row(x.to(dtype).to(tl.float32), row, cols, mask, residual_ptr, weight_ptr,
                  out_ptr, residual_out_ptr, stride_residual, stride_out, stride_residual_out,
                  size, eps, ADD_RESIDUAL)
    _meet(own_flags_ptr + FLAG_SLOTS + program, peer_flags_ptr + FLAG_SLOTS + program, epoch)
    tl.store(epochs_ptr + program, epoch)


@triton.jit
def _meet(own_flag_ptr, peer_flag_ptr, epoch):
    """Tell the other rank's program that this one reached ``epoch`` (in its flag, mapped
    here), then wait until it has reached it too (in ours). The whole program waits for the
    loads and stores before (a summand read) and starts none after until the wait is over."""
    tl.debug_barrier()
    tl.atomic_xchg(peer_flag_ptr, epoch, sem="release", scope="sys")
    seen = tl.atomic_add(own_flag_ptr, 0, sem="acquire", scope="sys")
    while seen < epoch:
        seen = tl.atomic_add(own_flag_ptr, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _rotate_heads(
    x_row_ptr, stride_head, out_row_ptr, out_stride_head, norm_weight_ptr, cos, sin, num_heads,
    eps, valid, HEADS: tl.constexpr, HALF_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    """Rotate (with ``NORM``, first RMS-normalise) the ``num_heads`` heads of one token, read
    from ``x_row_ptr`` and written to ``out_row_ptr`` (heads ``stride_head`` and
    ``out_stride_head`` apart), rounded to x's dtype; nothing is written unless ``valid``.
    ``cos`` and ``sin`` are the token's ``[1, ROT_HALF]`` angles: the head's first
    ``2 * ROT_HALF`` dims turn (rotate-half), the rest of its ``2 * HALF_DIM`` pass (Qwen3.5's
    partial rotary), normalised with the whole head."""
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, ROT_HALF)[None, :]
    mask = heads < num_heads
    dtype = x_row_ptr.dtype.element_ty
    first_half = x_row_ptr + heads * stride_head + dims
    first = tl.load(first_half, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_half + ROT_HALF, mask=mask, other=0.0).to(tl.float32)
    store_mask = mask & valid
    if ROT_HALF < HALF_DIM:  # the dims that pass unturned
        rest_dims = 2 * ROT_HALF + tl.arange(0, 2 * HALF_DIM)[None, :]
        rest_mask = mask & (rest_dims < 2 * HALF_DIM)
        rest = tl.load(x_row_ptr + heads * stride_head + rest_dims, mask=rest_mask,
                       other=0.0).to(tl.float32)
    if NORM:
        square_sum = tl.sum(first * first, 1) + tl.sum(second * second, 1)
        if ROT_HALF < HALF_DIM:
            square_sum += tl.sum(rest * rest, 1)
        inv_rms = tl.rsqrt(square_sum / (2 * HALF_DIM) + eps)[:, None]
        first_weight = tl.load(norm_weight_ptr + dims).to(tl.float32)
        second_weight = tl.load(norm_weight_ptr + ROT_HALF + dims).to(tl.float32)
        first = head_norm_scaled(first, inv_rms, first_weight, dtype)
        second = head_norm_scaled(second, inv_rms, second_weight, dtype)
        if ROT_HALF < HALF_DIM:
            rest_weight = tl.load(norm_weight_ptr + rest_dims, mask=rest_dims < 2 * HALF_DIM,
                                  other=0.0).to(tl.float32)
            rest = head_norm_scaled(rest, inv_rms, rest_weight, dtype)
    out_first_half = out_row_ptr + heads * out_stride_head + dims
    tl.store(out_first_half, to_cache_dtype((first * cos - second * sin).to(dtype), out_row_ptr),
             mask=store_mask)
    tl.store(out_first_half + ROT_HALF,
             to_cache_dtype((second * cos + first * sin).to(dtype), out_row_ptr), mask=store_mask)
    if ROT_HALF < HALF_DIM:
        tl.store(out_row_ptr + heads * out_stride_head + rest_dims,
                 to_cache_dtype(rest.to(dtype), out_row_ptr), mask=rest_mask & valid)


@triton.jit
def _rotate_and_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, slot_mapping_ptr,
    cos_sin_ptr, q_norm_weight_ptr, k_norm_weight_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_block, stride_slot, stride_head, stride_cos_sin, num_heads, num_kv_heads, eps,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    """Program ``token``: its query heads rotated into ``q_out``, its key heads rotated and its
    value heads copied into its cache slot (none for a negative slot). Its position, slot and
    angles are read before the wait: the kernel ahead (the projection) writes none of them."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dims = tl.arange(0, ROT_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + dims)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + ROT_HALF + dims)
    wait_for_previous(OVERLAP)
    _rotate_heads(
        q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * num_heads * (2 * HALF_DIM),
        2 * HALF_DIM, q_norm_weight_ptr, cos, sin, num_heads, eps, True, Q_HEADS, HALF_DIM,
        ROT_HALF, NORM,
    )
    cache_row = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
    _rotate_heads(
        k_ptr + token * stride_kt, stride_kh, k_cache_ptr + cache_row, stride_head,
        k_norm_weight_ptr, cos, sin, num_kv_heads, eps, slot >= 0, KV_HEADS, HALF_DIM,
        ROT_HALF, NORM,
    )
    heads = tl.arange(0, KV_HEADS)[:, None]
    head_dims = tl.arange(0, 2 * HALF_DIM)[None, :]
    mask = (heads < num_kv_heads) & (slot >= 0)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + head_dims, mask=mask)
    tl.store(v_cache_ptr + cache_row + heads * stride_head + head_dims,
             to_cache_dtype(v, v_cache_ptr), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr,
                         OVERLAP: tl.constexpr):
    """Program (row, column block): ``out = silu(gate) * up``, the silu rounded to x's dtype
    before the product as in the reference."""
    wait_for_previous(OVERLAP)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_times_up(gate, up, dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side


def rms_norm(
    x: torch.Tensor | Unsummed,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise ``x`` over its last dimension and scale by ``weight`` (in ``x``'s dtype).

    With ``residual`` returns ``(normed(x + residual), x + residual)``. ``x`` may be a
    projection's ``PartialSums`` or two ranks' ``RankSums``, added up in the same kernel.
    """
    shape = summed_shape(x)
    size = shape[-1]
    out = torch.empty(shape.numel() // size, size, dtype=x.dtype, device=weight.device)
    if residual is None:
        residual_rows = residual_out = out  # placeholders, never read or written
    else:
        residual_rows = residual.reshape(-1, size)
        residual_out = torch.empty_like(out)
    assert residual_rows.stride(-1) == weight.stride(-1) == 1, "rows must be contiguous"
    if len(out) > 0:
        launch = _launch_rank_sums_norm if isinstance(x, RankSums) else _launch_norm
        launch(x, weight, eps, out, residual_rows, residual_out, residual is not None)
    if residual is None:
        return out.view(shape)
    return out.view(shape), residual_out.view(shape)


def _launch_norm(x: torch.Tensor | PartialSums, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, residual_rows: torch.Tensor, residual_out: torch.Tensor,
                 add_residual: bool) -> None:
    """``_rms_norm_kernel`` into ``out`` (and ``residual_out``): a program a row."""
    sums = x.sums if isinstance(x, PartialSums) else x[None]
    size = out.shape[-1]
    rows = sums.reshape(len(sums), -1, size)
    assert rows.stride(-1) == 1, "rows must be contiguous"
    block = triton.next_power_of_2(size)
    _rms_norm_kernel[(len(out),)](
        rows, residual_rows, weight, out, residual_out,
        rows.stride(1), rows.stride(0), residual_rows.stride(0), out.stride(0),
        residual_out.stride(0), size, eps,
        BLOCK=block, NUM_SUMS=len(rows) if isinstance(x, PartialSums) else 0,
        ADD_RESIDUAL=add_residual, num_warps=triton_gemv.row_warps(block),
        **triton_overlap.launch_options(out.device),
    )


def rms_norm_quantized(x: torch.Tensor | PartialSums, norm_weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None, weight: Fp8Weight,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm`` of ``x [M, K]`` (or a projection's ``PartialSums``) quantized for the FP8
    ``weight``'s product in the same kernel: ``(codes, scales, x + residual)`` (``x`` without a
    residual), the codes and scales ``triton_fp8.quantize_activations`` gives for the normed
    rows, which are not stored. On one H200 (``profile_decode.py --timeline``, FP8 Qwen3-0.6B
    shape) the norms and quantizations took 287 -> 216 us of the 64-sequence decode step's
    critical path and 317 -> 250 us of the 256-sequence one's (predicted: ~4% and ~2% of the
    steps, measured 3.8% and 1.5%); the standard workload 4.33, 4.32 -> 4.30, 4.28 s."""
    shape = summed_shape(x)
    size = shape[-1]
    num_rows = shape.numel() // size
    group = weight.group_size
    assert group >= size or group == triton_fp8.GROUP, "groups of 128 columns or one a row"
    static = weight.input_scale is not None
    groups = 1 if static or group >= size else triton.cdiv(size, group)
    q = torch.empty(num_rows, size, dtype=FP8_DTYPE, device=norm_weight.device)
    if static:  # (as quantize_activations gives it)
        scales = weight.input_scale.float().reshape(1, 1).expand(num_rows, 1)
    else:
        scales = torch.empty(num_rows, groups, dtype=torch.float32, device=norm_weight.device)
    sums = x.sums if isinstance(x, PartialSums) else x[None]
    rows = sums.reshape(len(sums), num_rows, size)
    summed = torch.empty(num_rows, size, dtype=x.dtype, device=norm_weight.device)
    residual_rows = summed if residual is None else residual.reshape(-1, size)
    assert rows.stride(-1) == residual_rows.stride(-1) == 1, "rows must be contiguous"
    block = triton.next_power_of_2(size)
    if num_rows > 0:
        _rms_norm_quantize_kernel[(num_rows,)](
            rows, residual_rows, norm_weight, q, scales,
            weight.input_scale if static else scales, summed, rows.stride(1), rows.stride(0),
            residual_rows.stride(0), q.stride(0), scales.stride(0), summed.stride(0), size, eps,
            MIN_SCALE, BLOCK=block, NUM_SUMS=len(rows) if isinstance(x, PartialSums) else 0,
            ADD_RESIDUAL=residual is not None, GROUP=0 if groups == 1 else group,
            STATIC=static, num_warps=triton_gemv.row_warps(block),
            **triton_overlap.launch_options(norm_weight.device))
    return q, scales, (added_up(x) if residual is None else summed).view(shape)


def _launch_rank_sums_norm(x: RankSums, weight: torch.Tensor, eps: float, out: torch.Tensor,
                           residual_rows: torch.Tensor, residual_out: torch.Tensor,
                           add_residual: bool) -> None:
    """``_rank_sums_rms_norm_kernel`` into ``out`` (and ``residual_out``): two ranks'
    summands added up as the kernel reads them (see ``RankSums``), rows strided over at most
    ``rank_sums_programs`` programs."""
    first, second = (s.reshape(len(out), -1) for s in x.summands)
    programs = min(len(out), rank_sums_programs(out.device))
    assert programs <= x.epochs.numel(), "more programs than flags"
    block = triton.next_power_of_2(out.shape[-1])
    _rank_sums_rms_norm_kernel[(programs,)](
        first, second, residual_rows, weight, out, residual_out, x.own_flags, x.peer_flags,
        x.epochs, len(out), first.stride(0), residual_rows.stride(0), out.stride(0),
        residual_out.stride(0), out.shape[-1], eps, BLOCK=block, FLAG_SLOTS=x.epochs.numel(),
        ADD_RESIDUAL=add_residual, num_warps=triton_gemv.row_warps(block),
        **triton_overlap.launch_options(out.device),
    )


@functools.cache
def rank_sums_programs(device: torch.device) -> int:
    """Programs of the rank-sums norm kernel at most: one a multiprocessor, so that all of them
    run at once (a program that waits for the other rank never holds up one of its own); 8
    under the interpreter."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def rotate_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by the angles of ``positions [T]`` (after an
    RMS norm of each head when the norm weights are given); write the rotated keys and ``v`` to
    the cache slots ``slot_mapping [T]`` (skipping negative ones). Returns the rotated queries,
    a new contiguous tensor.

    ``q``, ``k`` and ``v`` may be strided views (of the fused qkv projection) with contiguous heads.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    triton_attention.check_cache_layout(k_cache, v_cache, q, k, v, cos_sin_cache)
    norm = q_norm_weight is not None
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens > 0:
        _rotate_and_store_kv_kernel[(num_tokens,)](
            q, k, v, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin_cache,
            q_norm_weight if norm else q, k_norm_weight if norm else k,  # placeholders when not norm
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_sin_cache.stride(0),
            num_heads, num_kv_heads, norm_eps,
            Q_HEADS=triton.next_power_of_2(num_heads), KV_HEADS=triton.next_power_of_2(num_kv_heads),
            HALF_DIM=head_dim // 2, ROT_HALF=cos_sin_cache.shape[1] // 2,
            BLOCK_SIZE=k_cache.shape[1], NORM=norm,
            **triton_overlap.launch_options(q.device),
        )
    return q_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[..., 2 * I]``; returns ``[..., I]``."""
    size = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * size)
    assert rows.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty(len(rows), size, dtype=x.dtype, device=x.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(size))
    if len(rows) > 0:
        _silu_and_mul_kernel[(len(rows), triton.cdiv(size, block))](
            rows, out, rows.stride(0), out.stride(0), size, BLOCK=block, num_warps=4,
            **triton_overlap.launch_options(x.device),
        )
    return out.view(*x.shape[:-1], size)


def linear(x: torch.Tensor | Unactivated, weight: torch.Tensor, bias: torch.Tensor | None = None,
           partial_sums: bool = False, gemv_max_rows: int = GEMV_MAX_ROWS,
           triton_gemm_max_rows: int = TRITON_GEMM_MAX_ROWS) -> torch.Tensor | Unsummed:
    """``x @ weight.T (+ bias)``: a Triton GEMV for at most ``gemv_max_rows`` rows
    (``triton_gemv.takes_gemv``: fewer of a large weight); asked for
    ``partial_sums``, the split-K GEMM's (no bias, at most ``triton_gemm_max_rows`` rows and
    its config's); else cuBLAS. ``x`` may be an MLP's ``Unactivated`` gate-up product (from
    ``rms_norm_linear``), activated here."""
    if isinstance(weight, Fp8Weight):  # W8A8: triton_fp8's GEMV or GEMMs
        return _fp8_linear(x, weight, bias, partial_sums, triton_gemm_max_rows)
    if isinstance(x, Unactivated):
        x = silu_and_mul(x.gate_up)
    rows = x.reshape(-1, x.shape[-1])
    if 0 < len(rows) and triton_gemv.takes_gemv(len(rows), weight, gemv_max_rows):
        return triton_gemv.gemv(rows, weight, bias).view(*x.shape[:-1], -1)
    if partial_sums and x.dim() == 2 and (config := _triton_gemm_config(
            triton_gemm.gemm_config, len(x), weight, bias, triton_gemm_max_rows)):
        return triton_gemm.partial_sums_gemm(x, weight, config)
    return F.linear(x, weight, bias)


def _fp8_linear(x: torch.Tensor | Unactivated, weight: Fp8Weight, bias: torch.Tensor | None,
                partial_sums: bool, triton_gemm_max_rows: int) -> torch.Tensor | PartialSums:
    """``linear`` on an FP8 weight: asked for ``partial_sums``, off the GEMV
    (``triton_fp8.takes_gemv``), the split-K W8A8 GEMM in ``triton_gemm``'s tiles
    (``fp8_partial_sums_gemm``); else ``triton_fp8.fp8_linear``. An ``Unactivated`` input off
    the GEMV is activated by the kernel that quantizes it (one kernel fewer than
    ``silu_and_mul`` and then that one).

    (Past ``triton_gemm.MAX_K`` there is no split: Qwen3-8B's o_proj and down_proj split in
    two or four until two programs an SM, 128 -> 512 programs, made its decode steps of 4, 16
    and 256 sequences 2-3% slower on the H100; benchmarks/RESULTS.md, 2026-12-07.)"""
    gated = isinstance(x, Unactivated)
    if gated:
        x = x.gate_up
    num_rows = x.numel() // x.shape[-1]
    gemv = triton_fp8.takes_gemv(num_rows, weight)
    if gated and gemv:
        x, gated = silu_and_mul(x), False
    if (partial_sums and x.dim() == 2 and not gemv
            and (config := _triton_gemm_config(triton_gemm.gemm_config, num_rows, weight, bias,
                                               triton_gemm_max_rows))):
        return triton_fp8.fp8_partial_sums_gemm(x, weight, config, gated)
    return triton_fp8.fp8_linear(x, weight, bias, gated=gated)


def _triton_gemm_config(choose: Callable[[int, int], triton_gemm.GemmConfig | None],
                        num_rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
                        max_rows: int) -> triton_gemm.GemmConfig | None:
    """``choose``'s launch parameters (a config of ``triton_gemm``) where a Triton GEMM takes the
    projection: no bias, 1 to ``max_rows`` rows, and a K it has parameters for. (Partial sums
    keep no leading dimensions: their callers also ask for 2-D inputs.)"""
    if bias is not None or not 0 < num_rows <= max_rows:
        return None
    return choose(weight.shape[1], num_rows)


def rms_norm_linear(
    x: torch.Tensor | Unsummed,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    gemv_max_rows: int = GEMV_MAX_ROWS,
    triton_gemm_max_rows: int = TRITON_GEMM_MAX_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T (+ bias), x + residual)`` (see ``linear.py``; with
    ``gated`` the first is its ``silu_and_mul``): one Triton GEMV for at most ``gemv_max_rows``
    rows (``triton_gemv.takes_gemv``; gated: storing the activation), else the norm kernel
    (which adds up ``PartialSums``), the Triton GEMM (no bias, at most ``triton_gemm_max_rows``
    rows and its config's) or cuBLAS, and gated the activation kernel.

    (The activation in the GEMM's epilogue, 7.2-7.9 against 8.8-9.6 us alone at 8-64 rows with
    the norm before it, made the decode step of 32 sequences 1.96 against 1.91 ms on the H100,
    and no other row count faster beyond the noise: not built. Why the engine disagrees with
    the kernels alone is not found out.)"""
    if isinstance(weight, Fp8Weight):
        return _fp8_rms_norm_linear(x, norm_weight, eps, residual, weight, bias, gated,
                                    gemv_max_rows)
    size = weight.shape[-1]
    num_rows = summed_shape(x).numel() // size
    if 0 < num_rows and triton_gemv.takes_gemv(num_rows, weight, gemv_max_rows):
        x = added_up(x)  # (split-K sums come at these row counts only where the GEMVs are off;
        #  two ranks' summands are summed by the all-reduce here)
        residual_rows = None if residual is None else residual.reshape(-1, size)
        out, summed = triton_gemv.rms_norm_gemv(x.reshape(-1, size), norm_weight, eps,
                                                residual_rows, weight, bias, gated=gated)
        return out.view(*x.shape[:-1], -1), summed.view(x.shape)
    config = _triton_gemm_config(triton_gemm.whole_gemm_config, num_rows, weight, bias,
                                 triton_gemm_max_rows)

    def project(normed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if config is None:
            return F.linear(normed, weight, bias)
        out = triton_gemm.gemm(normed.reshape(num_rows, size), weight, config)
        return out.view(*normed.shape[:-1], -1)

    out, summed = norm_then_linear(rms_norm, x, norm_weight, eps, residual, weight, bias, project)
    return (silu_and_mul(out) if gated else out), summed


def _fp8_rms_norm_linear(x: torch.Tensor | Unsummed, norm_weight: torch.Tensor, eps: float,
                         residual: torch.Tensor | None, weight: Fp8Weight,
                         bias: torch.Tensor | None, gated: bool,
                         gemv_max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_linear`` on an FP8 weight: one kernel for a few rows where the GEMV takes
    them (``triton_fp8.fp8_rms_norm_gemv``; ``takes_gemv``), else the norm kernel that
    quantizes its output for the product (``rms_norm_quantized``: no quantization kernel
    between them) and the W8A8 product, gated ``Unactivated`` (``linear`` activates it as it
    quantizes it for an FP8 ``down_proj``)."""
    size = weight.shape[-1]
    num_rows = summed_shape(x).numel() // size
    if 0 < num_rows and triton_fp8.takes_gemv(
            num_rows, weight, min(gemv_max_rows, triton_fp8.NORM_GEMV_MAX_ROWS)):
        x = added_up(x)
        rows = x.reshape(-1, size)
        residual_rows = None if residual is None else residual.reshape(-1, size)
        out, summed = triton_fp8.fp8_rms_norm_gemv(rows, norm_weight, eps, residual_rows, weight,
                                                   bias, gated=gated)
        return out.view(*x.shape[:-1], -1), summed.view(x.shape)
    if isinstance(x, RankSums):  # (the norm that reads two ranks' summands does not quantize)
        out, summed = norm_then_linear(rms_norm, x, norm_weight, eps, residual, weight, bias,
                                       triton_fp8.fp8_linear)
    else:
        q, scales, summed = rms_norm_quantized(x, norm_weight, eps, residual, weight)
        out = triton_fp8.quantized_linear(q, scales, weight, bias, x.dtype)
        out = out.view(*summed.shape[:-1], -1)
    return (Unactivated(out) if gated else out), summed


def without_gemv(kernels: KernelBackend) -> KernelBackend:
    """``kernels`` with every projection on cuBLAS and the fused kernels split again, whatever
    the token count: the baseline that the GEMVs and the GEMMs of ``triton_gemm.py`` are tested
    and measured against."""
    return with_triton_gemm_max_rows(with_gemv_max_rows(kernels, 0), 0)


def with_gemv_max_rows(kernels: KernelBackend, rows: int) -> KernelBackend:
    """``kernels`` with the projections of at most ``rows`` tokens on the GEMVs (instead of
    ``GEMV_MAX_ROWS``), the others as before."""
    return replace(kernels, linear=functools.partial(kernels.linear, gemv_max_rows=rows),
                   rms_norm_linear=functools.partial(kernels.rms_norm_linear, gemv_max_rows=rows))


def with_triton_gemm_max_rows(kernels: KernelBackend, rows: int) -> KernelBackend:
    """``kernels`` with the GEMMs of ``triton_gemm.py`` for at most ``rows`` tokens (and their
    configs' bounds; 0: none), cuBLAS above. (A partial of a partial is flattened by
    ``functools.partial`` itself, the later keywords winning.)"""
    return replace(kernels, linear=functools.partial(kernels.linear, triton_gemm_max_rows=rows),
                   rms_norm_linear=functools.partial(kernels.rms_norm_linear,
                                                     triton_gemm_max_rows=rows))


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    order: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """``nanofn.kernels.rotary.rotary_decode_attention``: one kernel where
    ``triton_attention.fuses_rotary`` says it pays, else the rotary kernel, then
    decode attention."""
    norms = (q_norm_weight, k_norm_weight, norm_eps)
    num_splits = triton_attention.decode_partition_count(q, k_cache, block_tables)
    full_rotary = cos_sin_cache.shape[1] == q.shape[-1]  # (the fused kernel turns whole heads)
    if full_rotary and triton_attention.fuses_rotary(q, k_cache, num_splits):
        return triton_attention.rotary_decode_attention(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, seq_lens,
            block_tables, scale, order, *norms, num_splits=num_splits)
    q = rotate_and_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                            *norms)
    return triton_attention.decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale,
                                             order, num_splits)


TRITON_KERNELS = KernelBackend(
    rotate_and_store_kv=rotate_and_store_kv,
    prefill_attention=triton_attention.prefill_attention,
    rotary_decode_attention=rotary_decode_attention,
    rms_norm=rms_norm,
    linear=linear,
    rms_norm_linear=rms_norm_linear,
    causal_conv1d=linear_attention.causal_conv1d,
    delta_rule_gates=linear_attention.delta_rule_gates,
    gated_delta_rule=linear_attention.chunked_delta_rule(),
    gated_delta_net_decode=linear_attention.gated_delta_net_decode,
    rms_norm_gated=linear_attention.rms_norm_gated,
    select_experts=triton_moe.select_experts,
    fused_moe=triton_moe.fused_moe,
)
