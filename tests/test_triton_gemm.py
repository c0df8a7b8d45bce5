"""The split-K GEMM whose partial sums the norm adds up (``triton_gemm.py``, ``PartialSums``), the
norm kernel reading them, the same GEMM with K in one range, and which projections
``TRITON_KERNELS`` runs on them, on CPU through Triton's interpreter (float32 and float16).
bf16 at the model's shapes: ``tests/gpu/test_triton_gemm_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from test_triton_gemv import DTYPES, TOLERANCES, randn

import nanofn.kernels.triton_gemm as triton_gemm
import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import TORCH_KERNELS, PartialSums, linear, rms_norm
from nanofn.kernels.partial_sums import added_up, linear_partial_sums
from nanofn.kernels.triton_gemm import GemmConfig

N, K = 40, 256  # 40 outputs: a tile's edge falls inside them
CONFIGS = [GemmConfig(16, 32, 32, 1), GemmConfig(16, 32, 64, 2), GemmConfig(32, 16, 32, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 40])  # one tile of rows, and three with the last part-filled
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_partial_sums_are_the_products_of_the_ranges_of_k(interpreter, dtype, rows, config):
    x = randn(rows, K + 8, seed=rows, dtype=dtype)[:, :K]  # strided rows
    weight = randn(N, K, seed=1, dtype=dtype, scale=0.5)

    got = interpreter(triton_gemm.partial_sums_gemm, x, weight, config)

    expected = linear_partial_sums(x, weight, config.split_k)
    assert got.dtype == dtype and got.sums.dtype == torch.float32
    assert got.sums.shape == (config.split_k, rows, N)
    torch.testing.assert_close(got.sums, expected.sums, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got.total(), linear(x, weight), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 40])
@pytest.mark.parametrize("config", [GemmConfig(16, 32, 32, 1), GemmConfig(32, 16, 64, 1), None],
                         ids=str)
def test_gemm_with_k_in_one_range_is_the_product(interpreter, dtype, rows, config):
    x = randn(rows, K + 8, seed=rows, dtype=dtype)[:, :K]  # strided rows
    weight = randn(N, K, seed=1, dtype=dtype, scale=0.5)

    got = interpreter(triton_gemm.gemm, x, weight, config)

    assert got.dtype == dtype and got.shape == (rows, N)
    torch.testing.assert_close(got, linear(x, weight), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "add-and-norm"])
def test_the_norm_adds_partial_sums_up_in_order_before_it_normalises(interpreter, dtype, splits,
                                                                     add_residual):
    """The sum, rounded once to the dtype, is the projection's output: the residual stream it
    makes is the reference's bit for bit."""
    rows, size = 6, 96
    sums = PartialSums(randn(splits, rows, size, seed=2, dtype=torch.float32, scale=2.0), dtype)
    residual = randn(rows, size, seed=3, dtype=dtype) if add_residual else None
    weight = (torch.rand(size, generator=torch.Generator().manual_seed(4)) + 0.5).to(dtype)

    got = interpreter(triton_ops.rms_norm, sums, weight, 1e-6, residual)

    expected = rms_norm(sums.total(), weight, 1e-6, residual)
    if add_residual:
        assert torch.equal(got[1], expected[1])
        got, expected = got[0], expected[0]
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def projections(x, weights, norm_weight, residual):
    """A layer's chain on ``TRITON_KERNELS`` with the GEMMs of ``triton_gemm.py`` up to 16
    tokens: o_proj asked for partial sums, the norm with gate_up_proj gated, down_proj
    asked for partial sums, the norm with a plain projection. Each result, and which GEMMs ran."""
    launches = []
    names = ("gemm", "partial_sums_gemm")
    launchers = {name: getattr(triton_gemm, name) for name in names}
    for name, launch in launchers.items():
        setattr(triton_gemm, name, lambda *a, launch=launch, name=name: launches.append(name) or launch(*a))
    try:
        return layer_chain(triton_ops.with_triton_gemm_max_rows(triton_ops.TRITON_KERNELS, 16), x,
                           weights, norm_weight, residual), launches
    finally:
        for name, launch in launchers.items():
            setattr(triton_gemm, name, launch)


def layer_chain(kernels, x, weights, norm_weight, residual):
    o_weight, gate_up_weight, down_weight, qkv_weight = weights
    o = kernels.linear(x, o_weight, partial_sums=True)
    activated, summed = kernels.rms_norm_linear(o, norm_weight, 1e-6, residual, gate_up_weight,
                                                gated=True)
    down = kernels.linear(activated, down_weight, partial_sums=True)
    qkv, _ = kernels.rms_norm_linear(down, norm_weight, 1e-6, summed, qkv_weight)
    return o, activated, down, qkv


@pytest.mark.parametrize("rows, kernels", [
    (3, []), (5, ["partial_sums_gemm", "gemm", "partial_sums_gemm", "gemm"]),
    (16, ["partial_sums_gemm", "gemm", "partial_sums_gemm", "gemm"]), (17, [])],
    ids=["gemv", "triton gemms", "triton gemms at the bound", "cublas above it"])
def test_projections_take_the_triton_gemms_between_the_gemvs_and_the_bound(interpreter, rows,
                                                                          kernels):
    """Up to ``GEMV_MAX_ROWS`` tokens the GEMVs, then the GEMMs of ``triton_gemm.py`` (partial
    sums where asked for, the product itself after a norm, then the activation kernel where
    gated) up to the bound, cuBLAS above it: the same results either way, and the norm takes
    partial sums or a tensor."""
    dtype = torch.float32
    x = randn(rows, K, seed=5, dtype=dtype)
    weights = (randn(K, K, seed=7, dtype=dtype, scale=0.1), randn(2 * K, K, seed=6, dtype=dtype, scale=0.1),
               randn(K, K, seed=8, dtype=dtype, scale=0.1), randn(N, K, seed=11, dtype=dtype))
    norm_weight, residual = randn(K, seed=9, dtype=dtype), randn(rows, K, seed=10, dtype=dtype)

    got, launches = interpreter(projections, x, weights, norm_weight, residual)

    assert launches == kernels
    o, activated, down, qkv = got
    assert isinstance(o, PartialSums) == isinstance(down, PartialSums) == bool(kernels)
    expected = layer_chain(TORCH_KERNELS, x, weights, norm_weight, residual)
    for out, want in zip((added_up(o), activated, added_up(down), qkv), expected):
        torch.testing.assert_close(out, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("case", ["not asked", "a bias", "K not in whole steps", "leading dims"])
def test_projections_come_whole_where_partial_sums_do_not_fit(interpreter, case):
    dtype, rows = torch.float32, 8
    k = 200 if case == "K not in whole steps" else K
    x, weight = randn(rows, k, seed=11, dtype=dtype), randn(N, k, seed=12, dtype=dtype)
    x = x.view(2, rows // 2, k) if case == "leading dims" else x
    bias = randn(N, seed=13, dtype=dtype) if case == "a bias" else None
    asked = case != "not asked"

    out = interpreter(triton_ops.linear, x, weight, bias, asked)

    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, linear(x, weight, bias), **TOLERANCES[dtype])


def test_the_triton_gemms_keep_to_the_widths_they_were_measured_at():
    """Qwen3-0.6B's K (1,024 before a norm's projections, 2,048 and 3,072 for o_proj and
    down_proj) were measured faster than cuBLAS; Qwen3-8B's (4,096, 12,288) were not, and keep
    cuBLAS."""
    assert triton_gemm.whole_gemm_config(1024, 64) is not None
    assert triton_gemm.whole_gemm_config(4096, 64) is None
    assert triton_gemm.gemm_config(3072, 64) is not None
    assert triton_gemm.gemm_config(4096, 64) is None

