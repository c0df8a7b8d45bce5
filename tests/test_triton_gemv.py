"""The Triton GEMVs (alone, with residual add and RMS norm before them, and with the MLP's
activation after a ``[gate | up]`` product) and the projections of ``TRITON_KERNELS`` against the torch references, on CPU through Triton's
interpreter (float32 and float16). The GPU tests in ``tests/gpu`` cover bf16."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import nanofn.kernels.triton_gemv as triton_gemv
import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import linear, rms_norm_linear
from nanofn.kernels.triton_gemv import GemvConfig

DTYPES = [torch.float32, torch.float16]
# Sums of a few hundred products in another order; float16 outputs of magnitude ~10 are rounded
# to 2^-7, and a norm's float16 rounding may land one step apart.
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=2e-2, rtol=2e-3)}
# Shapes (N, K) whose edges fall inside a tile, and launch configs with several K steps (but
# with a norm, whose tile holds whole rows).
SHAPES = [(40, 96), (33, 300)]
CONFIGS = [GemvConfig(8, 64, 4), GemvConfig(16, 128, 2), None]  # None: gemv_config's choice
NORM_CONFIGS = [GemvConfig(8, 512, 4), GemvConfig(1, 512, 2), None]


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])  # tiles of 1 and 8 rows
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_matches_reference(interpreter, dtype, rows, shape, config, bias):
    n, k = shape
    x = randn(rows, k + 8, seed=rows, dtype=dtype)[:, :k]  # strided rows
    weight = randn(n, k, seed=k, dtype=dtype, scale=0.5)
    b = randn(n, seed=n, dtype=dtype) if bias else None

    out = interpreter(triton_gemv.gemv, x, weight, b, config)

    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out, linear(x, weight, b), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("config", NORM_CONFIGS, ids=str)
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "add-and-norm"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_rms_norm_gemv_matches_reference(interpreter, dtype, rows, shape, config, add_residual,
                                         gated):
    """Gated, the weight is ``[gate | up]`` (2n rows, a bias for each) and the output is
    ``silu(gate) * up``: a program multiplies outputs of both halves."""
    n, k = shape
    weight_rows = 2 * n if gated else n
    x = randn(rows, k, seed=rows, dtype=dtype, scale=3.0)
    residual = randn(rows, k, seed=rows + 1, dtype=dtype) if add_residual else None
    norm_weight = (torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5).to(dtype)
    weight = randn(weight_rows, k, seed=n, dtype=dtype, scale=0.5)
    bias = randn(weight_rows, seed=n + 1, dtype=dtype)

    out, summed = interpreter(triton_gemv.rms_norm_gemv, x, norm_weight, 1e-6, residual, weight,
                              bias, config, gated)

    expected, expected_summed = rms_norm_linear(x, norm_weight, 1e-6, residual, weight, bias,
                                                gated=gated)
    assert torch.equal(summed, expected_summed)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("rows", [1, 4])
def test_gated_gemv_config_reads_as_many_weight_rows_a_program(rows):
    """A gated program multiplies ``block_n`` outputs of each half: half of what the plain
    projection of the whole ``[gate | up]`` weight gives a program."""
    plain = triton_gemv.gemv_config(6144, 1024, rows, triton_gemv.NORM)
    gated = triton_gemv.gemv_config(3072, 1024, rows, triton_gemv.NORM, gated=True)
    assert 2 * gated.block_n == plain.block_n and gated.block_k == plain.block_k


def test_the_gemv_takes_a_few_rows_of_a_small_or_narrow_weight_only():
    """One row: the GEMV, whatever the weight. Past it: Qwen3-0.6B's projections (at most 12
    MiB) and its LM head (1,024 columns) up to ``GEMV_MAX_ROWS``; Qwen3-8B's o_proj (32 MiB) at
    two rows, its qkv_proj (48 MiB) and LM head (4,096 columns) at one."""
    def rows_taken(n, k):
        weight = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
        return [r for r in range(1, 6) if triton_gemv.takes_gemv(r, weight, 4)]

    assert rows_taken(1024, 3072) == rows_taken(6144, 1024) == [1, 2, 3, 4]
    assert rows_taken(151936, 1024) == [1, 2, 3, 4]
    assert rows_taken(4096, 4096) == [1, 2]
    assert rows_taken(6144, 4096) == rows_taken(151936, 4096) == [1]


def test_a_few_rows_of_a_large_weight_take_the_gemm_with_the_same_result(interpreter):
    """Past ``GEMV_MAX_ROW_BYTES`` (here set to 0, at 2,048 columns) two rows take the norm
    kernel and cuBLAS (here the CPU's matmul), as more rows do."""
    dtype, k = torch.float32, 2048
    x, residual = randn(2, k, seed=13, dtype=dtype), randn(2, k, seed=14, dtype=dtype)
    gate_up, norm_weight = randn(64, k, seed=15, dtype=dtype), randn(k, seed=16, dtype=dtype)
    weight, bias = randn(32, k, seed=17, dtype=dtype), randn(32, seed=18, dtype=dtype)
    got = interpreter(projections_off_the_gemv, x, residual, gate_up, norm_weight, weight, bias)
    expected = reference_projections(x, residual, gate_up, norm_weight, weight, bias)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def projections_off_the_gemv(*args):
    """``triton_projections`` with ``GEMV_MAX_ROW_BYTES`` at 0, failing if a GEMV launches."""
    with mock.patch.object(triton_gemv, "GEMV_MAX_ROW_BYTES", 0), \
            mock.patch.object(triton_gemv, "_launch", side_effect=AssertionError("a GEMV")):
        return triton_projections(*args)


def test_rms_norm_gemv_refuses_a_tile_narrower_than_a_row():
    x, weight = torch.zeros(1, 300), torch.zeros(8, 300)
    with pytest.raises(AssertionError, match="a norm's tile holds whole rows"):
        triton_gemv.rms_norm_gemv(x, torch.ones(300), 1e-6, None, weight, config=GemvConfig(8, 256, 4))


@pytest.mark.parametrize("rows", [1, triton_ops.GEMV_MAX_ROWS, triton_ops.GEMV_MAX_ROWS + 1])
def test_triton_projections_match_references_on_either_side_of_the_gemv_bound(interpreter, rows):
    """Up to ``GEMV_MAX_ROWS`` tokens the projections run as GEMVs, beyond as cuBLAS (here the
    CPU's matmul) after the unfused kernels: the same results either way."""
    dtype, (n, k) = torch.float32, SHAPES[1]
    x, residual = randn(rows, k, seed=1, dtype=dtype), randn(rows, k, seed=2, dtype=dtype)
    gate_up = randn(2 * n, k, seed=3, dtype=dtype)
    norm_weight, weight = randn(k, seed=4, dtype=dtype), randn(n, k, seed=5, dtype=dtype)
    bias = randn(n, seed=6, dtype=dtype)

    got = interpreter(triton_projections, x, residual, gate_up, norm_weight, weight, bias)

    expected = reference_projections(x, residual, gate_up, norm_weight, weight, bias)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_triton_projections_keep_leading_dimensions(interpreter):
    dtype, (n, k) = torch.float32, SHAPES[0]
    x, residual = randn(1, 2, k, seed=7, dtype=dtype), randn(1, 2, k, seed=8, dtype=dtype)
    gate_up, norm_weight = randn(2 * n, k, seed=9, dtype=dtype), randn(k, seed=10, dtype=dtype)
    weight, bias = randn(n, k, seed=11, dtype=dtype), randn(n, seed=12, dtype=dtype)

    got = interpreter(triton_projections, x, residual, gate_up, norm_weight, weight, bias)

    expected = reference_projections(x, residual, gate_up, norm_weight, weight, bias)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def triton_projections(x, residual, gate_up, norm_weight, weight, bias):
    """``gate_up``: a ``[gate | up]`` weight, projected after the norm with the activation."""
    return (triton_ops.linear(x, weight, bias),
            triton_ops.rms_norm_linear(x, norm_weight, 1e-6, residual, gate_up, gated=True),
            triton_ops.rms_norm_linear(x, norm_weight, 1e-6, residual, weight, bias),
            triton_ops.rms_norm_linear(x, norm_weight, 1e-6, None, weight))


def reference_projections(x, residual, gate_up, norm_weight, weight, bias):
    return (linear(x, weight, bias),
            rms_norm_linear(x, norm_weight, 1e-6, residual, gate_up, gated=True),
            rms_norm_linear(x, norm_weight, 1e-6, residual, weight, bias),
            rms_norm_linear(x, norm_weight, 1e-6, None, weight))
