"""The split-K GEMM's partial sums (``triton_gemm.py``) and the norm that adds them up, in bf16 at
Qwen3-0.6B's o_proj and down_proj shapes, and the GEMM with K in one range at qkv_proj's and
gate_up_proj's, against torch on a CUDA GPU; the same results from a CUDA graph; and the
engine's tokens with these GEMMs on and off (float32, greedy). Errors
are ``|out - ref| / |ref|`` over the whole output against a float32 reference on the upcast
bf16 inputs, the bound cuBLAS's bf16 result is held to."""

from __future__ import annotations

import pytest
import torch

import nanofn.kernels.triton_gemm as triton_gemm
import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import linear, rms_norm, rms_norm_linear
from nanofn.kernels.triton_gemm import GemmConfig
from test_triton_gemv_gpu import EPS, SHAPES, TOLERANCE, greedy_batches, relative_error, upcast
from test_triton_ops_gpu import norm_weight, randn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROWS = [5, 16, 100, 128, 256]
# gemm_config's choice, one not split, and one split 2 ways with tiles of 32 rows and outputs
CONFIGS = [None, GemmConfig(64, 64, 64, 1), GemmConfig(32, 32, 128, 2, num_warps=8)]


@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", ["o_proj", "down"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_partial_sums_add_up_to_the_product(name, rows, config):
    n, k = SHAPES[name]
    x, weight = randn(rows, k, seed=rows), randn(n, k, seed=n, scale=0.03)

    sums = triton_gemm.partial_sums_gemm(x, weight, config)

    assert sums.dtype == torch.bfloat16
    assert relative_error(sums.total(), linear(*upcast(x, weight))) < TOLERANCE


@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("rows", [5, 16, 32, 64])
@pytest.mark.parametrize("name", ["qkv", "gate_up"])
@pytest.mark.parametrize("config", [None, GemmConfig(32, 128, 64, 1, num_warps=8)], ids=str)
def test_gemm_with_k_in_one_range_matches_torch(name, rows, config):
    n, k = SHAPES[name]
    x, weight = randn(rows, k, seed=rows), randn(n, k, seed=n, scale=0.03)

    out = triton_gemm.gemm(x, weight, config)

    assert relative_error(out, linear(*upcast(x, weight))) < TOLERANCE


@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("rows", [5, 64])
def test_the_norm_and_projection_after_it_on_the_gemm(rows):
    """``rms_norm_linear`` at qkv's shape: the norm kernel, then the GEMM; the residual stream
    is the norm kernel's."""
    n, k = SHAPES["qkv"]
    x, residual, weight = randn(rows, k, seed=11), randn(rows, k, seed=12), randn(n, k, seed=13, scale=0.03)
    scale = norm_weight(k, seed=14)

    out, summed = triton_ops.rms_norm_linear(x, scale, EPS, residual, weight)

    assert torch.equal(summed, triton_ops.rms_norm(x, scale, EPS, residual)[1])
    expected = rms_norm_linear(*upcast(x, scale), EPS, *upcast(residual, weight))[0]
    assert relative_error(out, expected) < TOLERANCE


@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("rows", [5, 256])
def test_the_norm_adds_the_sums_up_as_their_total(rows):
    """The residual stream is the total's, bit for bit; the normed rows within the norm's own
    rounding of it."""
    n, k = SHAPES["o_proj"]
    sums = triton_gemm.partial_sums_gemm(randn(rows, k, seed=1), randn(n, k, seed=2, scale=0.03))
    residual, scale = randn(rows, n, seed=3), norm_weight(n, seed=4)

    normed, summed = triton_ops.rms_norm(sums, scale, EPS, residual)

    expected_normed, expected_summed = triton_ops.rms_norm(sums.total(), scale, EPS, residual)
    assert torch.equal(summed, expected_summed)
    assert relative_error(normed, rms_norm(*upcast(sums.total(), scale), EPS, residual.float())[0]) < TOLERANCE
    torch.testing.assert_close(normed, expected_normed, atol=0, rtol=0)


def test_the_split_k_gemm_and_its_norm_replay_from_a_cuda_graph():
    n, k = SHAPES["down"]
    x, weight = randn(64, k, seed=5), randn(n, k, seed=6, scale=0.03)
    residual, scale = randn(64, n, seed=7), norm_weight(n, seed=8)

    def run():
        sums = triton_gemm.partial_sums_gemm(x, weight)
        return (sums.sums, *triton_ops.rms_norm(sums, scale, EPS, residual))

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    x.copy_(randn(64, k, seed=9))
    residual.copy_(randn(64, n, seed=10))
    graph.replay()

    for out, expected in zip(outs, run()):  # eager, on the new inputs
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_engine_tokens_are_the_same_with_the_triton_gemms_on_and_off(tiny_qwen3, monkeypatch):
    """Greedy float32 decoding of batches of one to five sequences (graphs of 1-8 rows: the
    GEMVs up to four, the GEMMs of ``triton_gemm.py`` for five, and for prompts of up to 64 and
    256 tokens) gives the same tokens with them (the default) as with cuBLAS."""
    from nanofn.runner import model_runner

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (2, 33, 70, 11, 50)]
    launches = []
    for name in ("gemm", "partial_sums_gemm"):
        launch = getattr(triton_gemm, name)
        monkeypatch.setattr(triton_gemm, name, lambda *a, launch=launch, name=name, **kw:
                            launches.append(name) or launch(*a, **kw))
    with_triton = greedy_batches(tiny_qwen3, prompts)
    assert set(launches) == {"gemm", "partial_sums_gemm"}
    choose_kernels = model_runner.choose_kernels
    monkeypatch.setattr(model_runner, "choose_kernels",
                        lambda *a, **kw: triton_ops.with_triton_gemm_max_rows(
                            choose_kernels(*a, **kw), 0))
    launches.clear()
    assert greedy_batches(tiny_qwen3, prompts) == with_triton
    assert not launches
