"""Matrix-vector products for a few rows (decode of one to a few sequences), as Triton kernels.

At a few tokens a projection reads its whole weight to compute a few outputs per row: it is
bound by memory, and at Qwen3-0.6B's sizes (4-12 MB of weight, a few microseconds) largely by
the fixed cost of a kernel. Measured on the H100 from CUDA graphs at one row: cuBLAS 5.6-7.9 us
for the four projections, these kernels 3.7-6.2 us (1.1-2.0 TB/s), about 2.5 us of fixed cost
(the launch, the first bytes' latency, the final sums) plus the weight at the memory's rate.

One program computes ``BLOCK_N`` outputs of every row: it loads a ``[BLOCK_N, BLOCK_K]`` tile of
the weight (16-byte loads along a weight row), multiplies it by the ``[BLOCK_M, BLOCK_K]`` slice
of the input in float32 and sums over K. Small tiles (``gemv_config``) make many programs, whose
loads are all in flight at once.

The input of a tile may be computed in the kernel from what precedes the projection in a
decoder layer (``NORM``), which saves that kernel's launch and its round trip through memory;
every program recomputes the rows it needs (from L2, but for the first): the input is
``rms_norm(x + residual)``, a tile holding whole rows, and program 0 also writes ``x +
residual``, the layer's residual stream. And the output may be the MLP's activation of a
``[gate | up]`` product (``GATED``): a program computes the same outputs of both halves and
stores ``silu(gate) * up``, so that the activation costs neither a kernel nor a re-read.

Intermediate values are rounded to the input dtype where the torch references round them
(``nanofn.kernels.linear``), so the results differ from them by the order of the sums only.
Grids depend only on shapes: the kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanofn.kernels import triton_overlap
from nanofn.kernels.triton_overlap import wait_for_previous

PLAIN, NORM = 0, 1  # PROLOGUE: how a program gets its input tile
# Past one row, the GEMV takes a weight while the rows times its bytes are at most this, or
# whatever its size where its rows are at most ``NARROW_COLUMNS`` wide (``takes_gemv``)
GEMV_MAX_ROW_BYTES = 64 << 20
NARROW_COLUMNS = 1024


class GemvConfig(NamedTuple):
    """Launch parameters: outputs per program, input columns per step, warps per program."""

    block_n: int
    block_k: int
    num_warps: int


def row_warps(block: int) -> int:
    """Warps for a program that holds a row of ``block`` elements: 8 elements a thread, from one
    warp up to 16 (a 4096-wide row); wider rows put more elements on each thread."""
    return min(16, max(1, block // 256))


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` in ``dtype``, rounded where ``silu_and_mul`` rounds: the silu, then
    the product."""
    gate = gate.to(tl.float32)
    activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (activated * up.to(tl.float32)).to(dtype)


@triton.jit
def input_tile(
    x_rows, residual_rows, norm_weight_ptr, residual_out_rows, cols, mask, k, eps, write,
    PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    """The input ``[BLOCK_M, 1, BLOCK_K]`` at columns ``cols``, in float32 but rounded to the
    input dtype as the references round it. With ``NORM`` the tile holds whole rows; with
    ``write`` it also stores them as ``x + residual``."""
    dtype = x_rows.dtype.element_ty
    x = tl.load(x_rows + cols, mask=mask, other=0.0)
    if PROLOGUE == 1:  # NORM
        if ADD_RESIDUAL:
            residual = tl.load(residual_rows + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
            tl.store(residual_out_rows + cols, x, mask=mask & write)
        x = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, 2)[:, :, None] / k + eps)
        normed = (x * inv_rms).to(dtype).to(tl.float32)
        norm_weight = tl.load(norm_weight_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
        return (norm_weight * normed).to(dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr,
    rows, n, k, stride_x, stride_residual, stride_weight, stride_out, stride_residual_out, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, OVERLAP: tl.constexpr,
):
    """Program ``p``: outputs ``p * BLOCK_N ..`` of all ``rows`` (at most ``BLOCK_M``) rows; with
    ``GATED`` of both halves of ``[gate | up]`` (the weight's rows ``outputs`` and ``n +
    outputs``), stored as ``silu(gate) * up``.

    Tiles are 3-d, ``[rows, outputs, columns]``: the input ``[BLOCK_M, 1, BLOCK_K]`` and the
    weight ``[1, BLOCK_N, BLOCK_K]`` are loaded in the same layout (16 bytes a thread along the
    columns), and one sum over the columns serves every row. With ``NORM``, ``BLOCK_K >= k``:
    the norm of a row needs all of it, and so it is read once. The first weight tile (most
    often the only one) is loaded before waiting for the kernel ahead (``triton_overlap``).
    """
    program = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)[:, None, None]
    outputs = program * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = outputs[None, :, None] < n
    columns = tl.arange(0, BLOCK_K)[None, None, :]
    weight_rows = weight_ptr + outputs[None, :, None].to(tl.int64) * stride_weight
    up_rows = weight_rows + n * stride_weight
    x_rows, residual_rows = x_ptr + m * stride_x, residual_ptr + m * stride_residual
    residual_out_rows = residual_out_ptr + m * stride_residual_out
    w = tl.load(weight_rows + columns, mask=n_mask & (columns < k), other=0.0)
    if GATED:
        w_up = tl.load(up_rows + columns, mask=n_mask & (columns < k), other=0.0)
    wait_for_previous(OVERLAP)
    a = input_tile(x_rows, residual_rows, norm_weight_ptr, residual_out_rows, columns,
                    (m < rows) & (columns < k), k, eps, program == 0, PROLOGUE, ADD_RESIDUAL)
    acc = tl.sum(a * w.to(tl.float32), 2)
    if GATED:
        up = tl.sum(a * w_up.to(tl.float32), 2)
    for start in range(BLOCK_K, k, BLOCK_K):  # none with NORM, nor up to 4,096 columns
        cols = start + columns
        a = input_tile(x_rows, residual_rows, norm_weight_ptr, residual_out_rows, cols,
                        (m < rows) & (cols < k), k, eps, program == 0, PROLOGUE, ADD_RESIDUAL)
        w_tile = tl.load(weight_rows + cols, mask=n_mask & (cols < k), other=0.0)
        acc += tl.sum(a * w_tile.to(tl.float32), 2)
        if GATED:
            up_tile = tl.load(up_rows + cols, mask=n_mask & (cols < k), other=0.0)
            up += tl.sum(a * up_tile.to(tl.float32), 2)
    if not GATED:
        up = acc  # (unread)
    gemv_epilogue(acc, up, bias_ptr, out_ptr, outputs, n, rows, stride_out, BLOCK_M, HAS_BIAS,
                  GATED)


@triton.jit
def gemv_epilogue(acc, up, bias_ptr, out_ptr, outputs, n, rows, stride_out,
                  BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """A GEMV program's sums ``acc [BLOCK_M, len(outputs)]`` (float32; ``GATED``: the gate
    half's, ``up`` the up half's, ``n`` rows of the weight further) plus the bias, activated
    (``GATED``: ``silu(gate) * up``), stored to the rows below ``rows`` and outputs below ``n``."""
    output_mask = outputs < n
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outputs, mask=output_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(bias_ptr + n + outputs, mask=output_mask,
                          other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:
        out = silu_times_up(acc.to(dtype), up.to(dtype), dtype)
    else:
        out = acc.to(dtype)
    out_rows = tl.arange(0, BLOCK_M)[:, None]
    tl.store(out_ptr + out_rows * stride_out + outputs[None, :], out,
             mask=(out_rows < rows) & output_mask[None, :])


def gemv_config(n: int, k: int, rows: int, prologue: int = PLAIN, gated: bool = False) -> GemvConfig:
    """Launch parameters after a sweep on the H100 (``tests/gpu/test_triton_gemv_gpu.py --sweep``)
    at one row: all of K in one step (up to 4,096 columns; ``NORM`` needs whole rows), 2 outputs
    a program, 16-32 weight elements a thread. More rows, or a prologue, re-read the input in
    every program: then more outputs a program, as long as the grid keeps 512 programs. The
    warps all lie along K (each covers 256 columns), where the input's tile and the weight's
    share a layout; otherwise the input is moved between layouts through shared memory.

    Within 0.1 us of the best swept config at each projection, but ``NORM``, where (8, K, 8)
    was 0.3 us faster than this (4, K, 4) at one row (not yet measured in the engine).
    ``gated`` (``n`` outputs of each of two halves): half the outputs a program of 2n outputs
    would take, so that a program reads as many weight rows. (At one row gate_up's (4, K, 4), twice
    the rows, took 5.82 us alone against 6.15 for this (2, K, 4), but in the engine the decode
    step took 0.83 against 0.82 ms and the single request 1,182 against 1,192 tok/s.)
    """
    block_k = triton.next_power_of_2(k)
    if prologue != NORM:
        block_k = min(block_k, 4096)
    wanted = (2 if prologue == PLAIN else 4) * triton.next_power_of_2(rows)
    weight_rows = 2 * n if gated else n
    most = 1 << (max(1, weight_rows // 512).bit_length() - 1)  # a power of two, rows // 512 at most
    block_n = min(wanted, most)
    if gated:
        block_n = max(1, block_n // 2)
    return GemvConfig(block_n, block_k, 8 if block_k >= 4096 else 4)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0, config: GemvConfig | None = None,
            gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[M, N]`` outputs for ``x [M, K]`` (contiguous rows; gated: ``N`` is half the weight's
    rows), and with ``NORM`` and a ``residual`` the new residual stream ``[M, K]``."""
    rows = len(x)
    n, k = weight.shape
    assert x.stride(-1) == weight.stride(-1) == 1, "rows must be contiguous"
    assert x.shape[-1] == k, (tuple(x.shape), tuple(weight.shape))
    if gated:
        assert n % 2 == 0, "weight is [gate | up]"
        n //= 2
    config = config or gemv_config(n, k, rows, prologue, gated)
    assert prologue != NORM or config.block_k >= k, "a norm's tile holds whole rows"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(rows, k, dtype=x.dtype, device=x.device) if residual is not None else None
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        weight, bias if bias is not None else weight, out,
        residual_out if residual_out is not None else out,  # placeholders, never read or written
        rows, n, k, x.stride(0), residual.stride(0) if residual is not None else 0,
        weight.stride(0), out.stride(0), residual_out.stride(0) if residual_out is not None else 0,
        eps, BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, PROLOGUE=prologue, ADD_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, GATED=gated, num_warps=config.num_warps,
        **triton_overlap.launch_options(x.device),
    )
    return out, residual_out


def takes_gemv(rows: int, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether a product of ``rows`` rows by ``weight`` runs on the GEMV (else a GEMM): up to
    ``max_rows`` rows, and past one row on narrow rows or while ``rows`` times the weight's
    bytes are at most ``GEMV_MAX_ROW_BYTES``.

    A program holds its rows' whole slices of the input and of the products (``gemv_config``):
    compiled for SM 9.0 at 4,096 columns (8 warps a program), a thread takes 48-112 registers
    at one row, 104 (o_proj, down_proj) to 213 (qkv_proj, gate_up_proj with the norm) at two
    and 190-255 at four (gate_up spills): two programs an SM or one, each waiting for its
    weight tile with no other to cover it (at 1,024 columns, 4 warps: 120 registers at four
    rows, four programs). A small weight is a wave or two of programs either way: Qwen3-0.6B's
    projections (4-12 MiB) took a decode step of 4 sequences 1.54 -> 1.36 ms on the GEMVs,
    and its LM head (311 MB, but 1,024 columns) 111.5 us at 4 rows against cuBLAS's 112.9
    (H100). Qwen3-8B's (32-192 MiB, 4,096 and 12,288 columns) take many waves: its bf16
    decode step of 4 sequences took 9.21 ms on an H200 (one sequence's: 5.7 ms on an H100),
    its GEMVs 70 us a call on average. cuBLAS reads them at 70-87% of an H200's bandwidth at
    2-8 rows (``fp8_gemm.py``'s bf16 column: 104 us a layer). With this bound, on an H100,
    the 8B's bf16 decode step took 9.81 -> 6.16 ms at 4 sequences, 6.19 -> 5.91 at 2."""
    return rows <= max_rows and (
        rows <= 1 or weight.shape[-1] <= NARROW_COLUMNS
        or rows * weight.numel() * weight.element_size() <= GEMV_MAX_ROW_BYTES)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` with few rows and ``weight [N, K]``."""
    return _launch(x, weight, bias, PLAIN, config=config)[0]


def rms_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None = None, config: GemvConfig | None = None,
                  gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear.rms_norm_linear`` for ``x [M, K]`` with few rows (``gated``: the weight is
    ``[gate | up]`` and the output ``silu(gate) * up``)."""
    out, summed = _launch(x, weight, bias, NORM, residual, norm_weight, eps, config, gated)
    return out, x if summed is None else summed
